"""verl's weight stream with its FSDP module: fsdp_sync's own bucketed export where it is exact.

verl's FSDP engine exports for the rollout with one ``full_tensor()`` per parameter
(``FSDPEngine.get_per_tensor_param``): 219 all-gathers for a 219-tensor model, about half of a
sync's seconds in verl's loop (docs/verl.md). fsdp_sync's own export (`weights.export.iter_buckets`,
the manager's path) gathers a bucket at a time, or, where the FSDP group shares one host and the
shards are CPU tensors, has each rank write its shards into one host-shared buffer and gathers
nothing. That needs the module, which verl keeps to itself: the rollout adapter gets a generator.

- `install` (called by `SGLangAdapter` when a run opts in, in the worker process that holds both
  verl's engine and the adapter) wraps ``FSDPEngine.get_per_tensor_param``: what it returns is
  unchanged except that a full-weight stream (no LoRA ``peft_config``) comes as a `ModuleStream`,
  an iterator over verl's own generator, same items in the same order, that also carries the FSDP
  module, the flags verl called with, and what decides verl's names (its key conversion and MoE
  unfusing). Every other consumer of the stream (verl's checkpoint engines) iterates it as before.
  Engines that override ``get_per_tensor_param`` (veomni, Megatron, ...) are not wrapped.
- `calls` (the adapter's hook, at every sync): given a `ModuleStream`, decides on every rank whether
  fsdp_sync's export may replace verl's generator, and if so returns the sync's engine calls
  (`transport.tensor.Call`, one flattened bucket per call) made from `export.iter_buckets`; else
  None, and the adapter walks verl's generator as before. The decision is exact or nothing: the
  names, shapes and dtypes fsdp_sync's export would send (`export.param_metas`) must equal, in
  order, what verl's stream would send after the adapter's cast, computed without moving data
  (verl's own ``convert_weight_keys`` and ``unfuse_moe_params`` run over meta tensors of
  ``module.state_dict()``); and none of these may be on: LoRA (adapters or merged), FSDP1, verl's
  parameter offload (its FSDP2 CPU-offload policy included), QAT, the rollout's FP8 quantization,
  a strategy other than ``flattened``. Each rank decides alone, then every rank of the world learns
  whether any refused (one all-reduce, before any collective of either export; the reasons travel
  only then), so all take the same path; the same all-reduce compares the ranks' model digests
  (`model_digest`, the manager's check): ranks holding different models raise one `SyncError`
  naming the first rank and tensor that differ instead of running mismatched collectives; why the fast path was not taken is logged once per
  reason on infer-TP rank 0. Before that all-reduce the ranks meet in the store
  (`peer_check.absent_ranks`): where the plug-in did not load on some ranks (they run verl's own
  adapter, whose export is one all-gather per parameter over the same ranks) those never come to
  the all-reduce, so every rank that did walks verl's generator too (after a few seconds' wait
  the first time, none later), with a warning naming the ranks, instead of hanging.
- `ExportDecision` (one per adapter): a rank's comparison is made once per module and kept while
  nothing it reads changed: the same module and parameter and buffer objects (weak references),
  with the same names, shapes, dtypes, devices, DTensor placements and meshes, the same rollout
  dtype, bucket size, cast and naming (``ModuleStream.naming``). Any difference rebuilds it, so a
  changed module is compared again (exact, or refused by name). The cheap refusals above and the
  all-reduce still run at every sync: each rank decides its cache alone, and only the all-reduce
  makes the ranks agree. Not seen: a state-dict hook registered on an unchanged module.

What fsdp_sync's export changes against verl's is only how the bytes are gathered: the same
shards, cast to the rollout dtype before the gather (bit for bit the cast of the full tensor),
in the same order under the same names, sent as the same wire (flattened buckets of at most
``bucket_bytes``, one engine call each). Tied weights are an example of a difference that falls back: verl sends
``lm_head.weight`` and ``model.embed_tokens.weight`` both, fsdp_sync's export the first only.

Not here: the send loop, verify, the figures (`verl.adapter`, `transport.tensor`); the export
itself (`weights.export`). Imports verl only inside `install` and `uninstall`, so it sits beside
`peer_check` rather than in ``integrations/verl`` (whose package imports verl): the default tier
tests it with a verl-like stream.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..topology import SyncError, cpu_group, released_by_backend
from ..transport import SyncStats
from ..transport.buffers import ReusedBuffer
from ..transport.tensor import Call
from ..weights import export, handles
from ..weights.bucket import SUPPORTED_DTYPES, TensorMeta, dtype_name, plan_buckets
from ..weights.export_checks import describe_difference, digest_of
from ..wire import flattened_bucket
from . import peer_check

__all__ = ["ModuleStream", "ExportDecision", "install", "uninstall", "verl_metas", "refusal",
           "model_digest", "agreed", "calls", "EXPORT_MODULE", "EXPORT_VERL"]

log = logging.getLogger("fsdp_sync.verl")

EXPORT_MODULE = "fsdp_sync"
"""The sync's ``export`` figure when fsdp_sync's export ran from verl's module."""
EXPORT_VERL = "verl"
"""... and when the adapter walked verl's generator."""

