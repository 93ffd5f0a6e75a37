"""GB/s of the integrity hashes the disk method could use, on 64 MiB buffers (issue 27 item 1).

Run from the repository root: ``PYTHONPATH=. .venv/bin/python dev/measure_hashes.py [--mib 64]
[--repeats 7]``. Prints, per hash, the median GB/s (1 GB = 1e9 bytes) of hashing one buffer of
random bytes, whole and in 8 MiB chunks (how the disk method feeds it), and notes a package that
is not installed. Backs the hash table in docs/benchmarks.md (the choice of ``disk_hash``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time


class _Crc32c:
    """google_crc32c takes only ``bytes`` (not a memoryview of a tensor's buffer): each update
    pays the copy the disk method would pay to feed it."""

    def __init__(self) -> None:
        import google_crc32c
        self._extend, self._crc = google_crc32c.extend, 0

    def update(self, data) -> None:
        self._crc = self._extend(self._crc, data if isinstance(data, bytes) else bytes(data))

    def digest(self) -> bytes:
        return self._crc.to_bytes(4, "big")


def _candidates() -> dict:
    out = {"sha256": lambda: hashlib.sha256()}
    try:
        import xxhash
        out["xxh3_128"] = xxhash.xxh3_128
        out["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        print("xxhash: not installed")
    try:
        import blake3
        out["blake3"] = blake3.blake3
        out["blake3 (max_threads=AUTO)"] = lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)
    except ImportError:
        print("blake3: not installed")
    try:
        import google_crc32c
        print(f"google_crc32c implementation: {google_crc32c.implementation}")
        out["crc32c (bytes copy per update)"] = _Crc32c
    except ImportError:
        print("google-crc32c: not installed")
    out["blake2b"] = lambda: hashlib.blake2b()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk-mib", type=int, default=8)
    a = p.parse_args()
    buf = os.urandom(a.mib << 20)      # bytes: google_crc32c takes read-only buffers only
    view = memoryview(buf)
    chunk = a.chunk_mib << 20
    print(f"load average {os.getloadavg()}; {a.mib} MiB buffer, median of {a.repeats}")
    for name, make in _candidates().items():
        rates = {}
        for how in ("whole", f"{a.chunk_mib} MiB chunks"):
            times = []
            for _ in range(a.repeats + 1):
                t0 = time.perf_counter()
                h = make()
                if how == "whole":
                    h.update(view)
                else:
                    for i in range(0, len(buf), chunk):
                        h.update(view[i:i + chunk])
                h.digest()
                times.append(time.perf_counter() - t0)
            rates[how] = len(buf) / statistics.median(times[1:]) / 1e9
        print(f"{name:28s} " + "  ".join(f"{how}: {r:6.2f} GB/s" for how, r in rates.items()))
    times = []
    dst = bytearray(len(buf))
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        dst[:] = buf
        times.append(time.perf_counter() - t0)
    print(f"{'memcpy (for scale)':28s} whole: {len(buf) / statistics.median(times[1:]) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
