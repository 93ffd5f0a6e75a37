"""LoRA adapters in the reference engine against transformers with the adapter merged in
(``W + lora_alpha / r * B @ A``, what peft's ``merge_and_unload`` computes; peft itself is not a
dependency here: `tests/verl_tier/test_peft_reference.py` checks against it): logits within 1e-5 in float32 and equal greedy tokens at TP 1 and 2, a batch mixing
adapter and base rows, refusals that change nothing, unload, read-back.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine, WeightUpdateError
from fsdp_sync.engines.reference.lora import TARGETS
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7], [300, 301, 302, 5, 6, 7, 8]]


def make_adapter(model, r=4, alpha=8, targets=TARGETS, seed=0, prefix="base_model.model."):
    """peft-named full adapter tensors for ``targets`` of every layer (B nonzero, unlike peft's init)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 3 and parts[-2] in targets and p.dim() == 2:
            base = name[:-len(".weight")]
            out[f"{prefix}{base}.lora_A.weight"] = torch.randn(r, p.shape[1], generator=g) * 0.1
            out[f"{prefix}{base}.lora_B.weight"] = torch.randn(p.shape[0], r, generator=g) * 0.1
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "use_dora": False, "use_rslora": False}
    return out, config


def merged(model, tensors, config):
    """``model`` with the adapter merged in (peft's merge: W += lora_alpha / r * B @ A)."""
    m = copy.deepcopy(model)
    scale = config["lora_alpha"] / config["r"]
    params = dict(m.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[base] += scale * (b @ a)
    return m


@torch.no_grad()
def hf_logits(model, prompts):
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts])


@torch.no_grad()
def hf_generate(model, prompts, n):
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def eng(request, tiny):
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=request.param, max_lora_rank=8) as e:
        e.update_weights_from_tensor(list(tiny.state_dict().items()))
        yield e


def test_adapter_logits_and_greedy_tokens_match_merged_transformers(eng, tiny):
    tensors, config = make_adapter(tiny)
    ref = merged(tiny, tensors, config)
    base_before = eng.forward_logits(PROMPTS)
    eng.load_lora_adapter_from_tensors("a", list(tensors.items()), config)
    try:
        got = eng.forward_logits(PROMPTS, lora_path="a")
        want = hf_logits(ref, PROMPTS)
        assert (got - want).abs().max() < 1e-5
        assert (got - hf_logits(tiny, PROMPTS)).abs().max() > 1e-2   # the adapter does change them
        assert eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, lora_path="a") == hf_generate(ref, PROMPTS, 8)
        # a batch mixing adapter and base rows: each row as if alone
        res = eng.generate_requests(PROMPTS, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                                    lora_path=["a", None, "a", None])
        base_tokens = hf_generate(tiny, PROMPTS, 6)
        lora_tokens = hf_generate(ref, PROMPTS, 6)
        assert [r["output_ids"] for r in res] == [lora_tokens[0], base_tokens[1], lora_tokens[2], base_tokens[3]]
        # the base still serves unchanged without lora_path
        assert torch.equal(eng.forward_logits(PROMPTS), base_before)
        # read back: bit-exact the tensors sent
        back = eng.lora_tensors("a")
        assert set(back) == {n.removeprefix("base_model.model.") for n in tensors}
        assert all(torch.equal(back[n.removeprefix("base_model.model.")], t) for n, t in tensors.items())
    finally:
        eng.unload_lora_adapter("a")
    assert eng.lora_adapters == {}
    with pytest.raises(ValueError, match="not a loaded LoRA adapter"):
        eng.forward_logits(PROMPTS, lora_path="a")


def test_partial_targets_and_replace(eng, tiny):
    """An adapter on q/v only (peft's default), then replaced by an all-linear one of another seed."""
    t1, c1 = make_adapter(tiny, r=2, alpha=16, targets=("q_proj", "v_proj"), prefix="")
    t2, c2 = make_adapter(tiny, r=8, alpha=8, seed=3)
    eng.load_lora_adapter_from_tensors("a", t1, c1)
    try:
        assert (eng.forward_logits(PROMPTS, lora_path="a") - hf_logits(merged(tiny, t1, c1), PROMPTS)).abs().max() < 1e-5
        with pytest.raises(WeightUpdateError, match="already loaded"):
            eng.load_lora_adapter_from_tensors("a", t2, c2)
        eng.load_lora_adapter_from_tensors("a", t2, c2, replace=True)
        assert (eng.forward_logits(PROMPTS, lora_path="a") - hf_logits(merged(tiny, t2, c2), PROMPTS)).abs().max() < 1e-5
        assert eng.lora_adapters["a"]["r"] == 8
    finally:
        eng.unload_lora_adapter("a")


