"""Rank bodies of the multi-process export tests (run by `fsdp_sync.cli.launch.run_ranks`).

Each body batches many checks into one launch and returns plain data (names and digests); the
test process compares it with references it computes itself from an unsharded model.
"""

from __future__ import annotations

import gc
import time
import traceback
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_sync.weights import bucket, export, gather, handles
from fsdp_sync.models import build_model, load_config

from _util import SEED, Consumer, Odd, digest, perturb_

BF16 = torch.bfloat16
SMALL_BUCKET = 24 << 10          # several buckets for the tiny model; embed/lm_head (128 KiB) alone


def _dtype_key(dtype) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    perturb_(model.parameters())
    return model


def fsdp1(model: nn.Module, *, use_orig_params: bool, wrap_layers: bool = True) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({type(model.model.layers[0])}) if wrap_layers else None
    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                   use_orig_params=use_orig_params)
    perturb_([u._handle.flat_param for u in FSDP.fsdp_modules(wrapped) if u._handle is not None])
    return wrapped


def tiny(recipe: str = "tiny") -> nn.Module:
    return build_model(load_config(recipe), seed=SEED)


# --------------------------------------------------------------------------- exports -> payloads

def produce(module, mode: str, dtype, kind: str, num_consumers: int = 1, ranks=None,
            bucket_bytes: int = SMALL_BUCKET):
    """Export ``module`` and make one payload set per tensor ("params") or per bucket ("buckets").
    Returns [(PayloadSet, name or None)]."""
    out = []
    if mode == "params":
        for name, t in export.iter_params(module, dtype=dtype, fsdp1_state_dict=kind):
            out.append((handles.make_payloads(t, num_consumers, ranks=ranks), name))
    else:
        for b, flat in export.iter_buckets(module, bucket_bytes, dtype=dtype, fsdp1_state_dict=kind):
            obj = {"flattened_tensor": flat, "metadata": bucket.sglang_metadata(b)}
            out.append((handles.make_payloads(obj, num_consumers, ranks=ranks), None))
    return out


def consume(consumer: Consumer, sets, rank: int = 0) -> list:
    """Open every payload in ``consumer`` as ``rank``; [[name, digest], ...] in payload order."""
    results = consumer.open([ps.payloads[rank] for ps, _ in sets], ranks=[rank] * len(sets),
                            names=[n for _, n in sets])
    named = []
    for r in results:
        if "error" in r:
            raise AssertionError(f"consumer failed: {r['error']}")
        named.extend([n, d] for n, d in r["tensors"].items())
    return named


def release(sets) -> None:
    for ps, _ in sets:
        ps.release()      # raises if the consumer did not acknowledge


def local_digests(module, mode: str, dtype, kind: str, bucket_bytes: int) -> list:
    """Export and digest in this process (for checks that need no consumer)."""
    if mode == "params":
        return [[n, digest(t)] for n, t in export.iter_params(module, dtype=dtype, fsdp1_state_dict=kind)]
    out = []
    for b, flat in export.iter_buckets(module, bucket_bytes, dtype=dtype, fsdp1_state_dict=kind,
                                       alloc=lambda n: torch.empty(n, dtype=torch.uint8)):
        out.extend([n, digest(t)] for n, t in bucket.unflatten(flat, b.entries))
    return out


# --------------------------------------------------------------------------- small probes

def lazy_violations(stream) -> list[str]:
    """When item k+1 arrives, item k (dropped by the caller) must be freed: the stream keeps no
    reference to what it yielded."""
    bad, prev = [], None
    for i, item in enumerate(stream):
        # gloo's worker thread drops its reference to a finished all-gather's output a moment
        # after wait() returns: give it that moment (a reference the stream kept never goes)
        deadline = time.monotonic() + 1.0
        while prev is not None and not prev[1].expired() and time.monotonic() < deadline:
            time.sleep(0.001)
        if prev is not None and not prev[1].expired():
            bad.append(f"item {i - 1} ({prev[0]}) still alive when item {i} was yielded")
        t = item[1]
        prev = (str(item[0])[:40] if isinstance(item[0], str) else f"bucket {i}",
                StorageWeakRef(t.untyped_storage()))
        del item, t
    return bad


