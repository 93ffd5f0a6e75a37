"""A LoRA adapter's config and tensors as the reference engine checks them, in process (the tiny
model's TP layouts, no engine): each refusal names the key or the tensor and the value (r, alpha,
peft_type, bias, target_modules; a tensor of another module, layer, shape or dtype, one given twice
under peft's two spellings, a module with one half only, no tensors at all); a rank's shard applies
exactly ``scale * B @ A`` to the rows the layout puts that weight at and nothing to the other
targets' rows of a fused layer (B block-diagonal), so the TP ranks' shards together are the full
delta; the client's refusals that come before any worker is asked (`lora_calls`).

H63's mutation pass: each check below was taken out (or its bound moved by one) and a test here
failed; before, no test held it (the engine's tests load adapters whose refusals are a few of these).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from fsdp_sync.engines import WeightUpdateError
from fsdp_sync.engines.reference import lora
from fsdp_sync.engines.reference.lora_calls import LoRACalls
from fsdp_sync.models import load_config
from fsdp_sync.weights.layout import layout_for

pytestmark = pytest.mark.timeout(60)

CFG = {"peft_type": "LORA", "r": 4, "lora_alpha": 12, "target_modules": ["q_proj", "v_proj", "down_proj"],
       "bias": "none"}
PFX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def layouts():
    cfg = load_config("tiny")
    return {tp: layout_for(cfg, tp) for tp in (1, 2)}


def adapter(layout, r=4, targets=("q_proj", "v_proj", "down_proj"), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in layout.hf_names():
        parts = name.split(".")
        if len(parts) > 3 and parts[-2] in targets and name.endswith(".weight"):
            o, i = layout.full_shape(name)
            base = f"base_model.model.{name[:-len('.weight')]}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, i, generator=g)
            out[f"{base}.lora_B.weight"] = torch.randn(o, r, generator=g)
    return out


def test_a_config_it_cannot_serve_is_refused_naming_key_and_value():
    for change, needle in [
        ({"r": 0}, "config_dict r must be an int >= 1, got 0"),
        ({"r": True}, "config_dict r must be an int >= 1, got True"),
        ({"r": 4.0}, "config_dict r must be an int >= 1, got 4.0"),
        ({"lora_alpha": float("nan")}, "config_dict lora_alpha must be a finite number, got nan"),
        ({"lora_alpha": True}, "config_dict lora_alpha must be a finite number, got True"),
        ({"peft_type": "IA3"}, "config_dict peft_type must be 'LORA', got 'IA3'"),
        ({"bias": "all"}, "config_dict bias='all' is not served"),
        ({"bias": "lora_only"}, "config_dict bias='lora_only' is not served"),
        ({"target_modules": "q_proj"}, "config_dict target_modules must be a list of module names"),
        ({"target_modules": []}, "config_dict target_modules must be a list of module names"),
        ({"target_modules": ["q_proj", "lm_head"]}, "config_dict target_modules ['lm_head'] cannot take a LoRA adapter here"),
    ]:
        with pytest.raises(ValueError) as info:
            lora.LoRAConfig.from_dict(dict(CFG, **change))
        assert needle in str(info.value), str(info.value)


def test_a_config_it_serves():
    c = lora.LoRAConfig.from_dict(dict(CFG, r=1))
    assert (c.r, c.lora_alpha, c.scale, c.target_modules) == (1, 12.0, 12.0, ("q_proj", "v_proj", "down_proj"))
    assert lora.LoRAConfig.from_dict(dict(CFG, target_modules="all-linear")).target_modules == lora.TARGETS
    assert lora.LoRAConfig.from_dict(dict(CFG, target_modules=["model.layers.0.mlp.up_proj", "k_proj"],
                                          bias=None)).target_modules == ("k_proj", "up_proj")
    assert lora.LoRAConfig.from_dict({"r": 8, "target_modules": ["q_proj"]}).scale == 1.0   # peft's alpha 8


def checked(layout, tensors, cfg=CFG):
    return lora.check_adapter(layout, lora.LoRAConfig.from_dict(cfg), tensors.items())


def test_tensors_that_are_not_the_adapters_are_refused_naming_them(layouts):
    layout = layouts[1]
    t = adapter(layout)
    assert len(checked(layout, t)) == 3 * layout.spec.num_layers
    q_a, q_b = f"{PFX}.0.self_attn.q_proj.lora_A.weight", f"{PFX}.0.self_attn.q_proj.lora_B.weight"
    o, i = layout.full_shape("model.layers.0.self_attn.q_proj.weight")
    cases = [
        (dict(t, **{q_a: t[q_a].T.contiguous()}), f"expected shape (4, {i}) (r=4, base weight "
                                                  f"'model.layers.0.self_attn.q_proj.weight' ({o}, {i})), got ({i}, 4)"),
        (dict(t, **{q_b: t[q_b][:, :3]}), f"expected shape ({o}, 4)"),
        (dict(t, **{q_a: t[q_a].to(torch.int64)}), "expected a floating-point tensor, got torch.int64"),
        ({k: v for k, v in t.items() if k != q_b}, "'model.layers.0.self_attn.q_proj.weight': the adapter has no lora_B"),
        ({k: v for k, v in t.items() if k != q_a}, "'model.layers.0.self_attn.q_proj.weight': the adapter has no lora_A"),
        (dict(t, **{q_a.removeprefix("base_model.model."): t[q_a]}), "lora_A of 'model.layers.0.self_attn.q_proj.weight' appears twice"),
        (dict(t, **{f"{PFX}.0.self_attn.k_proj.lora_A.weight": t[q_a]}), "module 'k_proj' is not in the adapter's target_modules"),
        (dict(t, **{f"{PFX}.{layout.spec.num_layers}.self_attn.q_proj.lora_A.weight": t[q_a]}),
         f"the base model has no 'model.layers.{layout.spec.num_layers}.self_attn.q_proj.weight'"),
        (dict(t, **{f"{PFX}.0.self_attn.q_proj.lora_C.weight": t[q_a]}), "is not a LoRA tensor name of a decoder layer"),
        ({}, "the adapter holds no tensors"),
    ]
    for tensors, needle in cases:
        with pytest.raises(ValueError) as info:
            checked(layout, tensors)
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize("tp", [1, 2])
def test_each_ranks_shard_applies_exactly_its_rows_of_scale_b_a(layouts, tp):
    """Per engine linear, ``apply`` adds ``h @ delta.T`` with the shard's delta ``[out_local,
    in_local]``: at each piece's rows and columns ``scale * (B @ A)[src]``, zero at every other row
    (another target's in a fused layer, or a target the adapter does not hold); row-parallel ranks'
    deltas are partial sums that add up to the whole (their A is split by input column)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny float64 products: threads only add their hand-offs (seconds when loaded)
    try:
        _check_shards(layouts[tp], tp)
    finally:
        torch.set_num_threads(threads)


def _check_shards(layout, tp):
    t = adapter(layout, seed=tp)
    cfg = lora.LoRAConfig.from_dict(CFG)
    pairs = lora.check_adapter(layout, cfg, t.items())
    shapes = layout.engine_shapes()
    g = torch.Generator().manual_seed(5)
    for rank in range(tp):
        shard = lora.shard_adapter(layout, rank, "a", cfg, pairs, torch.float64)
        assert sorted(shard.mats) == sorted({pl.engine for w in pairs for pl in layout.placements(w, rank)})
        for engine, lst in shard.pieces.items():
            out_local, in_local = shapes[engine]
            want = torch.zeros(out_local, in_local, dtype=torch.float64)
            for weight, _, src, dst in lst:
                A, B = (x.double() for x in pairs[weight])
                want[dst[0]] += cfg.scale * (B @ A)[src]
            h = torch.randn(3, in_local, generator=g, dtype=torch.float64)
            y = torch.randn(3, out_local, generator=g, dtype=torch.float64)
            got = shard.apply(engine, h, y, None)
            assert float((got - y - h @ want.T).abs().max()) <= 1e-9, engine
            # rows given: only those rows change, by the same amounts
            part = shard.apply(engine, h, y, torch.tensor([0, 2]))
            assert torch.equal(part[1], y[1]) and torch.equal(part[[0, 2]], got[[0, 2]]), engine
            assert torch.equal(shard.apply(engine, h, y, torch.tensor([], dtype=torch.long)), y)
        assert torch.equal(shard.apply("lm_head", h, y, None), y)
        # read back: this rank's pieces are the adapter's own values
        for name, lst in lora.unshard_pieces(shard).items():
            full = t[f"base_model.model.{name}"].double()
            for idx, piece in lst:
                assert torch.equal(piece, full[idx]), name


class _Client(LoRACalls):
    """The client side of `LoRACalls` up to the point where the workers are asked: `_round` fails."""

    tp_size = 1

    def __init__(self, layout, **kw):
        self.layout = layout
        self._lock = threading.Lock()
        self._sched = type("S", (), {"exclusive": staticmethod(contextlib.nullcontext),
                                     "rows_using": staticmethod(lambda name: 0)})()
        self.rounds = []
        for k, v in kw.items():
            setattr(self, k, v)

    def _check_usable(self):
        pass

    def _round(self, cmd, *a, **kw):
        self.rounds.append(cmd)
        raise AssertionError(f"no worker may be asked ({cmd})")


def test_client_refusals_come_before_any_worker_and_name_what(layouts, tmp_path):
    layout = layouts[1]
    t = adapter(layout)
    c = _Client(layout, max_lora_rank=4, lora_target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))

    def refused(needle, *args, **kw):
        with pytest.raises(WeightUpdateError) as info:
            c.load_lora_adapter_from_tensors(*args, **kw)
        assert needle in str(info.value), str(info.value)

    refused("lora_name must be a non-empty string", "", t, CFG)
    refused("load_format='safetensors' / added_tokens_config are not served", "a", t, CFG, load_format="safetensors")
    refused("added_tokens_config are not served", "a", t, CFG, added_tokens_config={"x": 1})
    refused("one payload (bytes or base64 text) per TP rank (1)", "a", [b"x", b"y"], CFG, load_format="flattened_bucket")
    refused("its rank r=5 exceeds the engine's max_lora_rank 4", "a", adapter(layout, r=5), dict(CFG, r=5))
    refused("its target_modules ['o_proj'] are not in the engine's lora_target_modules",
            "a", adapter(layout, targets=("o_proj",)), dict(CFG, target_modules=["o_proj"]))
    refused("config_dict r must be an int >= 1", "a", t, dict(CFG, r=0))
    c.__dict__["_lora_loaded"] = {"a": {"r": 4}}
    refused("an adapter named 'a' is already loaded; unload_lora_adapter('a') first", "a", t, CFG)
    with pytest.raises(WeightUpdateError, match="an adapter named 'a' is already loaded"):
        c.load_lora_adapter("a", str(tmp_path / "nothing here"))
    with pytest.raises(WeightUpdateError, match=r"adapter_config.json does not exist \(a peft adapter directory"):
        c.load_lora_adapter("b", str(tmp_path))
    with pytest.raises(WeightUpdateError, match=r"unload_lora_adapter\('b'\): no such adapter is loaded \(loaded: \['a'\]\)"):
        c.unload_lora_adapter("b")
    assert c.rounds == [] and list(c.lora_adapters) == ["a"]
    # lora_refusal says the same without loading, from the tensors' metadata alone
    metas = [(n, v.dtype, tuple(v.shape)) for n, v in t.items()]
    assert c.lora_refusal(CFG, metas) is None
    assert "exceeds the engine's max_lora_rank 4" in c.lora_refusal(dict(CFG, r=8))
    bad = metas[:1] + [(metas[1][0], torch.float32, (1, 1))] + metas[2:]
    assert "expected shape" in c.lora_refusal(CFG, bad)
    c.lora_target_modules = ("all",)
    assert c.lora_refusal(dict(CFG, target_modules=["o_proj"])) is None


def test_an_adapter_loaded_from_a_directory_records_its_path(layouts, tmp_path):
    """`load_lora_adapter` reads the peft directory's two files, loads the tensors as they are
    saved, and records the directory as the adapter's ``path`` (SGLang's ``loaded_adapters``
    and the card root serve answers with); an adapter pushed as tensors has none."""
    import json

    from safetensors.torch import save_file

    layout = layouts[1]
    t = adapter(layout)
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CFG))
    got = {}

    class C(_Client):
        def load_lora_adapter_from_tensors(self, name, tensors, config, *a, **kw):
            got.update(name=name, tensors=tensors, config=config)
            self.__dict__.setdefault("_lora_loaded", {})[name] = {"r": config["r"]}
            return {"success": True}

    c = C(layout)
    assert c.load_lora_adapter("d", tmp_path) == {"success": True}
    assert got["name"] == "d" and got["config"] == CFG
    assert sorted(got["tensors"]) == sorted(t) and all(torch.equal(got["tensors"][k], v) for k, v in t.items())
    assert c.lora_adapters["d"] == {"r": 4, "path": str(tmp_path)}
