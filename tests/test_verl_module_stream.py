"""fsdp_sync's export in place of verl's per-tensor generator (`integrations.module_stream`),
without verl: a verl-like stream (``(name, full_tensor())`` per state-dict entry, as verl's
``FSDPEngine.get_per_tensor_param``) over a real FSDP2 model on 2 gloo ranks.

- where fsdp_sync's export sends exactly what verl's stream would, the sync's buckets come from
  the module (verl's generator is never pulled; host-shared: no all-gather at all, else one per
  bucket) and the engine, served over HTTP as SGLang is, ends with verl's stream's bytes, tensor
  for tensor (its digests) and as a whole (its checksum);
- where any rank refuses, every rank walks verl's generator, with the same reason everywhere;
- every case that must refuse does, naming why: not a module stream, strategy, quantization, LoRA,
  FSDP1, parameter offload, QAT, renamed keys, tied weights, a cast that differs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _verl_style(module, pulled: list):
    """What verl 0.9.1's FSDPEngine.get_per_tensor_param yields for FSDP2 without LoRA."""
    from torch.distributed.tensor import DTensor

    for name, p in module.state_dict().items():
        pulled.append(name)
        yield name, p.full_tensor() if isinstance(p, DTensor) else p


def _prepare_fn(dtype, record):
    """The adapter's per-tensor step: cast floats to the rollout dtype, record for verify."""
    def prepare(name, t):
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype and t.element_size() > 1:
            t = t.to(dtype)
        t = t.contiguous()
        if record is not None and t.device.type != "meta":
            record.add(name, t)
        return t
    return prepare


def _fast_syncs(rank, world, url, share_flags):
    import torch.distributed as dist

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.transport.tensor import TensorTransport
    from fsdp_sync.verify import SentDigests, tensor_digest
    from fsdp_sync.weights import gather
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines.base import checksum_named_tensors

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    topo = SyncTopology.from_mesh(make_mesh(1, 2))
    engine = SGLangEngine(base_url=url, tp_size=2) if topo.is_tp_src else None
    out = []
    for step, share in enumerate(share_flags):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.001 * (step + 1))
        cfg = SyncConfig(dtype=torch.float32, bucket_bytes=96 << 10, share_host_memory=share)
        pulled: list = []
        stream = module_stream.ModuleStream(_verl_style(module, pulled), module)
        sent = SentDigests("full", step) if topo.is_tp_src else None
        stats, phases = SyncStats(), {"export_s": 0.0}
        gathers = 0
        real = gather.all_gather

        def counting(*a, **k):
            nonlocal gathers
            gathers += 1
            return real(*a, **k)

        gather.all_gather = counting
        try:
            steps = module_stream.calls(stream, cfg, topo, stats, phases,
                                        _prepare_fn(cfg.dtype, sent))
            assert steps is not None
            TensorTransport(cfg).send(steps, topo=topo, engine=engine, stats=stats,
                                      group=topo.tp_group, what="test sync",
                                      check=(lambda eng: sent.check(eng)[0]))
        finally:
            gather.all_gather = real
        if engine is not None:
            engine.flush_cache()
        # what verl's stream would have sent: computed now, by verl's own per-tensor gathers
        expected = {n: tensor_digest(n, t) for n, t in _verl_style(module, [])}
        out.append({"pulled": len(pulled), "gathers": gathers, "buckets": stats.buckets,
                    "calls": stats.engine_calls, "tensors": stats.tensors,
                    "sent": None if sent is None else sent.digests, "expected": expected})
    out.append(checksum_named_tensors(_verl_style(module, [])))
    dist.barrier()
    return out


