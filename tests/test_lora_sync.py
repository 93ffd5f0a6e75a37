"""`SyncConfig.lora="adapter"`: a peft-shaped LoRA model (`fsdp_sync.cli.lora_model`) under FSDP2
on two ranks syncs its base once and then only its adapter into reference engines (TP 1 and 2),
verified bit-exact after every sync; the engine's logits with the adapter equal the trainer's own
forward; adapters the engine's base cannot take are refused by name and the old one keeps serving.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]
NAME = "fsdp_sync_lora"


def _lora_module(r, alpha, targets=None):
    from fsdp_sync.cli.lora_model import ALL_LINEAR, add_lora
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.models import build_model, load_config

    model = add_lora(build_model(load_config("tiny"), seed=0), r, alpha, targets or ALL_LINEAR, seed=1)
    return wrap_fsdp(model, 2)


def _train_adapter(module, step):
    """One SGD step on the adapter only (the base stays as synced)."""
    lora = [p for n, p in module.named_parameters() if ".lora_" in n]
    opt = torch.optim.SGD(lora, lr=0.5)
    ids = torch.tensor([[3 + step, 5, 7, 11, 13]])
    module(input_ids=ids).logits.pow(2).mean().backward()
    opt.step()
    module.zero_grad(set_to_none=True)


def _body(rank, world, tp):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import last_logits

    torch.set_num_threads(1)
    mesh = make_mesh(world // tp, tp)
    topo = SyncTopology.from_mesh(mesh)
    engine = ReferenceEngine(model_config=load_config("tiny"), tp_size=tp, max_lora_rank=8) if topo.is_tp_src else None
    out = {"syncs": [], "refusals": []}
    try:
        module = _lora_module(4, 8)
        cfg = SyncConfig(dtype=torch.float32, lora="adapter", verify="full", bucket_bytes=64 << 10)
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=cfg)

        def sync_and_compare():
            with manager:
                want = last_logits(module, PROMPTS)
                rec = {"bytes": manager.stats.bytes, "tensors": manager.stats.tensors,
                       "base_bytes": manager.stats.extra.get("base_bytes")}
                if engine is not None:
                    got = engine.forward_logits(PROMPTS, lora_path=NAME).float()
                    rec["diff"] = float((got - want).abs().max())
                    rec["base_diff"] = float((engine.forward_logits(PROMPTS).float() - want).abs().max())
            out["syncs"].append(rec)

        sync_and_compare()                       # base + adapter
        for step in range(2):                    # adapter only
            _train_adapter(module, step)
            sync_and_compare()
        before = engine.forward_logits(PROMPTS, lora_path=NAME) if engine is not None else None

        # other rank / other target modules than the adapter the engine serves: refused by name
        for kw in ({"r": 8, "alpha": 16}, {"r": 4, "alpha": 8, "targets": ("q_proj", "v_proj")}):
            other = _lora_module(kw["r"], kw["alpha"], kw.get("targets"))
            m2 = FSDPShardingManager(other, engine, mesh=mesh, config=cfg)
            m2.base_sync_done = True             # as verl passes base_sync_done=True
            try:
                with m2:
                    out["refusals"].append(None)
            except SyncError as exc:
                out["refusals"].append(str(exc))
        # the engine's base changed behind the manager's back: refused until the base is synced again
        if engine is not None:
            engine.update_weight_version("someone-else")
        try:
            with manager:
                out["refusals"].append(None)
        except SyncError as exc:
            out["refusals"].append(str(exc))
        if engine is not None:
            out["kept"] = torch.equal(engine.forward_logits(PROMPTS, lora_path=NAME), before)
        manager.base_sync_done = False
        sync_and_compare()
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", [1, 2])
def test_adapter_sync_fsdp2(tp):
    results = run_ranks(_body, 2, tp, timeout_s=380, env=spawn_env())
    for rank, res in enumerate(results):
        syncs = res["syncs"]
        assert len(syncs) == 4
        first, adapter_only = syncs[0], syncs[1:3]
        # the first sync sends the base (its bytes in base_bytes) and then the adapter
        assert first["base_bytes"] > 10 * first["bytes"] > 0
        for s in adapter_only:
            assert s["base_bytes"] is None and s["bytes"] == first["bytes"]
            assert s["tensors"] == 2 * 7 * 2      # lora_A and lora_B of 7 modules in 2 layers
        if rank % tp == 0:
            for s in syncs:
                assert s["diff"] < 1e-5, s            # the engine with the adapter = the trainer
                assert s["base_diff"] > 1e-3, s       # and the adapter does change the outputs
            assert res["kept"]
        r_rank, r_targets, r_base = res["refusals"]
        assert r_rank and "r=8 but the engine serves it with r=4" in r_rank
        assert r_targets and "target_modules ['q_proj', 'v_proj'] but the engine serves it on" in r_targets
        assert r_base and "base weights are version 'someone-else'" in r_base


def test_lora_module_refused_when_lora_off():
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    model = add_lora(build_model(load_config("tiny"), seed=0), 4, 8)
    with pytest.raises(ValueError, match="SyncConfig.lora"):
        FSDPShardingManager(model, None, config=SyncConfig(method="disk", disk_dir="/nonexistent"))
    with pytest.raises(ValueError, match="lora must be one of"):
        SyncConfig(lora="merged")
    # the base stream: HF names, no lora_ tensors; the adapter stream: only those
    base = [m.name for m in export.param_metas(model)]
    assert base == [m.name for m in export.param_metas(build_model(load_config("tiny"), seed=0))]
    lora = [m.name for m in export.param_metas(model, lora=True)]
    assert lora[0] == "model.layers.0.self_attn.q_proj.lora_A.default.weight" and len(lora) == 28


@pytest.mark.timeout(400)
def test_demo_lora_and_bench_row():
    """`fsdp-sync demo --lora`: the engine with the adapter matches the trainer every step, the
    first sync sends the base and later ones the adapter alone; `bench --lora-r`: the adapter row
    beside the full row of the same model, both checked against the trainer."""
    from fsdp_sync.cli.bench.lora import run_lora_bench
    from fsdp_sync.cli.demo import DemoOptions, run_demo

    res = run_demo(DemoOptions(steps=2, lora_r=4, lora_alpha=8, progress=False, max_new_tokens=4),
                   timeout_s=380)
    assert res["ok"], res["steps"]
    first, second = res["steps"]
    assert first["base_bytes"] > 10 * first["bytes"] and second["base_bytes"] is None
    assert second["bytes"] == first["bytes"] == 2 * 4 * 4 * (2 * 64 + 2 * (64 + 32) + 2 * 64 + 3 * (64 + 128))  # layers, fp32, r
    bench = run_lora_bench("tiny", 2, 2, 4, 8.0, repeats=1, timeout_s=300)
    full, adapter = bench["rows"]
    assert bench["ok"] and full["mode"] == "full" and adapter["mode"] == "adapter"
    assert adapter["bytes"] == first["bytes"] and full["bytes"] == first["bytes"] + first["base_bytes"]
    assert adapter["bytes_ratio"] == adapter["bytes"] / full["bytes"]


def test_cli_lora_flags_need_lora():
    from fsdp_sync.cli.app import parse_args

    with pytest.raises(SystemExit):
        parse_args(["demo", "--lora-r", "8"])
    with pytest.raises(SystemExit):
        parse_args(["bench", "--lora-alpha", "8"])
    args = parse_args(["demo", "--lora", "--lora-r", "8", "--lora-alpha", "16"])
    assert (args.opts.lora_r, args.opts.lora_alpha) == (8, 16.0)


def test_check_engine_refusals_name_the_difference():
    """`lora_sync.check_engine` on engines described by their attributes (no process needed)."""
    from types import SimpleNamespace

    from fsdp_sync.lora_sync import check_engine, peft_name

    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    load = lambda *a, **k: None   # noqa: E731
    assert "has no load_lora_adapter_from_tensors" in check_engine(object(), cfg, "a", None)
    ok = SimpleNamespace(load_lora_adapter_from_tensors=load, lora_adapters={}, weight_version="3")
    assert check_engine(ok, cfg, "a", "3") is None
    assert "base weights are version '3', not the base version '2'" in check_engine(ok, cfg, "a", "2")
    held = SimpleNamespace(load_lora_adapter_from_tensors=load, weight_version="3",
                           lora_adapters={"a": {"r": 8, "target_modules": ["q_proj"]}})
    assert "target_modules ['q_proj', 'v_proj'] but the engine serves it on ['q_proj']" in check_engine(held, cfg, "a", "3")
    assert check_engine(held, cfg, "b", "3") is None          # another name: nothing to match
    small = SimpleNamespace(load_lora_adapter_from_tensors=load, max_lora_rank=4, lora_target_modules=("q_proj",))
    assert "exceeds the engine's max_lora_rank 4" in check_engine(small, cfg, "a", None)
    # compared as SGLang's pool compares them: v_proj is qkv_proj, as q_proj is (taken); o_proj is not
    assert check_engine(small, dict(cfg, r=4), "a", None) is None
    assert "['o_proj'] are not in the engine's lora_target_modules ['q_proj']" in check_engine(
        small, dict(cfg, r=4, target_modules=["q_proj", "v_proj", "o_proj"]), "a", None)
    assert peft_name("model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"


def test_check_engine_refuses_targets_sglang_cannot_stack():
    """SGLang stacks q/k/v from q_proj with v_proj and gate/up from gate_proj (its own code:
    tests/sglang_tier/test_sglang_lora.py); an adapter on k/v without q, q without v or up without
    gate is refused by name before an SGLang engine is touched. The reference engine (which keeps
    ``lora_adapters``) serves any subset, so it is not refused there."""
    from types import SimpleNamespace

    from fsdp_sync.lora_sync import check_engine, sglang_refusal

    load = lambda *a, **k: None   # noqa: E731
    sglang = SimpleNamespace(load_lora_adapter_from_tensors=load)
    reference = SimpleNamespace(load_lora_adapter_from_tensors=load, lora_adapters={})
    for targets, add in [(["v_proj", "o_proj"], ["q_proj"]), (["q_proj", "k_proj"], ["v_proj"]),
                         (["k_proj"], ["q_proj", "v_proj"]), (["up_proj", "down_proj"], ["gate_proj"]),
                         (["model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj"],
                          ["q_proj", "v_proj", "gate_proj"])]:
        cfg = {"r": 8, "lora_alpha": 16, "target_modules": targets}
        msg = check_engine(sglang, cfg, "a", None)
        assert msg is not None and msg.startswith("adapter 'a': SGLang cannot serve target_modules ") \
            and msg.endswith(f"add {add} to the adapter's target_modules"), (targets, msg)
        assert check_engine(reference, cfg, "a", None) is None
    for targets in (["q_proj", "v_proj"], ["q_proj", "v_proj", "gate_proj"], ["o_proj", "down_proj"],
                    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "all-linear"):
        assert sglang_refusal(targets) is None, targets
        assert check_engine(sglang, {"r": 8, "lora_alpha": 16, "target_modules": targets}, "a", None) is None


class _Adapters(torch.nn.Module):
    """peft's ``lora.Linear`` with several adapters: ``lora_A`` / ``lora_B`` ModuleDicts keyed by
    adapter name, the forward adding the active ones' (``active``: the model's list, shared)."""

    def __init__(self, base, shapes, active, g):
        super().__init__()
        self.base_layer, self.active, self.scaling = base, active, {}
        self.lora_A, self.lora_B = torch.nn.ModuleDict(), torch.nn.ModuleDict()
        for name, (r, alpha) in shapes.items():
            self.lora_A[name] = torch.nn.Linear(base.in_features, r, bias=False)
            self.lora_B[name] = torch.nn.Linear(r, base.out_features, bias=False)
            with torch.no_grad():
                for lin in (self.lora_A[name], self.lora_B[name]):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
            self.scaling[name] = alpha / r

    def forward(self, x):
        return self.base_layer(x) + sum(self.lora_B[a](self.lora_A[a](x)) * self.scaling[a] for a in self.active)


def _peft_adapters(shapes, active, configs=None, seed=0):
    """A model named as peft names one with the adapters ``shapes`` ({name: (r, alpha)}), its
    ``peft_config`` ({name: LoraConfig dict}, or ``configs``) and ``active_adapters`` (peft's
    property: ``active``, a list the test may change in place), without peft; ``seed``: the base's."""
    from fsdp_sync.cli.lora_model import ALL_LINEAR, PeftLike
    from fsdp_sync.models import build_model, load_config

    class Peft(PeftLike):
        @property
        def active_adapters(self):
            return list(self.active)

    model, g = build_model(load_config("tiny"), seed=seed), torch.Generator().manual_seed(1)
    model.requires_grad_(False)
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for n, child in list(parent.named_children()):
                if n in ALL_LINEAR and isinstance(child, torch.nn.Linear):
                    setattr(parent, n, _Adapters(child, shapes, active, g))
    pm = Peft(model, {})
    pm.active = active
    pm.peft_config = configs if configs is not None else {
        a: {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(ALL_LINEAR)}
        for a, (r, alpha) in shapes.items()}
    return pm