_WRAPPED = "_fsdp_sync_module_stream"
_logged: set[str] = set()


class ModuleStream:
    """verl's ``(name, tensor)`` stream, unchanged, plus what made it.

    An iterator over ``items`` (verl's generator: nothing is pulled until it is iterated) with:
    ``module`` (verl's FSDP module), ``flags`` (the keyword arguments verl called
    ``get_per_tensor_param`` with), ``peft`` (the module is a peft model: LoRA adapters or merged),
    ``fsdp_version``, ``param_offload`` (verl offloads parameters, or FSDP2's CPU-offload policy owns
    them), ``qat``, ``convert`` (state dict -> state dict under verl's names: verl's
    ``convert_weight_keys`` on the module) and ``unfuse`` (``(name, tensor)`` iterable -> verl's
    per-expert items: ``unfuse_moe_params`` for the model type); the last two default to identity.
    ``naming``: a value that, for the same module, promises the same ``convert`` and ``unfuse``
    results (`_wrap`: verl's model type); None: the two functions themselves, compared by
    equality (a new lambda each stream: the decision is never kept)."""

    def __init__(self, items: Iterable, module: torch.nn.Module, *, flags: dict | None = None,
                 peft: bool = False, fsdp_version: int = 2, param_offload: bool = False,
                 qat: bool = False, convert: Callable[[dict], dict] | None = None,
                 unfuse: Callable[[Iterable], Iterable] | None = None,
                 naming: Any = None) -> None:
        self._items = iter(items)
        self.module = module
        self.flags = dict(flags or {})
        self.peft, self.fsdp_version = peft, fsdp_version
        self.param_offload, self.qat = param_offload, qat
        self.convert, self.unfuse = convert, unfuse
        self.naming = ("given", naming) if naming is not None else ("functions", convert, unfuse)

    def __iter__(self) -> "ModuleStream":
        return self

    def __next__(self) -> Any:
        return next(self._items)

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------- verl's side

def _wrap(engine: Any, items: Any, flags: dict, impl: Any) -> ModuleStream:
    module = engine.module
    inner = getattr(module, "_fsdp_wrapped_module", module)
    hf = getattr(getattr(engine, "model_config", None), "hf_config", None)
    model_type = getattr(hf, "model_type", None)
    return ModuleStream(
        items, module, flags=flags, peft=hasattr(inner, "peft_config"),
        fsdp_version=int(impl.fsdp_version(module)),
        param_offload=bool(getattr(engine, "_is_offload_param", False)
                           or getattr(engine, "_uses_fsdp2_cpu_offload_policy", False)),
        qat=bool(getattr(engine, "_qat_enabled", False)),
        convert=lambda sd: impl.convert_weight_keys(sd, inner),
        unfuse=lambda pairs: impl.unfuse_moe_params(pairs, model_type),
        # the two read only the module (inner is its own) and the model type
        naming=("verl", impl.convert_weight_keys, impl.unfuse_moe_params, model_type))


