"""H85: verl's adapter-only LoRA sync (`verl_lora.sync_adapter`) with ``verify`` on into SGLang
itself, which cannot hand an adapter back (no ``/fsdp_sync/lora_checksums``, fsdp-sync serve's
route). Before, infer-TP rank 0 loaded the adapter and then failed the sync at the read-back, at
every step (the server serving the new, unverified adapter while verl's step failed); now it is
refused before anything is unloaded or loaded, naming ``rollout.custom.fsdp_sync.verify`` and what
to set (the verl adapter asks the same before the base: tests/verl_tier/test_h85_*)."""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.integrations import verl_lora
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(60)

ADAPTER = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 16)),
           ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(16, 4))]
PEFT = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_verify_into_sglang_is_refused_before_the_adapter_is_loaded():
    with fake.FakeSGLangServer(tp_size=1) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, retry_backoff_s=0.01)
        with pytest.raises(SyncError, match=r"verify='full'.*cannot hand a LoRA adapter back.*"
                                            r"set rollout.custom.fsdp_sync.verify=off"):
            verl_lora.sync_adapter(eng, ADAPTER, PEFT, None, verify="full")
        assert "/load_lora_adapter_from_tensors" not in srv.hits and not srv.engine.loras
        assert verl_lora.engine_refusal(eng, PEFT, verify="off") is None    # off: not refused