def _sync_into(eng, tmp_path):
    """``sync(pm)``: one manager's first sync of ``pm`` (disk, verify full, a fresh disk_dir each)
    into ``eng`` after dropping its adapter "L": (the engine's largest logit difference from the
    trainer's with the adapter, the sync's stats)."""
    from fsdp_sync.cli.trainer import last_logits
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager

    dirs = iter(range(100))     # a published step is never overwritten

    def sync(pm):
        if "L" in eng.lora_adapters:
            eng.unload_lora_adapter("L")
        cfg = SyncConfig(method="disk", disk_dir=str(tmp_path / str(next(dirs))), lora="adapter",
                         lora_name="L", verify="full", dtype=torch.float32)
        manager = FSDPShardingManager(pm, eng, config=cfg)
        try:
            with manager, torch.no_grad():
                diff = float((eng.forward_logits(PROMPTS, lora_path="L").float()
                              - last_logits(pm, PROMPTS)).abs().max())
                return diff, manager.stats
        finally:
            manager.close()
    return sync


@pytest.mark.timeout(300)
def test_the_active_adapter_of_several_is_synced(tmp_path):
    """A peft model holding two adapters (``add_adapter``) serves the active one: its tensors alone
    (28, not the 56 of both, which kept the other's under the active one's config: logits 0.66
    away, verified), its config; the other once activated (``set_adapter``). Several active at
    once (peft sums them) are refused before the base is sent: nothing changes."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.lora_sync import peft_name
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights.adapter_export import AdapterExport

    torch.set_num_threads(1)
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        sync = _sync_into(eng, tmp_path)
        active = ["default"]
        two = _peft_adapters({"default": (4, 8), "second": (8, 16)}, active)
        for name, r in (("default", 4), ("second", 8)):
            active[:] = [name]
            diff, stats = sync(two)
            assert diff < 1e-5 and stats.tensors == 28 and stats.extra["r"] == r, (name, diff, stats)
            assert stats.extra["adapter"] == name
        base = eng.forward_logits(PROMPTS)
        with pytest.raises(SyncError, match=r"active adapters are \['default', 'second'\]: it sums"):
            sync(_peft_adapters({"default": (4, 8), "second": (4, 8)}, ["default", "second"], seed=5))
        assert torch.equal(eng.forward_logits(PROMPTS), base) and "L" not in eng.lora_adapters   # nothing sent
    # the export's safety net: every adapter's tensors asked for, two take one peft name
    with pytest.raises(ValueError, match=r"lora_A\.default\.weight' and .*lora_A\.second\.weight' "
                                         r"would both be sent as 'base_model\.model\.model\.layers\.0"):
        AdapterExport(peft_name).tensors(two, torch.float32)


@pytest.mark.timeout(300)
def test_an_adapter_named_otherwise_and_its_config_before_the_base(tmp_path):
    """An adapter named otherwise than "default" (peft's ``adapter_name="actor"``) is served under
    its own config (before: refused for want of a config, the module a peft model); an active
    adapter that ``peft_config`` holds no config for is refused before the base is sent (before:
    after it, the base half-applied)."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        sync = _sync_into(eng, tmp_path)
        diff, stats = sync(_peft_adapters({"actor": (4, 8)}, ["actor"]))
        assert diff < 1e-5 and stats.tensors == 28 and stats.extra["r"] == 4
        base = eng.forward_logits(PROMPTS)      # another base (seed 5) would change these if sent
        with pytest.raises(SyncError, match=r"needs the adapter's config.*holds \['default'\], not 'actor'"):
            sync(_peft_adapters({"actor": (4, 8)}, ["actor"], configs={"default": {"r": 4}}, seed=5))
        assert torch.equal(eng.forward_logits(PROMPTS), base) and "L" not in eng.lora_adapters   # nothing sent