def install() -> bool:
    """Wrap verl's ``FSDPEngine.get_per_tensor_param`` in this process (idempotent): a full-weight
    stream comes as a `ModuleStream`. False (logged once) where verl's FSDP engine cannot be
    imported; the adapter then always walks verl's generator."""
    try:
        from verl.workers.engine.fsdp import transformer_impl as impl
    except Exception as exc:  # noqa: BLE001 - any import failure means: verl's generator only
        _log_once(f"verl's FSDP engine is not importable ({type(exc).__name__}: {exc})", True)
        return False
    cls = impl.FSDPEngine
    current = cls.__dict__.get("get_per_tensor_param")
    if current is None or getattr(current, _WRAPPED, False):
        return current is not None

    @functools.wraps(current)
    def get_per_tensor_param(self, *args: Any, **kwargs: Any):
        items, peft_config = current(self, *args, **kwargs)
        if peft_config is not None:     # LoRA adapters: verl's stream, untouched
            return items, peft_config
        flags = dict(kwargs, args=args) if args else dict(kwargs)
        return _wrap(self, items, flags, impl), peft_config

    setattr(get_per_tensor_param, _WRAPPED, True)
    get_per_tensor_param.__wrapped__ = current
    cls.get_per_tensor_param = get_per_tensor_param
    return True


def uninstall() -> None:
    """Undo `install` in this process (tests)."""
    try:
        from verl.workers.engine.fsdp import transformer_impl as impl
    except Exception:  # noqa: BLE001
        return
    current = impl.FSDPEngine.__dict__.get("get_per_tensor_param")
    if current is not None and getattr(current, _WRAPPED, False):
        impl.FSDPEngine.get_per_tensor_param = current.__wrapped__


def verl_metas(stream: ModuleStream,
               prepare: Callable[[str, torch.Tensor], torch.Tensor]) -> list[TensorMeta]:
    """Name, dtype and shape of every tensor verl's stream yields, after ``prepare`` (the
    adapter's cast), in order, without moving data: verl's own conversion over meta tensors of
    ``module.state_dict()`` (which for FSDP2 holds DTensor references: no gather)."""
    sd: dict[str, Any] = {}
    for key, value in stream.module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state-dict entry {key!r} is a {type(value).__name__}, not a tensor")
        sd[key] = torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    if stream.convert is not None:
        sd = stream.convert(sd)
    pairs: Iterable = sd.items()
    if stream.unfuse is not None:
        pairs = stream.unfuse(pairs)
    return [TensorMeta.of(name, prepare(name, t)) for name, t in pairs]


def _first_difference(theirs: list[TensorMeta], ours: list[TensorMeta]) -> str:
    def show(m: TensorMeta | None) -> str:
        return "nothing" if m is None else f"{m.name!r} {dtype_name(m.dtype)} {tuple(m.shape)}"

    for i in range(max(len(theirs), len(ours))):
        a = theirs[i] if i < len(theirs) else None
        b = ours[i] if i < len(ours) else None
        if a is None or b is None or (a.name, a.dtype, tuple(a.shape)) != (b.name, b.dtype, tuple(b.shape)):
            return (f"verl's stream sends {len(theirs)} tensors, fsdp_sync's export {len(ours)}; "
                    f"tensor #{i}: verl {show(a)}, fsdp_sync {show(b)}")
    return ""


def _fingerprint(module: torch.nn.Module) -> tuple[tuple, list]:
    """What the comparison reads of ``module``, without moving data: (facts, tensors). Facts per
    parameter and buffer (tied ones under each name): name, shape, dtype, device, DTensor
    placements and mesh; the tensors themselves are compared by identity."""
    facts: list = []
    tensors: list = []
    for name, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                   module.named_buffers(remove_duplicate=False)):
        facts.append((name, tuple(t.shape), t.dtype, t.device, getattr(t, "placements", None),
                      getattr(t, "device_mesh", None)))
        tensors.append(t)
    return tuple(facts), tensors