@pytest.mark.timeout(240)
def test_the_module_export_sends_exactly_what_verls_stream_would_bucket_by_bucket():
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    with ReferenceEngine("tiny", tp_size=2, seed=1, dtype=torch.float32) as engine, \
            EngineServer(engine) as server:
        results = run_ranks(_fast_syncs, 2, server.url, (True, False), timeout_s=220,
                            env=spawn_env())
        served = engine.weights_checksum()
    r0, r1 = results
    assert served == r0[-1] == r1[-1]             # the engine holds verl's stream's bytes
    for share, a, b in zip((True, False), r0[:-1], r1[:-1]):
        assert a["pulled"] == b["pulled"] == 0       # verl's generator: never walked
        assert a["tensors"] == len(a["expected"]) == 27
        assert a["buckets"] == b["buckets"] > 1 and a["calls"] == a["buckets"]
        # host-shared: the ranks write their shards, nothing is gathered; else one per bucket
        assert a["gathers"] == b["gathers"] == (0 if share else a["buckets"])
        assert a["sent"] == a["expected"]          # tensor by tensor, as sent (verify: full)
        assert a["expected"] == b["expected"]


def _one_refuses(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    topo = SyncTopology.from_mesh(make_mesh(1, 2))
    pulled: list = []
    # rank 1 says its parameters are offloaded: a reason only it has
    stream = module_stream.ModuleStream(_verl_style(module, pulled), module,
                                        param_offload=rank == 1)
    cfg = SyncConfig(dtype=torch.float32)
    steps = module_stream.calls(stream, cfg, topo, SyncStats(), {"export_s": 0.0},
                                _prepare_fn(None, None))
    reason, _ = module_stream.refusal(stream, cfg, _prepare_fn(None, None))
    agreed = module_stream.agreed(reason)
    names = [n for n, _ in stream]                  # the fallback: verl's generator, whole
    return steps is None, agreed, len(pulled), names


@pytest.mark.timeout(120)
def test_one_rank_refusing_sends_every_rank_down_verls_stream_with_one_reason():
    results = run_ranks(_one_refuses, 2, timeout_s=100, env=spawn_env())
    (fell0, why0, pulled0, names0), (fell1, why1, pulled1, names1) = results
    assert fell0 and fell1
    assert why0 == why1 and why0.startswith("rank 1: verl offloads the actor's parameters")
    assert pulled0 == pulled1 == len(names0) == 27 and names0 == names1


# --------------------------------------------------------------------------- refusals, one process

def _model(name="tiny"):
    from fsdp_sync.models import build_model, load_config

    return build_model(load_config(name), seed=0)


def _stream(module, **kw):
    from fsdp_sync.integrations.module_stream import ModuleStream

    return ModuleStream(iter(()), module, **kw)


def _cfg(**kw):
    from fsdp_sync.config import SyncConfig

    return SyncConfig(**kw)


def test_an_exact_match_is_taken_and_lists_the_exports_tensors():
    from fsdp_sync.integrations.module_stream import refusal
    from fsdp_sync.weights import export

    module = _model()
    reason, metas = refusal(_stream(module), _cfg(dtype=torch.bfloat16),
                            _prepare_fn(torch.bfloat16, None))
    assert reason is None
    assert metas == export.param_metas(module, torch.bfloat16)
    assert {m.dtype for m in metas} == {torch.bfloat16}


@pytest.mark.parametrize("case,expected", [
    ("plain", "carries no FSDP module"),
    ("strategy", "strategy='bucketed'"),
    ("quantized", "the rollout quantizes"),
    ("peft", "LoRA (peft) model"),
    ("fsdp1", "FSDP1, not FSDP2"),
    ("offload", "offloads the actor's parameters"),
    ("qat", "QAT is on"),
    ("renamed", "tensor #0: verl 'embed_tokens.weight' float32 (512, 64), fsdp_sync "
                "'model.embed_tokens.weight' float32 (512, 64)"),
    ("tied", "verl's stream sends 27 tensors, fsdp_sync's export 26; tensor #26: verl "
             "'lm_head.weight' float32 (512, 64), fsdp_sync nothing"),
    ("cast", "tensor #0: verl 'model.embed_tokens.weight' float32 (512, 64), fsdp_sync "
             "'model.embed_tokens.weight' bfloat16 (512, 64)"),
])
def test_every_case_that_is_not_exact_refuses_naming_why(case, expected):
    from fsdp_sync.integrations.module_stream import refusal

    module = _model("tiny-tied" if case == "tied" else "tiny")
    kw: dict = {}
    cfg = {"dtype": torch.float32}
    quantized = False
    prepare = _prepare_fn(None, None)
    if case == "strategy":
        cfg["strategy"] = "bucketed"
    elif case == "quantized":
        quantized = True
    elif case in ("peft", "qat"):
        kw[case] = True
    elif case == "fsdp1":
        kw["fsdp_version"] = 1
    elif case == "offload":
        kw["param_offload"] = True
    elif case == "renamed":    # what verl's convert_weight_keys does with a conversion mapping
        kw["convert"] = lambda sd: {k.removeprefix("model."): v for k, v in sd.items()}
    elif case == "cast":       # the adapter would send float32, the export would cast
        cfg["dtype"] = torch.bfloat16
    stream = SimpleNamespace() if case == "plain" else _stream(module, **kw)
    reason, metas = refusal(stream, _cfg(**cfg), prepare, quantized=quantized)
    assert metas is None and expected in reason, reason


def test_the_wrapped_stream_is_verls_generator_item_for_item():
    from fsdp_sync.integrations.module_stream import ModuleStream

    module = _model()
    pulled: list = []
    stream = ModuleStream(_verl_style(module, pulled), module, flags={"base_sync_done": True})
    assert pulled == []                            # nothing pulled until iterated
    got = list(stream)
    ref = list(_verl_style(module, []))
    assert [n for n, _ in got] == [n for n, _ in ref]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref))
    assert stream.flags == {"base_sync_done": True} and stream.module is module