class CountCollectives:
    """Count export's all-gathers (the bucketed and per-parameter gathers), its broadcasts (of
    tensors one rank holds whole) and DTensor ``full_tensor()`` calls (the fallback for other
    placements)."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        self.counts = {"all_gather": 0, "broadcast": 0, "full_tensor": 0}
        self._ag, self._bc, self._ft = gather.all_gather, gather.broadcast, DTensor.full_tensor

        def ag(*a, **k):
            self.counts["all_gather"] += 1
            return self._ag(*a, **k)

        def bc(*a, **k):
            self.counts["broadcast"] += 1
            return self._bc(*a, **k)

        def ft(*a, **k):
            self.counts["full_tensor"] += 1
            return self._ft(*a, **k)

        gather.all_gather, gather.broadcast, DTensor.full_tensor = ag, bc, ft
        return self.counts

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        gather.all_gather, gather.broadcast, DTensor.full_tensor = self._ag, self._bc, self._ft


def state_dict_type_checks(module) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    def current():
        return [u._state_dict_type.name for u in FSDP.fsdp_modules(module)]

    out = {}
    FSDP.set_state_dict_type(module, StateDictType.SHARDED_STATE_DICT)
    out["before"] = current()
    gen = export.iter_params(module, dtype=BF16, fsdp1_state_dict="local")
    next(gen)
    out["while_suspended"] = current()
    for _ in gen:   # every rank consumes the whole stream (it is collective)
        pass
    out["after_local"] = current()
    list(export.iter_buckets(module, SMALL_BUCKET, fsdp1_state_dict="full"))
    out["after_full"] = current()
    try:
        with export.state_dict_type(module, "local"):
            out["inside"] = current()
            raise RuntimeError("boom")
    except RuntimeError as exc:
        out["raised"] = str(exc)
    out["after_exception"] = current()
    try:
        with export.state_dict_type(module, "everything"):
            pass
    except ValueError as exc:
        out["bad_kind"] = str(exc)
    FSDP.set_state_dict_type(module, StateDictType.FULL_STATE_DICT)
    return out


# --------------------------------------------------------------------------- 1 rank

def export_1rank(rank: int, world: int) -> dict:
    """A one-rank trainer (FSDP2, FSDP1 local/sharded/full): every tensor and bucket, and the
    collectives the export made (none: a group of one rank has nothing to gather)."""
    models = {"fsdp2": fsdp2(tiny()), "fsdp1": fsdp1(tiny(), use_orig_params=False)}
    out: dict = {"cases": {}, "collectives": {}, "shares_storage": {}}
    for model_key, kinds in (("fsdp2", ("full",)), ("fsdp1", export.STATE_DICT_TYPES)):
        module = models[model_key]
        own = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
               for p in module.parameters()}
        for kind in kinds:
            for dtype in (None, BF16):
                for mode in ("params", "buckets"):
                    key = f"{model_key}/{kind}/{_dtype_key(dtype)}/{mode}"
                    with CountCollectives() as counts:
                        out["cases"][key] = local_digests(module, mode, dtype, kind, SMALL_BUCKET)
                    out["collectives"][key] = dict(counts)
            out["shares_storage"][f"{model_key}/{kind}"] = [
                n for n, t in export.iter_params(module, dtype=None, fsdp1_state_dict=kind)
                if t.untyped_storage().data_ptr() in own]
    return out


# --------------------------------------------------------------------------- 2 ranks

def export_2rank(rank: int, world: int) -> dict:
    models = {
        "fsdp2": fsdp2(tiny()),
        "fsdp1": fsdp1(tiny(), use_orig_params=False),
        "fsdp2-tied": fsdp2(tiny("tiny-tied")),
        "fsdp1-tied": fsdp1(tiny("tiny-tied"), use_orig_params=True),
    }
    cases = []
    for dtype in (None, BF16):
        for mode in ("params", "buckets"):
            cases.append(("fsdp2", "full", dtype, mode))
            for kind in export.STATE_DICT_TYPES:
                cases.append(("fsdp1", kind, dtype, mode))
    cases += [("fsdp2-tied", "full", BF16, "params"), ("fsdp2-tied", "full", BF16, "buckets"),
              ("fsdp1-tied", "local", BF16, "buckets"), ("fsdp1-tied", "full", None, "params"),
              ("fsdp1-tied", "sharded", BF16, "params")]
    out: dict = {"cases": {}, "metas": {}, "buckets": {}}
    with Consumer() as consumer:
        for model_key, kind, dtype, mode in cases:
            sets = produce(models[model_key], mode, dtype, kind)
            try:
                key = f"{model_key}/{kind}/{_dtype_key(dtype)}/{mode}"
                out["cases"][key] = consume(consumer, sets)
                if mode == "buckets":
                    out["buckets"][key] = len(sets)
            finally:
                release(sets)
            del sets
    for model_key, module in models.items():
        for dtype in (None, BF16):
            out["metas"][f"{model_key}/{_dtype_key(dtype)}"] = [
                [m.name, _dtype_key(m.dtype), list(m.shape)] for m in export.param_metas(module, dtype)]

    # one collective per bucket, none per parameter
    collectives = {}
    for model_key, kind in (("fsdp2", "full"), ("fsdp1", "local"), ("fsdp1", "sharded")):
        n_buckets = len(bucket.plan_buckets(export.param_metas(models[model_key], BF16), SMALL_BUCKET))
        with CountCollectives() as counts:
            for _ in export.iter_buckets(models[model_key], SMALL_BUCKET, dtype=BF16,
                                         fsdp1_state_dict=kind):
                pass
        collectives[f"{model_key}/{kind}"] = {"buckets": n_buckets, **counts}
    out["collectives"] = collectives

    lazy = {}
    for model_key, kind in (("fsdp2", "full"), ("fsdp1", "local"), ("fsdp1", "sharded"),
                            ("fsdp1", "full")):
        m = models[model_key]
        lazy[f"{model_key}/{kind}/params"] = lazy_violations(
            export.iter_params(m, dtype=BF16, fsdp1_state_dict=kind))
        lazy[f"{model_key}/{kind}/buckets"] = lazy_violations(
            export.iter_buckets(m, SMALL_BUCKET, dtype=BF16, fsdp1_state_dict=kind))
    out["lazy"] = lazy
    out["state_dict_type"] = state_dict_type_checks(models["fsdp1"])
    gc.collect()
    return out


# --------------------------------------------------------------------------- 4 ranks

def _bad_dtensor_module(rank: int) -> nn.Module:
    """A Shard(0) parameter whose local shard on rank 3 contradicts its global shape."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    local = torch.zeros(1 if rank == 3 else 2, 4)
    m = nn.Module()
    m.good = nn.Parameter(DTensor.from_local(torch.ones(1, 3), mesh, [Shard(0)], run_check=False,
                                             shape=(4, 3), stride=(3, 1)))
    m.bad = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=(8, 4), stride=(4, 1)))
    return m