class ExportDecision:
    """One rank's `refusal` answer for one module, kept across syncs while nothing it depends on
    changed (see the module docstring), with the bucket plan of its metas. ``builds`` counts the
    comparisons made, ``kept`` says whether the last sync reused one."""

    def __init__(self) -> None:
        self._module: Any = None          # weakref to the module the answer is for
        self._key: Any = None
        self._facts: tuple = ()
        self._refs: list = []             # weakrefs to its parameters and buffers
        self.reason: str | None = None
        self.metas: list[TensorMeta] | None = None
        self.plan: list | None = None
        self.builds = 0
        self.kept = False

    @staticmethod
    def _key_of(stream: ModuleStream, sync: Any, prepare: Callable) -> tuple:
        return (sync.dtype, sync.bucket_bytes, prepare, stream.naming)

    def lookup(self, stream: ModuleStream, sync: Any, prepare: Callable) -> tuple | None:
        """(facts, tensors) to `store` after a fresh comparison, or None when the kept answer
        holds for ``stream`` (then ``reason`` / ``metas`` / ``plan`` are it)."""
        facts, tensors = _fingerprint(stream.module)
        self.kept = (self._module is not None and self._module() is stream.module
                     and self._key == self._key_of(stream, sync, prepare)
                     and facts == self._facts and len(tensors) == len(self._refs)
                     and all(r() is t for r, t in zip(self._refs, tensors)))
        return None if self.kept else (facts, tensors)

    def store(self, stream: ModuleStream, sync: Any, prepare: Callable, seen: tuple,
              reason: str | None, metas: list[TensorMeta] | None) -> None:
        facts, tensors = seen
        self._module = weakref.ref(stream.module)
        self._key = self._key_of(stream, sync, prepare)
        self._facts, self._refs = facts, [weakref.ref(t) for t in tensors]
        self.reason, self.metas = reason, metas
        self.plan = None if metas is None else plan_buckets(metas, sync.bucket_bytes)
        self.builds += 1

    def forget(self) -> None:
        self._module, self._refs, self._facts = None, [], ()
        self.reason = self.metas = self.plan = None


def refusal(stream: Any, sync: Any, prepare: Callable[[str, torch.Tensor], torch.Tensor], *,
            quantized: bool = False,
            decision: ExportDecision | None = None) -> tuple[str | None, list[TensorMeta] | None]:
    """This rank's answer, no collective: (why fsdp_sync's export may not replace ``stream``, or
    None; the export's metas when it may). ``sync``: the adapter's `SyncConfig`; ``prepare``: the
    adapter's per-tensor cast (it must take meta tensors); ``decision``: where the comparison of
    names, shapes and dtypes is kept between syncs (`ExportDecision`; None: made every call)."""
    if not isinstance(stream, ModuleStream):
        return "verl's stream carries no FSDP module", None
    if sync.strategy != "flattened":
        return f"strategy={sync.strategy!r} (the module's export makes flattened buckets)", None
    if quantized or getattr(sync, "quantization", None) is not None:
        return "the rollout quantizes (quantization is applied to verl's stream)", None
    if stream.peft:
        return "the actor is a LoRA (peft) model", None
    if stream.fsdp_version != 2:
        return f"the actor is FSDP{stream.fsdp_version}, not FSDP2", None
    if stream.param_offload:
        return "verl offloads the actor's parameters (param_offload or FSDP2's CPU-offload policy)", None
    if stream.qat:
        return "QAT is on (verl quantizes its stream)", None
    seen = None
    if decision is not None:
        try:
            seen = decision.lookup(stream, sync, prepare)
        except Exception as exc:  # noqa: BLE001 - whatever it is: verl's generator instead
            decision.forget()
            return f"the module could not be read ({type(exc).__name__}: {exc})", None
        if seen is None:
            return decision.reason, decision.metas
    try:
        ours = export.param_metas(stream.module, sync.dtype)
        theirs = verl_metas(stream, prepare)
    except Exception as exc:  # noqa: BLE001 - whatever it is: verl's generator instead
        if decision is not None:
            decision.forget()     # not kept: compared again next sync
        return f"the names could not be compared ({type(exc).__name__}: {exc})", None
    reason = _first_difference(theirs, ours) or None
    bad = [m for m in ours if m.dtype not in SUPPORTED_DTYPES]
    if reason is None and bad:
        reason = f"{bad[0].name!r} has dtype {dtype_name(bad[0].dtype)}, which buckets cannot hold"
    metas = None if reason is not None else ours
    if decision is not None:
        decision.store(stream, sync, prepare, seen, reason, metas)
    return reason, metas


