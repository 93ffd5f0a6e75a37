"""An adapter shard is written in place into the spare it replaces only where the spare's layout
is the new adapter's in every part (rank, r, target weights, dtype, device): a replacement with
the same r but other target modules, or in another dtype, gets a layout of its own and the engine
serves exactly the new adapter (logits of transformers with it merged, the read-back bit-exact).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference import lora
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights.layout import layout_for

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]
QV = ("q_proj", "v_proj")


def adapter(model, r, targets, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 3 and parts[-2] in targets and p.dim() == 2:
            base = f"base_model.model.{name[:-len('.weight')]}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, p.shape[1], generator=g) * 0.1
            out[f"{base}.lora_B.weight"] = torch.randn(p.shape[0], r, generator=g) * 0.1
    return out, {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets),
                 "bias": "none"}


@torch.no_grad()
def merged_logits(model, tensors, config):
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    for name, a in tensors.items():
        if ".lora_A." in name:
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[base] += config["lora_alpha"] / config["r"] * (b @ a)
    return torch.stack([m(input_ids=torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


def test_a_replacement_with_the_same_r_and_more_targets_is_not_written_into_the_old_layout(tiny):
    """q/v, all linears twice, q/v, all linears, each at r 4: the third load's spare is the
    first's shard (same r, fewer targets): reusing it would leave the other modules' LoRA unserved."""
    all_linear = lora.TARGETS
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2, max_lora_rank=8) as eng:
        eng.update_weights_from_tensor(list(tiny.state_dict().items()))
        seen = []
        for i, (targets, seed) in enumerate([(QV, 1), (all_linear, 2), (all_linear, 3), (QV, 4), (all_linear, 5)]):
            t, c = adapter(tiny, 4, targets, seed)
            res = eng.load_lora_adapter_from_tensors("a", t, c, replace=True)
            seen.append(res["in_place"])
            got = eng.forward_logits(PROMPTS, lora_path="a")
            assert (got - merged_logits(tiny, t, c)).abs().max() < 1e-5, (i, targets)
            back = eng.lora_tensors("a")
            assert sorted(back) == sorted(k.removeprefix("base_model.model.") for k in t), (i, targets)
            assert all(torch.equal(back[k.removeprefix("base_model.model.")], v) for k, v in t.items())
        # the third's spare (the first's q/v shard) and the fourth's (the second's all-linear
        # shard) each have other targets than the load: neither is written in place; the fifth's
        # (the third's all-linear shard) is its layout: written in place on both TP ranks
        assert seen == [0, 0, 0, 0, 2], seen
        eng.unload_lora_adapter("a")


@pytest.mark.parametrize("change", ["dtype", "targets"])
def test_shard_adapter_reuses_a_spare_only_of_the_same_dtype_and_targets(tiny, change):
    """`shard_adapter` directly: a float32 spare is not reused for a bfloat16 shard, a q/v spare
    not for an all-linear one of the same r; the shard holds the new adapter's modules in its
    dtype, each piece equal to the adapter's (cast)."""
    layout = layout_for(load_config("tiny"), 1)
    t1, c1 = adapter(tiny, 4, QV if change == "targets" else lora.TARGETS, 1)
    t2, c2 = adapter(tiny, 4, lora.TARGETS, 2)
    dt2 = torch.bfloat16 if change == "dtype" else torch.float32
    cfg1, cfg2 = lora.LoRAConfig.from_dict(c1), lora.LoRAConfig.from_dict(c2)
    old = lora.shard_adapter(layout, 0, "a", cfg1, lora.check_adapter(layout, cfg1, t1.items()), torch.float32)
    pairs = lora.check_adapter(layout, cfg2, t2.items())
    new = lora.shard_adapter(layout, 0, "a", cfg2, pairs, dt2, reuse=old)
    fresh = lora.shard_adapter(layout, 0, "a", cfg2, pairs, dt2)
    assert new.mats is not old.mats
    assert sorted(new.mats) == sorted(fresh.mats)
    for name, (a, b) in fresh.mats.items():
        assert new.mats[name][0].dtype == dt2 and new.mats[name][1].dtype == dt2, name
        assert torch.equal(new.mats[name][0], a) and torch.equal(new.mats[name][1], b), name
    # and the same layout is reused (in place), written with the new adapter
    again = lora.shard_adapter(layout, 0, "a", cfg2, pairs, dt2, reuse=fresh)
    assert again.mats is fresh.mats
