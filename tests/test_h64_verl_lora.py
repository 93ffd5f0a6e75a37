"""H64: verl's LoRA integration (`fsdp_sync.integrations.verl_lora`) read as verl 0.9.1 reads its
config. verl's ``model.lora`` is an untyped dict, and verl decides merged vs adapter on the
truth of ``lora.merge`` (``lora_served_as_adapter``: ``not model_config.lora.get("merge", False)``;
its worker's ``peft_merge`` the same): ``lora.merge=1`` makes verl merge and send full weights
without a ``peft_config``. Read otherwise here, the adapter would refuse every sync of such a run
as "synced a LoRA run without its adapter". verl's own function beside ours: tests/verl_tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdp_sync.integrations import verl_lora


def model(**kw):
    return SimpleNamespace(**{"lora_rank": 8, "lora": {}, "target_modules": "all-linear", **kw})


@pytest.mark.parametrize("merge, adapter", [(True, False), (1, False), ("true", False), ("yes", False),
                                            (False, True), (0, True), (None, True), ("", True)])
def test_lora_merge_is_read_by_its_truth_as_verl_reads_it(merge, adapter):
    assert verl_lora.served_as_adapter(model(lora={"merge": merge})) is adapter
    # a merged run is no adapter run: nothing refused for it, whatever the rollout's load format
    rollout = SimpleNamespace(name="fsdp_sync_ref", load_format="auto", quantization=None)
    assert (verl_lora.refusal(rollout, model(lora={"merge": merge}), "fsdp_sync_ref") is None) is not adapter
