"""What a fresh shared-memory buffer's pages cost a process that writes it, by how the pages
were made: the per-page costs behind the one-host per-rank sync (docs/experiments.md, "Batched page mapping").

For each way of making a 64 MiB ``/dev/shm`` file (``ftruncate`` only; ``posix_fallocate``, as
torch makes every segment; or written once already, as by another process), and each way of
touching it before the write (none; reading one byte per page, which lets the kernel map 16
pages per fault where the pages are written already; ``MADV_POPULATE_READ``/``WRITE``), it maps
the file afresh, copies 64 MiB into it and prints the seconds and the minor page faults.

Usage: PYTHONPATH=. .venv/bin/python dev/measure_shm_pages.py [--mib 64]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import time

import torch

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _make(path: str, n: int, how: str) -> tuple[int, float]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t0 = time.perf_counter()
    os.ftruncate(fd, n)
    if how in ("fallocate", "fallocate+pwrite"):
        os.posix_fallocate(fd, 0, n)
    if how in ("written", "fallocate+pwrite"):
        zeros = bytes(1 << 20)
        for off in range(0, n, len(zeros)):
            os.pwrite(fd, zeros, off)
    return fd, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    a = ap.parse_args()
    n = a.mib << 20
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    src = torch.ones(n, dtype=torch.uint8)
    path = f"/dev/shm/fsdp_sync_pages_{os.getpid()}"
    print(f"{'made by':18s} {'before the write':16s} {'make s':>7s} {'touch s':>8s} {'write s':>8s} "
          f"{'faults':>7s}")
    for made in ("ftruncate", "fallocate", "fallocate+pwrite"):
        for touch in ("none", "read each page", "populate_read", "populate_write"):
            fd, make_s = _make(path, n, made)
            try:
                m = mmap.mmap(fd, n)
                dst = torch.frombuffer(m, dtype=torch.uint8)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                f0, t0 = _faults(), time.perf_counter()
                if touch == "read each page":
                    int(dst[::4096].sum())
                elif touch.startswith("populate"):
                    adv = MADV_POPULATE_READ if touch == "populate_read" else MADV_POPULATE_WRITE
                    if libc.madvise(addr, n, adv) != 0:
                        raise OSError(ctypes.get_errno(), f"madvise({touch}) (Linux >= 5.14)")
                t1 = time.perf_counter()
                dst.copy_(src)
                t2 = time.perf_counter()
                print(f"{made:18s} {touch:16s} {make_s:7.4f} {t1 - t0:8.4f} {t2 - t1:8.4f} {_faults() - f0:7d}")
                del dst
                m.close()
            finally:
                os.close(fd)
                os.unlink(path)


if __name__ == "__main__":
    main()
