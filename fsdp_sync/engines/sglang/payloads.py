"""Payloads for ``update_weights_from_tensor(load_format="flattened_bucket")``, one per TP rank.

`flattened_bucket_payloads(named_tensors, tp_size, output_str=False)`: element i is TP rank i's
payload (bytes, or base64 text for HTTP); it opens, with SGLang's restricted unpickler, to
``{"flattened_tensor": uint8 tensor, "metadata": [...]}`` (the dict is built in `fsdp_sync.wire`).
Offsets are aligned by `fsdp_sync.weights.bucket`; CPU buffers travel as shared memory by file
name, CUDA buffers as CUDA IPC handles (`fsdp_sync.weights.handles`). The payloads are untagged:
SGLang never acknowledges our ``"fsdp_sync"`` tag, so a tag would only make `release` complain.

**Lifetime rule.** The returned `BucketPayloads` is a list that also holds the buffers. Keep it
until the engine has answered the ``update_weights_from_tensor`` call, then `release()` it (or use
it as a context manager). Copies of its elements, or the list pickled (it pickles as a plain list,
e.g. through ``gather_object``), keep nothing alive. If SGLang refused the call before opening the
payloads (`SGLangUpdateError.opened` is False), ``release(unopened=True)`` gives their
shared-memory references back; the context manager does this by itself.

Not here: calling the engine (`adapter`), the per-rank loader SGLang imports (`loader`).
"""

from __future__ import annotations

import sys
from typing import Iterable, Mapping, Sequence

import torch

from ...weights import handles
from ...weights.bucket import ALIGNMENT, Bucket, TensorMeta, flatten, plan_buckets
from ...wire import flattened_bucket

__all__ = ["FLATTENED_BUCKET", "BucketPayloads", "bucket_payloads", "flattened_bucket_payloads"]

FLATTENED_BUCKET = "flattened_bucket"


# --------------------------------------------------------------------------- payloads

class BucketPayloads(list):
    """Per-TP-rank payloads of one flattened bucket (element i for rank i) and their lease.

    A plain list to whoever reads it (pickles as a plain list, so sending it through
    ``gather_object`` carries no buffer). Holding this object keeps the bucket's buffer alive;
    `release` frees it once the engine has answered and empties the list.
    """

    def __init__(self, payload_set: handles.PayloadSet, bucket: Bucket) -> None:
        super().__init__(payload_set.payloads)
        self.payload_set = payload_set
        self.bucket = bucket

    @property
    def names(self) -> list[str]:
        return self.bucket.names

    @property
    def nbytes(self) -> int:
        """Size of the flattened buffer, alignment padding included."""
        return self.bucket.nbytes

    @property
    def released(self) -> bool:
        return self.payload_set.released

    def release(self, *, unopened: bool | Sequence[int] = ()) -> None:
        """Free the buffer. Call after the engine answered.

        ``unopened``: TP ranks known never to have opened their payload (``True``: all of them),
        e.g. after SGLang refused the call before loading (`SGLangUpdateError.opened` is False).
        Their shared-memory references are given back, or the segment would outlive this call.
        """
        if self.payload_set.released:
            return
        ranks = range(len(self)) if unopened is True else (unopened or ())
        self.payload_set.release(require_ack=False, unopened=list(ranks))
        self.clear()

    def __enter__(self) -> "BucketPayloads":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        opened = getattr(exc, "opened", None) if exc is not None else None
        self.release(unopened=opened is False)

    def __reduce__(self):
        return (list, (list(self),))

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.nbytes} bytes"
        return f"BucketPayloads({len(self)} ranks, {len(self.bucket.entries)} tensors, {state})"


def bucket_payloads(flat: torch.Tensor, bucket: Bucket, tp_size: int, *,
                    output_str: bool = False) -> BucketPayloads:
    """Payloads of an already flattened bucket: ``flat`` (1-D uint8, laid out by ``bucket``).

    ``flat`` is shared as is (no copy) when it is a CUDA tensor or came from
    `fsdp_sync.weights.handles.empty_shared`; other CPU tensors are copied into shared memory once per rank.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not bucket.entries:
        raise ValueError("a flattened bucket needs at least one tensor "
                         "(SGLang rejects an empty bucket)")
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < bucket.nbytes:
        raise ValueError(f"flat must be a 1-D uint8 tensor of at least {bucket.nbytes} bytes, got "
                         f"{flat.dtype} {tuple(flat.shape)}")
    bad = [e.name for e in bucket.entries if e.start % e.dtype.itemsize]
    if bad:
        raise ValueError(f"tensors {bad} start at a byte offset that is not a multiple of their "
                         f"item size; SGLang cannot view them (plan them with "
                         f"fsdp_sync.weights.bucket.plan_buckets)")
    obj = flattened_bucket(flat, bucket)
    return BucketPayloads(handles.make_payloads(obj, tp_size, output_str=output_str, tagged=False),
                          bucket)


def flattened_bucket_payloads(named_tensors: Iterable[tuple[str, torch.Tensor]]
                              | Mapping[str, torch.Tensor],
                              tp_size: int, *, output_str: bool = False,
                              alignment: int = ALIGNMENT) -> BucketPayloads:
    """One flattened bucket of ``named_tensors`` as ``tp_size`` payloads, element i for TP rank i.

    Pass the result as ``named_tensors`` to ``update_weights_from_tensor(...,
    load_format="flattened_bucket")``; ``output_str=True`` gives base64 text for HTTP. All tensors
    must be contiguous, on one device (CPU or CUDA), of dtypes `fsdp_sync.weights.bucket` supports; every
    tensor starts at a multiple of ``alignment`` bytes. Keep the result until the engine answered,
    then `BucketPayloads.release` it.
    """
    items = (list(named_tensors.items()) if isinstance(named_tensors, Mapping)
             else list(named_tensors))
    if not items:
        raise ValueError("flattened_bucket_payloads needs at least one tensor "
                         "(SGLang rejects an empty bucket)")
    devices = sorted({str(t.device) for _, t in items})
    if len(devices) != 1:
        raise ValueError(f"all tensors of a bucket must be on one device, got {devices}")
    (bucket,) = plan_buckets([TensorMeta.of(n, t) for n, t in items], sys.maxsize,
                             alignment=alignment)
    flat = handles.empty_shared(bucket.nbytes, items[0][1].device)
    flatten(bucket, [t for _, t in items], out=flat)
    return bucket_payloads(flat, bucket, tp_size, output_str=output_str)
