"""verl's weight stream on the adapter's side: walking it, timing it, packing it.

- `pulled_in_a_thread`: a consumer written for a plain iterator, fed from an async iterable
  (verl's checkpoint engines' ``receive_weights`` are async generators) without blocking the
  event loop the stream runs on;
- `drained`: the rest of such a stream walked and dropped, after a refusal or a failure, so its
  sender is not left waiting;
- `reuses_memory`: whether a stream may overwrite a tensor it yielded once the next is pulled
  (verl's checkpoint engines' receivers do: a consumer that keeps tensors across a pull copies
  them);
- `timed`: the seconds spent waiting on the stream (verl's export, or the receive);
- `Walked`: verl's colocated export, walked to its end after a failed sync (`Walked.rest`), so the
  other replicas' ranks, whose every weight is an all-gather with this rank, finish theirs;
- `BucketBuffer`: one trainer rank's reused flat buffer, filled tensor by tensor.

Not here: what goes to the engine (the adapter's calls, `fsdp_sync.transport.tensor`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterable, Iterable, Iterator

import torch

from ...weights import handles
from ...weights.bucket import ALIGNMENT, Bucket, TensorMeta, plan_buckets

__all__ = ["pulled_in_a_thread", "drained", "reuses_memory", "timed", "Walked", "BucketBuffer"]

log = logging.getLogger("fsdp_sync.verl")


async def pulled_in_a_thread(weights: AsyncIterable, run: Any) -> Any:
    """``run(iterator)`` in a thread, the iterator pulling ``weights`` (an async iterable: verl's
    checkpoint engines' ``receive_weights``) one item at a time on this event loop, which stays
    free to run what the stream awaits (a receive thread, a socket). Nothing is read ahead: an
    item is requested only after the previous one was consumed (a receiver may reuse its buffer).
    If ``run`` fails, the rest of the stream is walked, so the sender and the other receivers of
    the sync end with it instead of waiting out their timeouts; then the error is raised."""
    loop = asyncio.get_running_loop()
    stream = weights.__aiter__()
    failed_in_stream = False
    device = (torch.cuda.current_device()
              if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    async def next_item() -> Any:    # a coroutine: what run_coroutine_threadsafe takes
        return await stream.__anext__()

    def pulled() -> Iterator:
        nonlocal failed_in_stream
        while True:
            try:
                item = asyncio.run_coroutine_threadsafe(next_item(), loop).result()
            except StopAsyncIteration:
                return
            except BaseException:
                failed_in_stream = True
                raise
            yield item

    def in_thread() -> Any:
        if device is not None:       # a thread's CUDA device is its own: the caller's
            torch.cuda.set_device(device)
        return run(pulled())

    try:
        return await asyncio.to_thread(in_thread)
    except Exception:
        if not failed_in_stream:
            await drained(stream)
        raise
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


async def drained(weights: Any) -> None:
    """Walk the rest of ``weights`` where it is an async iterable (verl's checkpoint engines'
    ``receive_weights``), dropping each item, so the sender and the other receivers of the sync
    end with it instead of waiting out their timeouts (a sender's broadcast waits for every
    receiver). For a consumer that fails or refuses before or while walking it; a failure inside
    the stream is dropped (the consumer's error is the one to raise). A plain iterator is left as
    it is: verl's colocated export, whose collectives every rank of a refusing group skips alike."""
    if not hasattr(weights, "__aiter__"):
        return
    stream = weights.__aiter__()
    try:
        async for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - the consumer's own error is the one to raise
        pass
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:  # noqa: BLE001 - as above
                pass


def reuses_memory(weights: Any) -> bool:
    """Whether ``weights`` may overwrite a tensor it yielded once the next item is pulled.

    verl's checkpoint engines hand ``receive_weights()``, an async generator, and verl 0.9.1's
    ``nccl`` receiver (``nccl_checkpoint_engine.py`` ~449-508) yields views into two buffers it
    alternates: pulling the first tensor of bucket k+1 starts the broadcast of bucket k+2 into
    bucket k's buffer, so a view of bucket k kept past that pull changes under its holder (a
    tensor larger than a bucket is merged into memory of its own, ``base.merge_weight_chunks``).
    Async streams are taken to do this unless they say they do not (``views_stay_valid``:
    fsdp_sync's own engine, `checkpoint_engine.ReceivedWeights`, allocates each bucket afresh).
    verl's colocated export (a plain generator of ``full_tensor()`` results) does not."""
    return hasattr(weights, "__aiter__") and not getattr(weights, "views_stay_valid", False)


def timed(weights: Iterable, phases: dict) -> Iterator:
    """``weights`` as they come, adding the seconds spent producing them to ``phases["export_s"]``."""
    it = iter(weights)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            phases["export_s"] += time.perf_counter() - t0
            return
        phases["export_s"] += time.perf_counter() - t0
        yield item


class Walked:
    """``weights`` (a plain iterable: verl's colocated export) as an iterator that knows whether a
    pull failed. verl's export is one ``full_tensor()`` per parameter, an all-gather over every
    trainer rank, and each infer-TP group (replica) walks it with its own sync: a group whose sync
    failed (its engine refused a bucket, its server was not reached) and stopped walking left the
    other groups' ranks in their next all-gather until the process group's timeout. `rest` walks
    what is left, dropping it, unless a pull itself failed (that collective is what broke). Every
    rank of a failed group calls it (the failure is agreed over the group); where every group
    fails alike, every rank walks the export once more, in step."""

    def __init__(self, weights: Iterable) -> None:
        self.it = iter(weights)
        self.failed = False

    def __iter__(self) -> "Walked":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise

    def rest(self) -> None:
        if self.failed:
            return
        try:
            for _ in self:
                pass
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to raise
            log.warning("fsdp_sync: walking the rest of verl's export after a failed sync: %s", exc)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class BucketBuffer:
    """One trainer rank's reused flat buffer, filled tensor by tensor from verl's generator.

    The buffer holds at most ``capacity`` (the bucket) but is never made larger than the stream
    needs: it starts at ``hint`` (what the previous sync filled; the first tensor's size on the
    first sync) and doubles, up to ``capacity``, when a tensor does not fit, copying what it
    holds. A 0.5 MiB model under verl's default 2 GiB bucket thus gets a 0.5 MiB buffer, not a
    2 GiB one made (and paged in) on every sync. While it grows, old and new buffers together stay
    under 1.5 x capacity."""

    def __init__(self, capacity: int, hint: int = 0) -> None:
        self.capacity = capacity
        self.hint = min(int(hint), capacity)
        self.buf: torch.Tensor | None = None
        self.metas: list[TensorMeta] = []
        self.offset = 0
        self.high = 0                        # the most bytes it needed at once (the next hint)

    def fits(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` joins this bucket: its end, padded to the alignment as
        `plan_buckets` pads a bucket (`BucketPacker`), within ``capacity``; an empty bucket takes
        any tensor."""
        return not self.metas or _aligned(_aligned(self.offset) + nbytes) <= self.capacity

    def _room(self, end: int, device: torch.device) -> None:
        buf = self.buf
        if buf is not None and buf.device == device and end <= buf.numel():
            return
        kept = self.offset if buf is not None and buf.device == device else 0
        size = max(end, self.hint, 2 * buf.numel() if kept else 0)
        size = min(max(size, end), max(self.capacity, end))
        new = handles.empty_shared(size, device)
        if kept:
            new[:kept].copy_(buf[:kept])
        self.buf = new

    def add(self, name: str, t: torch.Tensor) -> None:
        start = _aligned(self.offset)
        n = t.numel() * t.element_size()
        # the buffer holds the bucket's padded end: the payload (`wire.flattened_bucket`) is
        # ``bucket.nbytes``, the aligned end, long
        self._room(_aligned(start + n), t.device)
        if n:
            self.buf[start:start + n].copy_(t.reshape(-1).view(torch.uint8))
        self.metas.append(TensorMeta.of(name, t))
        self.offset = start + n
        self.high = max(self.high, _aligned(self.offset))   # what the buffer had to hold

    def bucket(self) -> Bucket:
        (bucket,) = plan_buckets(self.metas, max(self.capacity, 1), alignment=ALIGNMENT)
        return bucket

    def reset(self) -> None:
        self.metas, self.offset = [], 0