def export_4rank(rank: int, world: int) -> dict:
    from fsdp_sync.topology import SyncError, SyncTopology, broadcast_from_src, gather_to_src, make_mesh

    out: dict = {"rank": rank}
    topo = SyncTopology.from_mesh(make_mesh(2, 2))
    out["topo"] = [topo.dp_rank, topo.tp_rank, topo.tp_src, list(topo.tp_ranks)]
    model = fsdp2(tiny())
    with ExitStack() as stack:
        consumer = stack.enter_context(Consumer()) if topo.is_tp_src else None
        # dp 2 x infer_tp 2: each rank's payload for its own TP peer goes to infer-TP rank 0
        for case, mode, dtype in (("buckets/bfloat16", "buckets", BF16), ("params/none", "params", None)):
            # colocated: this rank's copy is for its own TP peer only
            sets = produce(model, mode, dtype, "full", num_consumers=topo.tp_size,
                           ranks=[topo.tp_rank])
            try:
                seen, rebuilt = [], {r: [] for r in range(topo.tp_size)}
                for ps, name in sets:
                    gathered = gather_to_src(ps.payloads[0], topo)
                    seen.append(None if gathered is None else len(gathered))
                    if gathered is not None:
                        results = consumer.open(gathered, ranks=list(range(topo.tp_size)),
                                                names=[name] * topo.tp_size)
                        for tp_rank, r in enumerate(results):
                            if "error" in r:
                                raise AssertionError(r["error"])
                            rebuilt[tp_rank].extend([n, d] for n, d in r["tensors"].items())
                broadcast_from_src(True, topo)   # the engine has answered: buffers may go
                out[f"gathered/{case}"] = seen
                out[f"rebuilt/{case}"] = rebuilt if topo.is_tp_src else None
                # my payload was opened, and acknowledged, by my TP peer
                out[f"acked/{case}"] = all(ps.unacknowledged() == [] for ps, _ in sets)
                out[f"payloads/{case}"] = sorted({len(ps.payloads) for ps, _ in sets})
                for ps, _ in sets:
                    ps.release()          # raises if a consumer did not acknowledge
            finally:
                for ps, _ in sets:
                    ps.release(require_ack=False)
            del sets

    # uneven splits (some ranks hold 0 rows), int buffers, FSDP1 flat-parameter padding
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    odd = {"fsdp2": fsdp2(Odd())}
    from torch.distributed.fsdp import ShardingStrategy

    for key, kw in (("fsdp1-uop0", {}), ("fsdp1-uop1", {"use_orig_params": True}),
                    ("fsdp1-noshard", {"sharding_strategy": ShardingStrategy.NO_SHARD})):
        m = FSDP(Odd(), device_id=torch.device("cpu"), **kw)
        perturb_([u._handle.flat_param for u in FSDP.fsdp_modules(m) if u._handle is not None])
        odd[key] = m
    odd_out = {}
    for key, m in odd.items():
        kinds = ["full"] if key == "fsdp2" else list(export.STATE_DICT_TYPES)
        for kind in kinds:
            for dtype in (None, BF16):
                for mode, bb in (("params", 0), ("buckets", 64), ("buckets", 1 << 20)):
                    odd_out[f"{key}/{kind}/{_dtype_key(dtype)}/{mode}{bb or ''}"] = \
                        local_digests(m, mode, dtype, kind, bb)
    out["odd"] = odd_out
    out["odd_metas"] = {k: [m.name for m in export.param_metas(v, BF16)] for k, v in odd.items()}
    out["odd_local_fsdp2"] = [list(p.to_local().shape) for p in odd["fsdp2"].parameters()]

    # placements the bucketed gather does not cover (tensor-parallel Shard(1), HSDP's 2-D mesh):
    # gathered with full_tensor(), one per parameter, in both entry points
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(5)
    full_a, full_b = torch.randn(6, 10, generator=g), torch.randn(5, 3, generator=g)
    m = nn.Module()
    m.tp = nn.Parameter(distribute_tensor(full_a, init_device_mesh("cpu", (4,)), [Shard(1)]))
    m.hsdp = nn.Parameter(distribute_tensor(full_b, init_device_mesh("cpu", (2, 2)),
                                            [Replicate(), Shard(0)]))
    with CountCollectives() as counts:
        got = {"params": local_digests(m, "params", BF16, "full", 0),
               "buckets": local_digests(m, "buckets", BF16, "full", 1 << 20)}
    out["fallback"] = {**got, "counts": dict(counts),
                       "want": [["tp", digest(full_a.to(BF16))], ["hsdp", digest(full_b.to(BF16))]]}

    # a rank-local inconsistency is raised on every rank, naming the rank, before any gather
    errors = {}
    bad = _bad_dtensor_module(rank)
    for mode in ("buckets", "params"):
        try:
            if mode == "buckets":
                list(export.iter_buckets(bad, 1 << 20))
            else:
                list(export.iter_params(bad))
            errors[mode] = None
        except SyncError as exc:
            errors[mode] = str(exc)
        except Exception:  # noqa: BLE001
            errors[mode] = "unexpected: " + traceback.format_exc()
    dist.barrier()   # every rank is still in step after the failure
    out["errors"] = errors
    return out


# --------------------------------------------------------------------------- GPU

def export_cuda(rank: int, world: int) -> list:
    """FSDP2 on CUDA (NCCL): buckets gathered on the device into CUDA buffers."""
    torch.cuda.set_device(rank)
    model = fsdp2(tiny().cuda())
    out = []
    for b, flat in export.iter_buckets(model, SMALL_BUCKET, dtype=BF16,
                                       alloc=lambda n: handles.empty_shared(n, "cuda")):
        assert flat.is_cuda, flat.device
        out.extend([n, digest(t)] for n, t in bucket.unflatten(flat, b.entries))
    return out


def send_bracket(rank: int, world: int, version) -> dict:
    """`TensorTransport.send` (the loop verl's adapter drives) around a reference engine: the update
    bracket closes with ``version`` (None: unnamed) and the engine serves it afterwards."""
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport.tensor import TensorTransport

    topo = SyncTopology.from_mesh(make_mesh(1, 1))
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64) as engine:
        before = engine.get_weight_version()
        stats = TensorTransport().send(iter([]), topo=topo, engine=engine, version=version)
        return {"before": before, "after": engine.get_weight_version(), "calls": stats.engine_calls}
