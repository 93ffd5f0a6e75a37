"""H85: verl's LoRA-as-adapter run into a ``base_url`` SGLang server whose LoRA limits refuse the
adapter (here ``--max-lora-rank 2``, the adapter's r=4). The engine's own refusal
(`SGLangEngine.lora_refusal`) was asked only at the adapter's load, after the base had been sent:
the server took the base (and its weights changed under the requests it served) and then refused
every adapter sync. Now infer-TP rank 0 asks it before the base (`verl_lora.engine_refusal`, in
the send loop's agreed check before any byte moves), at the first base sync and at a retry's
(verl sends the base again when the adapter's sync failed: the adapter's ``_config_checked`` is
then True and, with ``verify=off``, no other check runs before it): the server keeps its weights
and version, and the error names the rank, the limit and the flag to set.
"""

from __future__ import annotations

import asyncio
import os
import sys
import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_a_lora_base_goes_nowhere_the_engine_would_refuse_its_adapter(one_rank):
    import fake_sglang
    import torch
    import verl_ranks
    from test_verl_adapter_checks import rollout_config

    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError

    model_config = types.SimpleNamespace(hf_config=load_config("tiny"), lora_rank=4, lora={},
                                         target_modules="all-linear")
    with fake_sglang.FakeSGLangServer(tp_size=1) as server:
        e = server.engine
        info = e.get_server_info      # launched --enable-lora --max-lora-rank 2
        e.get_server_info = lambda: {**info(), "enable_lora": True, "max_lora_rank": 2,
                                     "lora_paths": None}
        old = {"model.norm.weight": torch.full((8,), 3.0)}
        e.weights.update((n, t.clone()) for n, t in old.items())
        e.weight_version = "7"
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.verify=off"])
        cfg["tensor_model_parallel_size"] = 1
        adapter, _ = verl_ranks._adapter(0, 1, cfg, model_config=model_config)
        for retry in (False, True):
            adapter._config_checked = retry     # a retry: the served config already matched
            with pytest.raises(SyncError) as raised:
                asyncio.run(adapter.update_weights(verl_ranks._peft_stream(0, base=True),
                                                   global_steps=8, peft_config=verl_ranks.PEFT_CONFIG,
                                                   base_sync_done=False))
            text = str(raised.value)
            assert "r=4 exceeds" in text and "--max-lora-rank 2" in text, text
            assert "restart SGLang with --max-lora-rank >= 4" in text, text
            assert "base weights were not sent" in text, text
            sent = [n for n in e.names() if n.startswith(("update_weights", "begin_weight_update",
                                                          "load_lora", "unload_lora"))]
            assert sent == [], sent
            assert sorted(e.weights) == sorted(old) and all(e.weights[n].equal(t) for n, t in old.items())
            assert e.weight_version == "7"
            assert server.hits.get("/update_weight_version") is None


def test_a_lora_base_with_verify_into_sglang_goes_nowhere(one_rank):
    """``verify=full`` into SGLang itself: its base could be checked, its adapter cannot (no
    ``/fsdp_sync/lora_checksums``): refused before the base, naming the setting (before, the base
    went, then every adapter sync loaded the adapter and failed)."""
    import fake_sglang
    import verl_ranks
    from test_verl_adapter_checks import rollout_config

    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError

    model_config = types.SimpleNamespace(hf_config=load_config("tiny"), lora_rank=4, lora={},
                                         target_modules="all-linear")
    with fake_sglang.FakeSGLangServer(tp_size=1) as server:
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.verify=full"])
        cfg["tensor_model_parallel_size"] = 1
        adapter, _ = verl_ranks._adapter(0, 1, cfg, model_config=model_config)
        with pytest.raises(SyncError, match=r"verify='full'.*cannot hand a LoRA adapter back.*"
                                            r"set rollout.custom.fsdp_sync.verify=off"):
            asyncio.run(adapter.update_weights(verl_ranks._peft_stream(0, base=True), global_steps=1,
                                               peft_config=verl_ranks.PEFT_CONFIG, base_sync_done=False))
        sent = [n for n in server.engine.names() if n.startswith(("update_weights", "begin_weight"))]
        assert sent == [] and server.engine.weights == {}, sent
