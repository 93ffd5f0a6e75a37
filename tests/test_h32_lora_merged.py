"""An adapter that peft merged into the base weights (``peft_model.merge_adapter()``: each LoRA
layer's base weight holds ``W + lora_alpha / r * B @ A``, its ``merged_adapters`` names the
adapter, and its forward skips the adapter) is refused under ``SyncConfig.lora="adapter"`` before
anything is sent, naming the adapter and the module. Before, the merged base went to the engine
and the adapter on top of it: the engine served the adapter twice (logits 0.45 from the trainer's
on the tiny model) and ``verify="full"`` passed (base and adapter each equal what was sent).
"""

from __future__ import annotations

import pytest
import torch

from test_lora_sync import PROMPTS, _Adapters, _peft_adapters, _sync_into

pytestmark = pytest.mark.timeout(120)


def _merge(pm, name="default"):
    """peft's ``merge_adapter``: the adapter added into each base weight, named merged, skipped."""
    with torch.no_grad():
        for m in pm.modules():
            if isinstance(m, _Adapters):
                m.base_layer.weight += m.scaling[name] * (m.lora_B[name].weight @ m.lora_A[name].weight)
                m.merged_adapters = [name]
                m.active = []
    return pm


def test_a_merged_adapter_is_refused_before_the_base_is_sent(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.lora_sync import refusal
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        sync = _sync_into(eng, tmp_path)
        diff, _ = sync(_peft_adapters({"default": (4, 8)}, ["default"]))
        assert diff < 1e-5
        base = eng.forward_logits(PROMPTS)
        with pytest.raises(SyncError, match=r"the adapter 'default' is merged into the base weights of "
                                            r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj' "
                                            r"and 13 other module\(s\) \(peft's merge_adapter\)"):
            sync(_merge(_peft_adapters({"default": (4, 8)}, ["default"], seed=5)))
        assert torch.equal(eng.forward_logits(PROMPTS), base) and "L" not in eng.lora_adapters  # nothing sent
    # another adapter merged is not this one's: the engine serves base (with it) + this one exactly
    two = _peft_adapters({"default": (4, 8), "other": (4, 8)}, ["default"])
    for m in two.modules():
        if isinstance(m, _Adapters):
            m.merged_adapters = ["other"]
    assert refusal(two, None, base_sent=True) is None
