"""The rollout-engine protocol fsdp_sync drives, with SGLang's names and meanings, and its small types.

`Engine` is a `typing.Protocol`: the part of SGLang's ``Engine`` API the sharding manager uses
(weight updates in three load formats, begin/end of an update, memory release/resume by tag, cache
flush, greedy/sampled generation) plus what tests and the demo need to check an engine against the
trainer (`get_weights_by_name`, `weights_checksum`, `forward_logits`, `memory_stats`).

Load formats of ``update_weights_from_tensor(named_tensors, load_format, flush_cache)``:

- ``None``: ``named_tensors`` is ``[(hf_name, value), ...]`` with Hugging Face names and *full*
  tensors; the engine shards and stacks. ``value`` is a plain tensor, or a `SerializedPerRank`
  (SGLang's ``LocalSerializedTensor``) whose ``values[i]`` is TP rank i's payload of the full tensor.
- ``"flattened_bucket"``: ``named_tensors`` is the list of per-rank payloads, element i for TP rank
  i; each opens to ``{"flattened_tensor": uint8, "metadata": [...]}`` (see `fsdp_sync.weights.bucket`).
- ``"direct"``: ``[(engine_param_name, value), ...]`` already in the engine's own layout: ``value``
  is a `SerializedPerRank` of per-rank shards, a list of per-rank tensors, or one tensor that every
  rank gets as is (replicated parameters). Or, like ``"flattened_bucket"``, a list of per-rank
  payloads of flattened buckets whose metadata names the engine's own parameters (each rank's
  bucket holds that rank's shards: one handle per rank for a layout-aware reshard).

Memory tags and orders are SGLang's (see `fsdp_sync.memory`): release kv_cache → weights →
cuda_graph, resume cuda_graph → weights → kv_cache; ``None`` means all.

In-flight weight updates and weight versions (SGLang 0.5.23's meanings; optional, see the end of
`Engine`): ``pause_generation(mode)`` with ``"abort"`` (requests in flight return at once, finish
reason ``abort``), ``"retract"`` (their KV is freed; they are recomputed after the continue, from
prompt + tokens so far with the weights loaded then) or ``"in_place"`` (they keep their KV and go
on from it); new requests queue while paused, and weight updates run at once.
``continue_generation()``. ``weight_version`` names the loaded weights: update calls take
``weight_version=`` where the engine's do (which: the end of `Engine`), taken at their commit;
``end_weight_update(weight_version=)`` takes it in the same critical section as the commit;
``update_weight_version(new_version, abort_all_requests)`` renames
them, ``get_weight_version()`` reads it, and generate results carry SGLang's ``weight_versions``
(``{"version", "start", "end"}`` spans over the output tokens) and ``weight_version``.
``set_serving(serving, reason)`` / ``serving_state`` (fsdp_sync's, a fleet's quarantine): out of
service, generate is refused naming the reason while updates and reads still work.

Also here: the errors every engine raises and `checksum_named_tensors`, the checksum a trainer can
compute over its own full tensors to compare with `Engine.weights_checksum`.

Not here: any engine (see `reference` and `sglang`), and no process is started by this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "Engine", "SerializedPerRank", "LOAD_FORMATS", "TAGS", "RELEASE_ORDER", "RESUME_ORDER",
    "ordered_tags", "EngineError", "WeightUpdateError", "WorkerDiedError", "EngineStateError",
    "EngineUnavailableError", "EngineClosedError", "VersionNotNamed", "checksum_named_tensors", "DETAIL_HEADER",
    "UNOPENED_MARK",
]

DETAIL_HEADER = "X-Fsdp-Sync-Detail"
"""The HTTP header in which `fsdp-sync serve` says why it refused a call whose body is SGLang's
bare text (a refused ``/flush_cache``: "Flush cache failed." and no reason); `SGLangEngine`'s
client puts it beside the body in the error it raises."""

UNOPENED_MARK = "no payload was opened"
"""What `fsdp-sync serve` adds to a tensor or LoRA update it refused before opening any of its
payloads (a field it refuses, a busy server's 503): `SGLangEngine`'s client then gives the
payloads' shared-memory references back at once (``opened`` False), instead of keeping them until
the sender's process exits, as it must where the server may have opened them."""

LOAD_FORMATS = (None, "flattened_bucket", "direct")
TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASE_ORDER = ("kv_cache", "weights", "cuda_graph")
RESUME_ORDER = ("cuda_graph", "weights", "kv_cache")


def ordered_tags(tags: Iterable[str] | str | None, order: Sequence[str]) -> list[str]:
    """``tags`` (None or empty = all, as SGLang's scheduler reads them) checked against `TAGS` and
    put in ``order``."""
    if tags is None:
        return list(order)
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    if not tags:
        return list(order)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; expected some of {list(TAGS)} or None (all)")
    return [t for t in order if t in tags]


@dataclass
class SerializedPerRank:
    """One value per TP rank: ``values[i]`` is TP rank i's payload (SGLang's ``LocalSerializedTensor``).

    Each element is a payload from `fsdp_sync.weights.handles.make_payloads` (bytes or base64 text), or for
    ``load_format="direct"`` also a plain tensor already sharded for that rank.
    """

    values: list

    def __post_init__(self) -> None:
        if not isinstance(self.values, (list, tuple)):
            raise TypeError(f"SerializedPerRank.values is a list (one entry per TP rank), got "
                            f"{type(self.values).__name__}")
        self.values = list(self.values)


# --------------------------------------------------------------------------- errors

class EngineError(RuntimeError):
    """An engine call failed; the message says which call, which rank and why."""


class WeightUpdateError(EngineError, ValueError):
    """A weight update was refused (unknown name, wrong shape or dtype, bad payload) and aborted on
    every rank: the engine still serves the weights it had before the call."""

    def __init__(self, message: str, *, rank: int | None = None, name: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.name = name


class WorkerDiedError(EngineError):
    """A worker process died. The engine cannot serve any more; every later call raises this."""

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class EngineStateError(EngineError):
    """The call does not fit the engine's state (weights released, KV cache released, an update
    already open, ...); nothing was changed."""


class VersionNotNamed(EngineError):
    """An engine committed a sync's weights but naming them (SGLang's ``update_weight_version``,
    a call of its own after the commit) failed: it serves the new weights under its old name."""


class EngineUnavailableError(EngineStateError):
    """The engine cannot take the call now, through no fault of the call: its weights or KV cache
    are released, it is out of service, or it stayed busy (running requests, another update) past
    the caller's wait limit. Nothing was changed; the same call may succeed later or on another
    engine (`fsdp-sync serve` answers it with HTTP 503)."""


class EngineClosedError(EngineError):
    """The engine was shut down."""


# --------------------------------------------------------------------------- checksums

def checksum_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One digest of named tensors, whatever their order: sha256 over the sorted sha256 digests of
    each tensor's ``(name, dtype, shape, bytes)``. Streams (one tensor's bytes at a time).

    Order-free, because the same weights arrive in different orders: a transformers-5 MoE trainer
    exports each layer's experts as its fused tensors are laid out (every gate, up, then down),
    a transformers-4 one and the engine expert by expert. `Engine.weights_checksum` is this over
    the engine's full tensors (a tied ``lm_head.weight`` counted once, as the embedding).
    """
    parts = []
    for name, t in named:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h = hashlib.sha256(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        parts.append(h.digest())
    return hashlib.sha256(b"".join(sorted(parts))).hexdigest()


# --------------------------------------------------------------------------- the protocol

@runtime_checkable
class Engine(Protocol):
    """What fsdp_sync needs from a rollout engine. Every method raises an `EngineError` on failure."""

    tp_size: int
    accepts_tagged_payloads: bool

    def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                   flush_cache: bool = True) -> None:
        """Load weights (see the module docstring for the formats). All or nothing: on any error
        every rank drops the update and the previous weights stay in service."""

    def begin_weight_update(self) -> None:
        """Open an update: calls until `end_weight_update` are one transaction."""

    def end_weight_update(self) -> None:
        """Commit the updates staged since `begin_weight_update` (an engine with weight versions
        also takes ``weight_version=``, see the module docstring). An engine that can drop what
        it staged takes ``abort=True`` too (returning False where what it applied stays): after a
        failed sync fsdp_sync calls that. Without ``abort`` it calls ``end_weight_update()`` to
        close the session (SGLang's sessions apply each call as it arrives; one left open refuses
        the next begin) and takes the engine as holding partly new weights: an engine that stages
        and has no ``abort`` commits there what it staged, so give it one."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free memory by tag (None = all), in the order kv_cache → weights → cuda_graph."""

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Reallocate memory by tag (None = all), in the order cuda_graph → weights → kv_cache."""

    def flush_cache(self) -> None:
        """Drop cached prefixes / KV entries."""

    def generate(self, input_ids: list[list[int]], max_new_tokens: int = 16,
                 temperature: float = 0.0) -> list[list[int]]:
        """New token ids per prompt."""

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """The full tensor of a Hugging Face parameter name, gathered from the shards."""

    # Optional: ``accepts_rank_buckets = True`` and ``load_rank_bucket(bucket, payloads, *,
    # flush_cache)`` (one payload per TP rank, each that rank's shard in engine names) let
    # `SyncConfig.layout` "engine"/"auto" send each rank only its own shard; with them
    # ``rank_bucket_payload = "tensor"`` where each payload is to be the bare flat tensor (SGLang's
    # loader; default "dict", the bucket dict) and ``layout`` (a `weights.layout` layout: its
    # ``spec`` is checked against the trainer's model before any bucket is cut).
    # Optional for method tensor: ``reads_may_outlast_answer = True`` where a call may be answered
    # before every rank of the engine finished reading the call's CUDA buffers (SGLang at TP > 1):
    # the trainer then lets two buffers take turns instead of rewriting one at the answer
    # (`transport.tensor.engine_reads_outlast`). Missing, it counts as False: an engine answers
    # once it is done with the call's buffers.
    # Optional: ``accepts_rank_checkpoints = True`` (with ``tp_size``): ``update_weights_from_disk``
    # loads per-rank checkpoints (`hf_checkpoint.resolve_ranked`), so the disk method writes them;
    # ``disk_bytes_read`` (per TP rank, the last disk update) feeds ``engine_rank_bytes_in``.
    # Optional with it: ``hash_files_ahead(directory, files, hash, published=None)``, a hint sent
    # without waiting that per-rank files of a version still being written are complete
    # (``published``: the version's name once renamed; `transport.disk_ranked`).
    # For method distributed: ``accepts_distributed_rank_buckets = True`` and
    # ``update_weights_from_distributed(load_format="per_rank_bucket")`` (`transport.group.PER_RANK_BUCKET`).
    # Optional, in-flight updates and versions (module docstring; `ReferenceEngine` and
    # `SGLangEngine` have them): ``pause_generation(mode="abort")`` ("abort" | "retract" |
    # "in_place"), ``continue_generation()``, ``get_weight_version() -> str``,
    # ``update_weight_version(new_version, abort_all_requests=False)``,
    # ``end_weight_update(*, weight_version=None, abort=False)`` (``abort``: drop the update where
    # the engine can; a commit of an update an earlier failure aborted raises),
    # ``weight_version=None`` on the update calls (`ReferenceEngine`: every one; `SGLangEngine`:
    # ``update_weights_from_disk`` only, the others named by the commit or
    # ``update_weight_version``; `takes_weight_version` False: it cannot name its weights),
    # ``set_serving(serving, reason="")`` and the read-only ``serving_state -> str | None``
    # (None while serving, else the reason).

    def weights_checksum(self) -> str:
        """`checksum_named_tensors` over all full tensors in Hugging Face order."""

    def forward_logits(self, input_ids: Any) -> Any:
        """Logits of a batch of prompts (last position by default)."""

    def memory_stats(self) -> dict:
        """Per worker: bytes of weights and KV cache, process RSS/USS, CUDA allocator stats."""

    def shutdown(self) -> None:
        """Stop every worker; leaves no process, file descriptor or shared-memory segment."""
