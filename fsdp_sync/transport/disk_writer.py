"""The disk method's writer thread: one bucket written while the collective stream makes the next.

Not here: what a file holds and how it is hashed (`weights.hf_checkpoint.write_safetensors`), the
sync's phases (`transport.disk`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from ..weights import hf_checkpoint as ckpt

__all__ = ["OneWriter"]

_END = object()


class OneWriter:
    """One writer thread over a collective bucket stream: at most one bucket is being written
    (`submit` waits for the previous one first) while the stream produces the next. The first
    error is kept (`fail`); after it the caller keeps consuming the stream, which is collective
    (a rank that stopped would leave its peers waiting), and submits nothing more.

    Files are written without waiting for the device (their writeback is started) and fsynced
    together once the stream ends (`drive`): an fsync per file, in turn, held the next bucket
    back until the device had the previous one (about 1 s of the write phase's 2 at qwen2-160m,
    the device idle meanwhile while the bucket was cut).

    ``seconds`` (this rank's split of the write phase): ``export_s`` the stream making buckets
    (gathers, the cut into per-rank buffers, waits on peers), ``write_s`` the writer thread writing
    and hashing files (beside the export), ``wait_s`` the stream held back by an unfinished write,
    ``fsync_s`` the fsyncs at the end."""

    def __init__(self, what: str, planned: int, directory: str) -> None:
        self.what, self.planned = what, planned      # what yields the buckets, how many it should
        self.directory = directory                   # where the records' files are
        self.records: list[dict] = []
        self.err: BaseException | None = None
        self.count = 0
        self._pending: Future | None = None
        self.seconds = {"export_s": 0.0, "write_s": 0.0, "wait_s": 0.0, "fsync_s": 0.0}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_sync-disk-writer")

    def fail(self, exc: BaseException) -> None:
        self.err = self.err or exc

    def collect(self) -> None:
        """Wait for the bucket being written, if any, and keep its records (raises its error)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            t0 = time.perf_counter()
            try:
                self.records.extend(fut.result())
            finally:
                self.seconds["wait_s"] += time.perf_counter() - t0

    def submit(self, fn: Callable[..., list[dict]], *args: Any) -> None:
        self.collect()
        self._pending = self._pool.submit(self._timed, fn, *args)

    def _timed(self, fn: Callable[..., list[dict]], *args: Any) -> list[dict]:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds["write_s"] += time.perf_counter() - t0

    def drive(self, stream: Iterable, body: Callable[[Any], None]) -> tuple[list[dict],
                                                                              BaseException | None]:
        """``body(item)`` for every item of ``stream`` (it catches its own errors into `fail`), then
        the last write is waited for; returns the records and the first error, a count of buckets
        other than the planned one included."""
        sec = self.seconds
        try:
            items = iter(stream)
            while True:
                t0 = time.perf_counter()
                item = next(items, _END)
                sec["export_s"] += time.perf_counter() - t0
                if item is _END:
                    break
                self.count += 1
                body(item)
                del item        # not alive while the stream makes the next bucket
            try:
                self.collect()
                t0 = time.perf_counter()
                if self.err is None:
                    for r in self.records:   # durable before this rank reports its files written
                        ckpt.fsync_file(os.path.join(self.directory, r["file"]))
                sec["fsync_s"] = time.perf_counter() - t0
            except Exception as exc:   # noqa: BLE001
                self.fail(exc)
        except Exception as exc:   # noqa: BLE001 - stream failures come as the same SyncError
            self.fail(exc)
        finally:
            if self._pending is not None:
                self._pending.cancel()
            self._pool.shutdown(wait=True)
        if self.err is None and self.count != self.planned:
            self.err = RuntimeError(f"{self.what} yielded {self.count} buckets, {self.planned} "
                                    f"were planned")
        return self.records, self.err