# --------------------------------------------------------------------------- the kept decision

def _decide(decision, module, cfg, prepare, **kw):
    from fsdp_sync.integrations.module_stream import refusal

    return refusal(_stream(module, **kw), cfg, prepare, decision=decision)


def test_the_decision_is_kept_while_the_module_is_unchanged():
    from fsdp_sync.integrations.module_stream import ExportDecision
    from fsdp_sync.weights import export

    module, cfg, prepare = _model(), _cfg(dtype=torch.float32), _prepare_fn(torch.float32, None)
    decision = ExportDecision()
    first = _decide(decision, module, cfg, prepare)
    assert first[0] is None and decision.builds == 1 and not decision.kept
    with torch.no_grad():                          # new values, same objects: a training step
        for p in module.parameters():
            p.add_(1.0)
    for _ in range(3):
        assert _decide(decision, module, cfg, prepare) == first
    assert decision.builds == 1 and decision.kept
    assert first[1] == export.param_metas(module, torch.float32)
    assert [(e.name, e.dtype, e.shape) for b in decision.plan for e in b.entries] == \
        [(m.name, m.dtype, m.shape) for m in first[1]]


def _swap_param(module, name, make):
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    setattr(sub, leaf, torch.nn.Parameter(make(getattr(sub, leaf).detach())))


