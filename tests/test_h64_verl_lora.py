"""H64: verl's LoRA integration (`fsdp_sync.integrations.verl_lora`) read as verl 0.9.1 reads its
config. verl's ``model.lora`` is an untyped dict, and verl decides merged vs adapter on the
truth of ``lora.merge`` (``lora_served_as_adapter``: ``not model_config.lora.get("merge", False)``;
its worker's ``peft_merge`` the same): ``lora.merge=1`` makes verl merge and send full weights
without a ``peft_config``. Read otherwise here, the adapter would refuse every sync of such a run
as "synced a LoRA run without its adapter". verl's own function beside ours: tests/verl_tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.integrations import verl_lora


def model(**kw):
    return SimpleNamespace(**{"lora_rank": 8, "lora": {}, "target_modules": "all-linear", **kw})


def test_lora_merge_is_read_by_its_truth_as_verl_reads_it():
    rollout = SimpleNamespace(name="fsdp_sync_ref", load_format="auto", quantization=None)
    for merge, adapter in [(True, False), (1, False), ("true", False), ("yes", False),
                           (False, True), (0, True), (None, True), ("", True)]:
        assert verl_lora.served_as_adapter(model(lora={"merge": merge})) is adapter, merge
        # a merged run is no adapter run: nothing refused for it, whatever the rollout's load format
        refused = verl_lora.refusal(rollout, model(lora={"merge": merge}), "fsdp_sync_ref") is not None
        assert refused is adapter, merge


class FakeEngine:
    """What `verl_lora.sync_adapter` calls on infer-TP rank 0's engine, recorded; it holds what it
    was sent, less one ulp of ``spoil`` (a tensor the load got wrong)."""

    def __init__(self, spoil=None):
        self.calls, self.held, self.spoil = [], {}, spoil

    def lora_refusal(self, config, metas):
        return None

    def available_models(self):
        self.calls.append("available_models")
        return {"data": [{"id": n} for n in self.held]}

    def unload_lora_adapter(self, name):
        self.calls.append("unload")
        del self.held[name]

    def load_lora_adapter_from_tensors(self, name, named, config):
        self.calls.append("load")
        held = {n.removeprefix("base_model.model."): t.clone() for n, t in named}
        if self.spoil in held:
            held[self.spoil].view(torch.int32).view(-1)[0] += 1
        self.held[name] = held

    def lora_checksums(self, name):
        from fsdp_sync.verify import tensor_digest

        self.calls.append("lora_checksums")
        return {n: tensor_digest(n, t) for n, t in self.held[name].items()}, "float32"


ADAPTER = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(4, 8)),
           ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(8, 4))]
PEFT = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def test_every_verify_but_off_reads_the_adapter_back_and_a_wrong_tensor_fails_the_sync():
    for verify in ("full", "sample"):
        check_verify(verify)


def check_verify(verify):
    from fsdp_sync.topology import SyncError

    eng = FakeEngine()
    out = verl_lora.sync_adapter(eng, ADAPTER, PEFT, None, verify=verify)
    assert eng.calls == ["available_models", "load", "lora_checksums"], eng.calls
    assert out["verify_tensors"] == 2 and out["r"] == 4 and out["engine_calls"] == 2, out
    spoiled = "model.layers.0.self_attn.q_proj.lora_B.weight"
    with pytest.raises(SyncError, match=f"tensor '{spoiled}' in the engine differs"):
        verl_lora.sync_adapter(FakeEngine(spoil=spoiled), ADAPTER, PEFT, None, verify=verify)
    eng = FakeEngine(spoil=spoiled)
    out = verl_lora.sync_adapter(eng, ADAPTER, PEFT, None, verify="off")   # off: not read back
    assert eng.calls == ["available_models", "load"] and "verify_tensors" not in out, (eng.calls, out)
