"""What a reference engine sends its workers for one update: per-rank work items built from the
arguments of ``update_weights_from_tensor``, ``update_weights_from_distributed`` and
``update_weights_from_disk`` (the checkpoint's files resolved, its ``config.json`` checked against
the engine's model), and the engine-side check of a distributed call's names, dtypes and shapes
(before any worker joins the broadcast, so the sender learns at once), and what the workers'
replies say of where an update's time went (`worker_figures`).

Plain tensors are packed into one flattened bucket per distinct rank list (one shared buffer, one
handle per rank); payloads given per rank pass through as they are. Every malformed argument is a
`WeightUpdateError` naming the value.
Not here: sending items and deciding commit vs abort (`engine`), opening them (`staging`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any

import torch

from ...weights import handles
from ...weights.bucket import TensorMeta, flatten, plan_one
from ...wire import PER_RANK_BUCKET, flattened_bucket
from ..base import SerializedPerRank, WeightUpdateError
from .quant import dtype_refusal, scale_refusal

__all__ = ["build_items", "pack_plain", "distributed_entries", "check_entries", "disk_items", "worker_figures"]


def distributed_entries(names: Any, dtypes: Any, shapes: Any, load_format: str | None) -> list[tuple]:
    """``(name, dtype, shape)`` of an ``update_weights_from_distributed`` call, checked as SGLang's
    receiver reads them (dtype strings by ``getattr(torch, s)``; flattened: tight offsets)."""
    if load_format not in (None, "flattened_bucket", PER_RANK_BUCKET):
        raise WeightUpdateError(f"unknown load_format {load_format!r}; expected None, 'flattened_bucket' "
                                f"or {PER_RANK_BUCKET!r}")
    if not (isinstance(names, (list, tuple)) and isinstance(dtypes, (list, tuple))
            and isinstance(shapes, (list, tuple)) and len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(f"names, dtypes and shapes are lists of one length, got "
                                f"{len(names) if hasattr(names, '__len__') else names!r}, "
                                f"{len(dtypes) if hasattr(dtypes, '__len__') else dtypes!r}, "
                                f"{len(shapes) if hasattr(shapes, '__len__') else shapes!r}")
    out, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt), None) if isinstance(dt, str) else None
        if not isinstance(dtype, torch.dtype):
            raise WeightUpdateError(f"bad dtype {dt!r} for {name!r}: expected a torch dtype name such as "
                                    f"'bfloat16' (not 'torch.bfloat16')", name=name)
        try:
            dims = tuple(shape)
        except TypeError:
            dims = None
        # ints only, as SGLang's torch.empty(shape) takes them: 64.0 or "64" is refused, not read as 64
        if dims is None or isinstance(shape, (str, bytes)) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in dims):
            raise WeightUpdateError(f"bad shape {shape!r} for {name!r}: a list of ints >= 0", name=name)
        shape = tuple(int(x) for x in dims)
        if load_format == "flattened_bucket" and offset % dtype.itemsize:
            raise WeightUpdateError(f"{name!r} ({dt}) would start at byte {offset} of the flattened "
                                    f"bucket, not a multiple of its dtype size {dtype.itemsize}: the "
                                    f"sender must plan buckets so every offset is aligned", name=name)
        offset += math.prod(shape) * dtype.itemsize
        out.append((str(name), dtype, shape))
    return out


def check_entries(entries: list[tuple], layout: Any, dtype: torch.dtype, load_format: str | None) -> None:
    """Refuse an ``update_weights_from_distributed`` call whose ``(name, dtype, shape)`` entries
    this engine cannot load: an unknown name (HF names, or with `PER_RANK_BUCKET` the engine's own),
    a dtype other than ``layout.dtype_of(name, dtype)`` (``float8_e4m3fn`` / ``float32`` for a
    block-FP8 engine's quantized weights and scales, the rollout dtype otherwise), a shape other
    than the full tensor's (or one TP rank's shard). Raises `WeightUpdateError` naming the tensor."""
    own = layout.engine_shapes() if load_format == PER_RANK_BUCKET else None
    for name, got, shape in entries:
        if own is not None and name not in own:
            raise WeightUpdateError(f"unknown parameter {name!r}: {PER_RANK_BUCKET!r} takes the engine's own "
                                    f"parameter names (e.g. {next(iter(own))!r})"
                                    f"{scale_refusal(name, layout.quantization)}", name=name)
        if own is None and not layout.accepts(name):
            raise WeightUpdateError(f"unknown parameter {name!r}: not a {layout.spec.model_type} parameter name "
                                    f"of this model (e.g. {layout.hf_names()[1]!r})"
                                    f"{scale_refusal(name, layout.quantization)}", name=name)
        want = layout.dtype_of(name, dtype)
        if got != want:
            raise WeightUpdateError(dtype_refusal(name, got, want, None, layout.quantization), name=name)
        full = tuple(own[name] if own is not None else layout.full_shape(name))
        if shape != full:
            raise WeightUpdateError(f"expected shape {full} for {name!r}"
                                    f"{' (one TP rank shard)' if own is not None else ''}, got {shape}", name=name)



def build_items(named_tensors: Any, load_format: str | None, tp: int,
                sets: list[handles.PayloadSet]) -> list[list]:
    """Per-rank work items: ``("bucket", layout, payload)`` or ``("tensor", layout, name, payload)``."""
    items: list[list] = [[] for _ in range(tp)]
    direct_buckets = (load_format == "direct" and isinstance(named_tensors, (list, tuple))
                      and bool(named_tensors)
                      and all(isinstance(p, (bytes, bytearray, str)) for p in named_tensors))
    if load_format == "flattened_bucket" or direct_buckets:
        if not isinstance(named_tensors, (list, tuple)) or len(named_tensors) != tp:
            n = len(named_tensors) if isinstance(named_tensors, (list, tuple)) else type(named_tensors).__name__
            raise WeightUpdateError(f"load_format={load_format!r} with flattened buckets takes one "
                                    f"payload per TP rank ({tp}), got {n}")
        for r, p in enumerate(named_tensors):
            if not isinstance(p, (bytes, bytearray, str)):
                raise WeightUpdateError(f"flattened_bucket payload for TP rank {r} must be bytes or "
                                        f"base64 text (handles.make_payloads), got {type(p).__name__}")
            items[r].append(("bucket", "direct" if direct_buckets else "hf", p))
        return items
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"unknown load_format {load_format!r}; expected None, "
                                f"'flattened_bucket' or 'direct'")
    if not isinstance(named_tensors, (list, tuple)):
        raise WeightUpdateError(f"named_tensors is a list of (name, value) pairs, got "
                                f"{type(named_tensors).__name__}")
    kind = "hf" if load_format is None else "direct"
    plain: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(tp)]
    for pair in named_tensors:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise WeightUpdateError(f"named_tensors holds (name, value) pairs, got {pair!r:.80}")
        name, value = pair
        if isinstance(value, torch.Tensor):
            for r in range(tp):     # a full tensor (None) or a replicated one (direct)
                plain[r].append((name, value))
        elif isinstance(value, SerializedPerRank) or (load_format == "direct" and isinstance(value, (list, tuple))):
            values = value.values if isinstance(value, SerializedPerRank) else list(value)
            if len(values) != tp:
                raise WeightUpdateError(f"expected {tp} per-rank values for {name!r} (one per TP rank), "
                                        f"got {len(values)}", name=name)
            for r, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    plain[r].append((name, v))
                elif isinstance(v, (bytes, bytearray, str)):
                    items[r].append(("tensor", kind, name, v))
                else:
                    raise WeightUpdateError(f"per-rank value {r} of {name!r} must be a payload "
                                            f"(bytes/str) or a tensor, got {type(v).__name__}", name=name)
        else:
            raise WeightUpdateError(f"value of {name!r} must be a tensor or a SerializedPerRank, got "
                                    f"{type(value).__name__}", name=name)
    if any(plain):
        pack_plain(plain, kind, items, sets, tp)
    return items

def pack_plain(plain: list[list[tuple[str, torch.Tensor]]], kind: str, items: list[list],
               sets: list[handles.PayloadSet], tp: int) -> None:
    """Plain tensors travel as one flattened bucket per distinct rank list: one shared buffer,
    one copy, one handle per rank (``handles.make_payloads``), never one per tensor."""
    same = all(len(plain[r]) == len(plain[0]) and all(a is b for (_, a), (_, b) in zip(plain[r], plain[0]))
               for r in range(tp))
    groups = [(list(range(tp)), plain[0])] if same else [([r], plain[r]) for r in range(tp) if plain[r]]
    for ranks, named in groups:
        try:
            metas = [TensorMeta.of(n, t) for n, t in named]
            bucket = plan_one(metas)
            devices = {t.device for _, t in named}
            device = devices.pop() if len(devices) == 1 else torch.device("cpu")
            flat = handles.empty_shared(bucket.nbytes, device)
            flatten(bucket, [t.detach().to(device).contiguous() for _, t in named], out=flat)
        except (ValueError, TypeError) as exc:
            raise WeightUpdateError(f"cannot send these tensors: {exc}") from exc
        ps = handles.make_payloads(flattened_bucket(flat, bucket), tp, ranks=ranks)
        del flat
        sets.append(ps)
        for r, payload in zip(ranks, ps.payloads):
            items[r].append(("bucket", kind, payload))


def disk_items(model_path: Any, load_format: str | None, layout: Any, config: Any, *,
               complete: bool) -> list[list]:
    """Per-rank work items of ``update_weights_from_disk``: ``("disk", "hf", spec)`` for a Hugging
    Face checkpoint (every rank reads every header, checks its share of the files' digests and
    reads its own slices), ``("disk", "engine", spec)`` for a per-rank one (each rank its own
    files). ``complete``: a worker refuses the checkpoint unless it holds every tensor of its rank.
    Raises `CheckpointError` naming the directory, file or config value."""
    from ...config_check import config_mismatches
    from ...models import load_config
    from ...weights.hf_checkpoint import CheckpointError, is_ranked, resolve, resolve_ranked

    tp = layout.tp
    cfg_path = os.path.join(os.fspath(model_path), "config.json") if isinstance(
        model_path, (str, os.PathLike)) else None
    if cfg_path is not None and os.path.isfile(cfg_path):
        try:
            theirs = load_config(cfg_path)
        except Exception as exc:  # noqa: BLE001 - unreadable: the checkpoint's model is unknown
            raise CheckpointError(f"cannot read {cfg_path}: {type(exc).__name__}: {exc}") from None
        diff = config_mismatches(theirs, config)
        if diff:
            listed = "; ".join(f"{k}: checkpoint {a!r}, engine {b!r}" for k, a, b in diff)
            raise CheckpointError(f"{cfg_path} describes another model than this engine serves "
                                  f"({listed}); nothing was loaded")
    if is_ranked(model_path):
        if load_format not in (None, "auto", "sharded_state"):
            raise CheckpointError(f"load_format {load_format!r} does not read a per-rank "
                                  f"checkpoint; use None or 'sharded_state'")
        rplan = resolve_ranked(model_path, tp, layout.ep)
        # as the manifest's JSON holds it (tuples are lists there)
        mine = json.loads(json.dumps(dataclasses.asdict(layout.spec)))
        diff = {k: (v, mine.get(k)) for k, v in rplan.model.items() if mine.get(k) != v}
        if diff or set(rplan.model) != set(mine):
            raise CheckpointError(f"{rplan.directory} was cut for another model than this "
                                  f"engine's (checkpoint, engine): {diff}")
        return [[("disk", "engine", {
            "dir": rplan.directory, "files": rplan.files[r], "complete": complete,
            "digests": {f: rplan.digests[f] for f in rplan.files[r]}, "hash": rplan.hash,
            "names": {f: rplan.names[f] for f in rplan.files[r]}})] for r in range(tp)]
    plan = resolve(model_path, load_format)
    return [[("disk", "hf", {
        "dir": plan.directory, "files": plan.files, "index": plan.index, "complete": complete,
        "verify": {f: plan.digests[f] for f in plan.files[r::tp] if f in plan.digests},
        "hash": plan.hash})] for r in range(tp)]


def worker_figures(staged: dict[int, tuple], committed: dict[int, tuple]) -> dict[str, float]:
    """Where a tensor update's time went in the workers, each part the slowest rank's: ``stage_s``
    (of which ``open_s``, opening the payloads: unpickling, mapping shared memory or opening CUDA
    IPC handles; the rest checks every name, shape and dtype), ``commit_s`` (of which ``apply_s``,
    the copies into the weights, or aside in a staging transaction, and ``ack_s``, acknowledging
    the payloads: on CUDA the stream synchronization that waits for those copies); and ``kept``,
    the buffers every rank found still open from an earlier call of the update (the fewest)."""
    def ok(replies: dict[int, tuple]) -> list[dict]:
        return [rep[1] for rep in replies.values() if rep[0] == "ok" and isinstance(rep[1], dict)]

    out: dict[str, float] = {}
    for replies, keys in ((staged, ("stage_s", "open_s")), (committed, ("commit_s", "apply_s", "ack_s"))):
        for k in keys:
            out[k] = max((float(r.get(k, 0.0)) for r in ok(replies)), default=0.0)
    out["kept"] = min((int(r.get("kept", 0)) for r in ok(staged)), default=0)
    return out