def model_digest(metas: list[TensorMeta] | None) -> int:
    """An int in [0, 2**62) of the names, dtypes and full shapes fsdp_sync's export would send,
    in order (0 for None): the manager's model digest (`export_checks.digest_of`)."""
    return 0 if metas is None else digest_of(_entries(metas))


def _entries(metas: list[TensorMeta]) -> list:
    return [(m.name, dtype_name(m.dtype), tuple(int(x) for x in m.shape)) for m in metas]


def agreed(reason: str | None, group: Any = None,
           metas: list[TensorMeta] | None = None) -> str | None:
    """Collective over ``group`` (None: the world): None on every rank if every rank passed None,
    else the same text everywhere, naming the first rank that refused. ``metas`` (a rank that
    did not refuse: what its export would send): where every rank passed and their model digests
    (`model_digest`) differ, the ranks hold different models and the export's collectives would
    not match (a hang until the process group's timeout, or gloo aborting the process): raises
    the same `SyncError` on every rank naming the first rank and tensor that differ, as the
    manager does (`export_checks.agree_on_model`). Same all-reduce, no extra round trip."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return reason
    group = cpu_group(group)
    own = model_digest(metas)
    flag = torch.tensor([0 if reason is None else 1, own, -own], dtype=torch.int64)
    with released_by_backend(flag):
        # one small all-reduce when every rank agrees: any refusal, the digests' max and min
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag[0].item()) == 0:
        if int(flag[1].item()) == -int(flag[2].item()):
            return None
        lists: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, None if metas is None else _entries(metas), group=group)
        err = SyncError(f"fsdp_sync verl sync failed: {describe_difference(lists)}")
        err.failures = {0: str(err)}
        raise err
    answers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, reason, group=group)
    for rank, why in enumerate(answers):
        if why is not None:
            return f"rank {rank}: {why}"
    return None


def _absent(sync: Any) -> list[int]:
    """The ranks of the world that did not come to this sync's export decision (`peer_check`:
    by the store, no collective), the same list on every rank that did; [] without a world."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    return peer_check.absent_ranks(range(dist.get_world_size()),
                                   float(getattr(sync, "dist_timeout_s", 600.0)))


def _log_once(reason: str, loud: bool) -> None:
    if reason in _logged:
        return
    _logged.add(reason)
    (log.warning if loud else log.info)(
        "fsdp_sync verl sync: walking verl's per-tensor export, not fsdp_sync's from the FSDP "
        "module: %s", reason)


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def calls(weights: Any, sync: Any, topo: Any, stats: SyncStats, phases: dict,
          prepare: Callable[[str, torch.Tensor], torch.Tensor], *,
          quantized: bool = False, decision: ExportDecision | None = None,
          lag: bool = False) -> Iterator[Call] | None:
    """The adapter's hook: the sync's calls from fsdp_sync's export of ``weights.module``, or None
    (every rank alike) where verl's generator must be walked. Collective over the world when
    ``weights`` is a `ModuleStream` (every rank gets one: verl's engine is the same class on
    each); where some ranks of the world never come (no fsdp_sync adapter there), None on every
    rank that did, with no collective (`peer_check.absent_ranks`). ``prepare(name, tensor)`` is the adapter's per-tensor step: it decides verl's dtypes
    (on meta tensors) and, on the fast path, records each sent tensor for verify (bucket views).
    ``phases["export_s"]`` gets the seconds spent in the export. ``decision``: `refusal`'s, kept
    between syncs (the all-reduce runs every sync all the same). ``lag``: the engine may answer
    before every rank read a bucket: its buffers take turns (`ReusedBuffer`)."""
    if not isinstance(weights, ModuleStream):
        return None
    t0 = time.perf_counter()
    if decision is not None:
        decision.kept = False
    reason, metas = refusal(weights, sync, prepare, quantized=quantized, decision=decision)
    absent = _absent(sync)
    if absent:
        phases["export_s"] += time.perf_counter() - t0
        if topo.is_tp_src:
            _log_once(f"global ranks {absent} did not come to fsdp_sync's export: they run another "
                      f"rollout adapter (verl's own, if the fsdp_sync plug-in failed to load there: "
                      f"verl logs that at DEBUG only), which walks verl's per-tensor export, so "
                      f"every rank walks it; {peer_check.ENV_HINT}", True)
        return None
    reason = agreed(reason, metas=metas)     # ranks holding other models: refused by name
    phases["export_s"] += time.perf_counter() - t0
    if reason is not None:
        if topo.is_tp_src:
            _log_once(reason, False)
        return None
    weights.close()          # verl's generator: never pulled, nothing gathered
    plan = decision.plan if decision is not None and decision.plan is not None \
        else plan_buckets(metas, sync.bucket_bytes)
    return _ModuleCalls(weights.module, plan, sync, topo, stats, phases, prepare, lag)


