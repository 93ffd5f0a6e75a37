"""H80: verl's adapter-only LoRA sync (``base_sync_done=True``) when infer-TP rank 0 could not reach
its SGLang server before the sync.

verl 0.9.1 reaches it: on ``rollout.name=fsdp_sync_ref`` verl calls ``resume(tags=["weights"])``
before every sync (its ``sleep_level != 1`` skip is for ``rollout.name=sglang`` only), and a
server that died since the last step fails it; on ``rollout.name=sglang`` with a non-dummy
``load_format`` verl's first sync is already adapter-only, and a server actor that is gone fails
rank 0's lookup. Rank 0 of a group of several ranks then keeps the error and syncs with
`Unreached` as its engine (`integrations.verl.unreached`). The base's sync raised the kept error;
the adapter's said ``AttributeError: available_models: ...`` on every rank. Here the kept error is
set on a one-rank adapter by hand (a group of one raises at once instead), so the adapter's own
update_weights runs in this process.
"""

from __future__ import annotations

import asyncio
import os
import sys
import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_adapter_only_sync_with_rank0_unreached_names_the_server_not_an_attribute(one_rank):
    import verl_ranks
    from test_verl_adapter_checks import rollout_config

    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError

    cfg = rollout_config()
    cfg["tensor_model_parallel_size"] = 1
    model_config = types.SimpleNamespace(hf_config=load_config("tiny"), lora_rank=4, lora={},
                                         target_modules="all-linear")
    adapter, _ = verl_ranks._adapter(0, 1, cfg, model_config=model_config)
    why = ("fsdp_sync's verl adapter on infer-TP rank 0 (global rank 0): resume_memory_occupation("
           "tags=['weights']) of verl's SGLang server failed: ConnectionError: refused")
    adapter._unreached = why
    with pytest.raises(SyncError) as info:
        asyncio.run(adapter.update_weights(verl_ranks._peft_stream(1, base=False), global_steps=1,
                                           peft_config=verl_ranks.PEFT_CONFIG, base_sync_done=True))
    text = str(info.value)
    assert f"EngineUnreached: {why}" in text, text
    assert "AttributeError" not in text and "available_models" not in text, text
    assert adapter._unreached is None       # told once: the next sync looks again