@pytest.mark.parametrize("change,check", [
    # the same shape and dtype, a new object (an optimizer that rebuilds parameters)
    ("new object", lambda reason, metas: reason is None),
    # one tensor becomes bfloat16 under a rollout dtype of None: a stale decision would plan
    # float32 bytes for it
    ("dtype", lambda reason, metas: reason is None and {m.name: m.dtype for m in metas}[
        "model.norm.weight"] == torch.bfloat16),
    ("shape", lambda reason, metas: reason is None and {m.name: tuple(m.shape) for m in metas}[
        "model.norm.weight"] == (32,)),
    ("same object, new data", lambda reason, metas: reason is None and {
        m.name: m.dtype for m in metas}["model.norm.weight"] == torch.float16),
    ("new buffer", lambda reason, metas: reason is None and "model.extra" in [m.name for m in metas]),
    ("tied", lambda reason, metas: metas is None and "verl's stream sends 27 tensors, fsdp_sync's "
                                   "export 26" in reason),
    ("replaced submodule", lambda reason, metas: reason is None),
])
def test_any_change_to_the_module_after_kept_syncs_is_compared_again(change, check):
    from fsdp_sync.integrations.module_stream import ExportDecision
    from fsdp_sync.weights import export

    module, cfg, prepare = _model(), _cfg(dtype=None), _prepare_fn(None, None)
    decision = ExportDecision()
    for _ in range(2):
        assert _decide(decision, module, cfg, prepare)[0] is None
    assert decision.builds == 1 and decision.kept
    if change == "new object":
        _swap_param(module, "model.norm.weight", lambda t: t.clone())
    elif change == "dtype":
        _swap_param(module, "model.norm.weight", lambda t: t.to(torch.bfloat16))
    elif change == "shape":
        _swap_param(module, "model.norm.weight", lambda t: t[:32].clone())
    elif change == "same object, new data":
        module.model.norm.weight.data = module.model.norm.weight.data.to(torch.float16)
    elif change == "new buffer":
        module.model.register_buffer("extra", torch.zeros(3))
    elif change == "tied":
        module.lm_head.weight = module.model.embed_tokens.weight
    elif change == "replaced submodule":
        module.model.norm = type(module.model.norm)(module.model.norm.weight.shape[0])
    reason, metas = _decide(decision, module, cfg, prepare)
    assert decision.builds == 2 and not decision.kept
    assert check(reason, metas), (reason, metas)
    if metas is not None:       # the fresh answer is the module's export as it is now
        assert metas == export.param_metas(module, None)
    assert _decide(decision, module, cfg, prepare) == (reason, metas)   # kept again from here
    assert decision.builds == 2 and decision.kept


def test_what_the_decision_depends_on_outside_the_module_rebuilds_it():
    from fsdp_sync.integrations.module_stream import ExportDecision

    module, prepare = _model(), _prepare_fn(None, None)
    decision = ExportDecision()
    _decide(decision, module, _cfg(dtype=None), prepare)
    _decide(decision, module, _cfg(dtype=torch.bfloat16), prepare)           # the rollout dtype
    assert decision.builds == 2 and "tensor #0" in decision.reason           # prepare kept float32
    _decide(decision, module, _cfg(dtype=torch.bfloat16), _prepare_fn(torch.bfloat16, None))
    assert decision.builds == 3 and decision.reason is None                  # another cast
    cfg = _cfg(dtype=torch.bfloat16, bucket_bytes=1 << 20)
    bf16 = _prepare_fn(torch.bfloat16, None)
    _decide(decision, module, cfg, bf16)
    assert decision.builds == 4                                              # the bucket size
    assert {b.nbytes <= 1 << 20 for b in decision.plan} == {True}
    _decide(decision, _model(), cfg, bf16)                                   # another module
    assert decision.builds == 5
    # verl's naming: functions made anew each stream are never trusted; a naming key is
    rename = {"convert": lambda sd: dict(sd)}
    _decide(decision, module, cfg, bf16, **rename)
    _decide(decision, module, cfg, bf16, convert=lambda sd: dict(sd))
    assert decision.builds == 7
    _decide(decision, module, cfg, bf16, convert=lambda sd: dict(sd), naming="m")
    _decide(decision, module, cfg, bf16, convert=lambda sd: dict(sd), naming="m")
    assert decision.builds == 8 and decision.kept
    _decide(decision, module, cfg, bf16, convert=lambda sd: dict(sd), naming="other")
    assert decision.builds == 9
    # the cheap refusals are asked every call, before the kept answer
    reason, _ = _decide(decision, module, cfg, bf16, naming="other", param_offload=True)
    assert "offloads" in reason