class _ModuleCalls:
    """The sync's calls from fsdp_sync's export of ``module`` (one flattened bucket each, by
    ``plan``). Closed before its end (the sync failed at an engine, an agreement, a check; or
    before its first call) it walks the rest of the export, dropping it, unless a pull itself
    failed (that collective is what broke): each bucket is an all-gather over every trainer rank,
    which the other replicas' ranks walk with their own syncs; left, they waited in it until the
    process group's timeout and lost their own good sync (as `verl.stream.Walked` for verl's
    generator). The walk writes into a buffer of its own (an engine may still read the sync's)."""

    def __init__(self, module: torch.nn.Module, plan: list, sync: Any, topo: Any,
                 stats: SyncStats, phases: dict,
                 prepare: Callable[[str, torch.Tensor], torch.Tensor], lag: bool = False) -> None:
        self.plan, self.topo, self.stats, self.phases, self.prepare = plan, topo, stats, phases, prepare
        # the plan is checked against the module's live export in iter_buckets, every sync
        self.buf = ReusedBuffer(max((b.nbytes for b in plan), default=0), _device(module), lag=lag)
        self.it: Any = export.iter_buckets(module, sync.bucket_bytes, dtype=sync.dtype,
                                           alloc=self._take, share_host_memory=sync.share_host_memory,
                                           plan=plan)
        self.i, self.pull_failed = 0, False

    def _take(self, nbytes: int) -> torch.Tensor:
        return self.buf.take(nbytes)

    def __iter__(self) -> "_ModuleCalls":
        return self

    def __next__(self) -> Call:
        if self.it is None or self.i >= len(self.plan):
            raise StopIteration
        t0 = time.perf_counter()
        try:
            bucket, flat = next(self.it)
        except BaseException:
            self.pull_failed = True
            raise
        self.phases["export_s"] += time.perf_counter() - t0
        for e in bucket.entries:         # verify's record (infer-TP rank 0), the cast a no-op
            self.prepare(e.name, flat[e.start:e.end].view(e.dtype).view(e.shape))
        obj = flattened_bucket(flat, bucket)
        ps = handles.make_payloads(obj, self.topo.tp_size, ranks=[self.topo.tp_rank], tagged=False,
                                   output_str=True)
        del obj, flat
        self.stats.buckets += 1
        self.stats.tensors += len(bucket.entries)
        self.stats.bytes += bucket.payload_bytes
        i, self.i = self.i, self.i + 1
        # one flush_cache after the last bucket (the adapter's update_weights)
        return Call([ps], ps.payloads[0], lambda g: g, "flattened_bucket", False,
                    f"bucket {i} ({bucket.names[0]}…)", on_release=self.buf.give_back)

    def close(self) -> None:
        it, self.it = self.it, None
        if it is None:
            return
        try:
            if not self.pull_failed and self.i < len(self.plan):
                self.buf = ReusedBuffer(self.buf.nbytes, self.buf.device)
                try:
                    for _ in it:
                        self.buf.give_back()
                except Exception as exc:  # noqa: BLE001 - the sync's own error is the one raised
                    log.warning("fsdp_sync: walking the rest of fsdp_sync's export after a failed "
                                "sync: %s", exc)
        finally:
            it.close()               # a host-shared buffer goes with the generator, not later
            self.buf.buf = self.buf.prev = None