def test_replacing_reuses_the_old_shard_only_where_its_layout_is_the_same(eng, tiny):
    """Each replace stages into the shard the previous one replaced where r, targets and dtype
    are the same (written in place, B's off-block zeros kept), else into new memory: a sequence
    that changes targets and r back and forth serves every adapter exactly (logits of the merged
    model; the read-back alone would not see a stale entry in B's zeros). The last loads come as
    flattened-bucket payloads of one kept buffer (what `lora_sync` sends): the workers keep their
    check of it while buffer, metadata and config stay the same, and read the new bytes."""
    from fsdp_sync.weights import handles
    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets
    from fsdp_sync.wire import flattened_bucket

    qv = ("q_proj", "v_proj", "down_proj")
    # (r, targets, seed, as payloads of the kept buffer); alpha 2r: one config per (r, targets)
    steps = [(4, TARGETS, 1, False), (4, qv, 2, False), (4, TARGETS, 3, False), (2, TARGETS, 4, False),
             (2, TARGETS, 5, True), (2, TARGETS, 6, True), (2, TARGETS, 7, False), (4, qv, 8, True)]
    tp = eng.tp_size
    seen, kept = [], {}
    try:
        for i, (r, targets, seed, bucketed) in enumerate(steps):
            t, c = make_adapter(tiny, r=r, alpha=2 * r, targets=targets, seed=seed)
            if not bucketed:
                res = eng.load_lora_adapter_from_tensors("a", t, c, replace=True)
            else:
                metas = [TensorMeta.of(n, v) for n, v in t.items()]
                bkt = plan_buckets(metas, sum(m.nbytes for m in metas) + 64 * (len(metas) + 1))[0]
                if kept.get("nbytes") != bkt.nbytes:
                    kept = {"nbytes": bkt.nbytes, "flat": handles.empty_shared(bkt.nbytes)}
                flatten(bkt, list(t.values()), out=kept["flat"])
                with handles.make_payloads(flattened_bucket(kept["flat"], bkt), tp) as ps:
                    res = eng.load_lora_adapter_from_tensors("a", list(ps.payloads), c,
                                                             load_format="flattened_bucket", replace=True)
            seen.append((res["in_place"], res["kept_check"]))
            want = hf_logits(merged(tiny, t, c), PROMPTS)
            assert (eng.forward_logits(PROMPTS, lora_path="a") - want).abs().max() < 1e-5, (i, r, targets)
            got = eng.lora_tensors("a")
            assert sorted(got) == sorted(k.removeprefix("base_model.model.") for k in t)
            assert all(torch.equal(got[k.removeprefix("base_model.model.")], v) for k, v in t.items())
        # in place: where the spare (the shard the previous load replaced, two steps back) has this
        # layout (steps 2, 5, 6); the check kept: for the second payload of the same buffer with
        # the same config (step 5)
        assert seen == [(0, 0), (0, 0), (tp, 0), (0, 0), (0, 0), (tp, tp), (tp, 0), (0, 0)], seen
        with pytest.raises(WeightUpdateError, match=r"one payload \(bytes or base64 text\) per TP rank"):
            eng.load_lora_adapter_from_tensors("a", [b"x"] * (tp + 1), c, load_format="flattened_bucket",
                                               replace=True)
        assert (eng.forward_logits(PROMPTS, lora_path="a") - want).abs().max() < 1e-5
    finally:
        eng.unload_lora_adapter("a")


def test_refused_adapters_change_nothing(eng, tiny):
    t, c = make_adapter(tiny)
    eng.load_lora_adapter_from_tensors("a", t, c)
    try:
        before = eng.forward_logits(PROMPTS, lora_path="a")
        name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
        bad_shape = dict(t, **{name: torch.zeros(3, 4)})
        with pytest.raises(WeightUpdateError, match=r"down_proj.lora_B.weight.*expected shape \(64, 4\)"):
            eng.load_lora_adapter_from_tensors("a", bad_shape, c, replace=True)
        missing = {k: v for k, v in t.items() if k != name}
        with pytest.raises(WeightUpdateError, match="no lora_B"):
            eng.load_lora_adapter_from_tensors("a", missing, c, replace=True)
        with pytest.raises(WeightUpdateError, match="not in the adapter's target_modules"):
            eng.load_lora_adapter_from_tensors("a", t, dict(c, target_modules=["q_proj"]), replace=True)
        big, bc = make_adapter(tiny, r=16)
        with pytest.raises(WeightUpdateError, match="max_lora_rank 8"):
            eng.load_lora_adapter_from_tensors("a", big, bc, replace=True)
        with pytest.raises(WeightUpdateError, match="use_dora"):
            eng.load_lora_adapter_from_tensors("b", t, dict(c, use_dora=True))
        assert torch.equal(eng.forward_logits(PROMPTS, lora_path="a"), before)
        assert list(eng.lora_adapters) == ["a"]
    finally:
        eng.unload_lora_adapter("a")
    with pytest.raises(WeightUpdateError, match="no such adapter"):
        eng.unload_lora_adapter("a")


def test_load_from_peft_directory(tmp_path, tiny):
    from safetensors.torch import save_file
    import json

    t, c = make_adapter(tiny, targets=("q_proj", "k_proj", "o_proj", "up_proj"))
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(c))
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=1) as e:
        e.update_weights_from_tensor(list(tiny.state_dict().items()))
        e.load_lora_adapter("disk", str(tmp_path))
        assert (e.forward_logits(PROMPTS, lora_path="disk") - hf_logits(merged(tiny, t, c), PROMPTS)).abs().max() < 1e-5


def test_unload_refused_while_paused_requests_use_it(eng, tiny):
    import threading
    import time

    t, c = make_adapter(tiny)
    eng.load_lora_adapter_from_tensors("a", t, c)
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=eng.generate(PROMPTS[:1], max_new_tokens=200, ignore_eos=True,
                                                                   lora_path="a")))
    th.start()
    try:
        deadline = time.monotonic() + 30
        while eng.scheduler_stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        eng.pause_generation(mode="in_place")
        try:
            with pytest.raises(WeightUpdateError, match="1 requests waiting or paused use it"):
                eng.unload_lora_adapter("a")
        finally:
            eng.continue_generation()
    finally:
        th.join(120)
    assert out["r"] == hf_generate(merged(tiny, t, c), PROMPTS[:1], 200)
    eng.unload_lora_adapter("a")