def _kept_syncs(rank, world, url):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.transport.tensor import TensorTransport
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    topo = SyncTopology.from_mesh(make_mesh(1, 2))
    engine = SGLangEngine(base_url=url, tp_size=2) if topo.is_tp_src else None
    cfg = SyncConfig(dtype=torch.float32, bucket_bytes=96 << 10, share_host_memory=True)
    prepare = _prepare_fn(cfg.dtype, None)
    decision = module_stream.ExportDecision()
    out = []
    for step in range(4):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.001 * (step + 1))
        if step == 2:   # a new object, replicated instead of sharded, with other values
            old = module.model.norm.weight
            module.model.norm.weight = torch.nn.Parameter(distribute_tensor(
                (old.full_tensor() * 2 + 1).detach(), old.device_mesh, [Replicate()]))
        stream = module_stream.ModuleStream(_verl_style(module, []), module, naming="tiny")
        steps = module_stream.calls(stream, cfg, topo, SyncStats(), {"export_s": 0.0}, prepare,
                                    decision=decision)
        assert steps is not None
        TensorTransport(cfg).send(steps, topo=topo, engine=engine, group=topo.tp_group,
                                  what="test sync")
        if engine is not None:
            engine.flush_cache()
        dist.barrier()
        out.append({"builds": decision.builds, "kept": decision.kept,
                    "expected": checksum_named_tensors(_verl_style(module, []))})
    dist.barrier()
    return out


@pytest.mark.timeout(240)
def test_kept_decisions_sync_exactly_and_a_changed_module_is_compared_again():
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    with ReferenceEngine("tiny", tp_size=2, seed=1, dtype=torch.float32) as engine, \
            EngineServer(engine) as server:
        results = run_ranks(_kept_syncs, 2, server.url, timeout_s=220, env=spawn_env())
        final = engine.weights_checksum()
    for r in results:
        # made, kept, made again (the swapped parameter), kept
        assert [(s["builds"], s["kept"]) for s in r] == [(1, False), (1, True), (2, False), (2, True)]
    assert results[0][-1]["expected"] == results[1][-1]["expected"] == final


# --------------------------------------------------------------------------- a mixed world

def _mixed_world(rank, world):
    """Ranks 0 and 1 (one infer-TP group) run fsdp_sync's adapter, ranks 2 and 3 verl's own (the
    plug-in did not load there): they walk verl's stream, one all-gather per tensor over the world."""
    import time

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)   # over the 4 ranks
    topo = SyncTopology.from_mesh(make_mesh(2, 2))
    out = []
    for _ in range(2):
        pulled: list = []
        stream = module_stream.ModuleStream(_verl_style(module, pulled), module)
        t0 = time.monotonic()
        fell = None
        if rank < 2:
            cfg = SyncConfig(dtype=torch.float32, dist_timeout_s=60)
            fell = module_stream.calls(stream, cfg, topo, SyncStats(), {"export_s": 0.0},
                                       _prepare_fn(None, None)) is None
        decided_s = time.monotonic() - t0
        names = [n for n, _ in stream]         # verl's generator, whole, on every rank
        out.append({"fell": fell, "decided_s": decided_s, "names": names})
    return out


@pytest.mark.timeout(150)
def test_ranks_without_the_plugin_send_every_rank_down_verls_stream_instead_of_a_hang():
    """The plug-in loaded on ranks 0 and 1 only: their module export's world all-reduce met ranks
    2 and 3's per-tensor all-gathers and hung until the process-group timeout. Now ranks 0 and 1
    find (in the store) that 2 and 3 never came, walk verl's stream with them, and the next sync
    does not wait again."""
    results = run_ranks(_mixed_world, 4, timeout_s=120, pg_timeout_s=20, env=spawn_env())
    for rank, syncs in enumerate(results):
        for sync in syncs:
            assert sync["names"] == results[0][0]["names"] and len(sync["names"]) == 27
            assert sync["fell"] is (True if rank < 2 else None), (rank, sync)
    first, second = results[0]
    assert first["decided_s"] < 15 and second["decided_s"] < 2, results[0]
