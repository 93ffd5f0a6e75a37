"""SGLang answers LoRA calls with ``LoRAUpdateOutput`` (``success``, ``error_message``), not the
``message`` other calls carry: a refusal answered with 2xx (a proxy in front of SGLang, or
another server) must still raise with SGLang's message, not "(no message)"."""

from __future__ import annotations

import json

import pytest
import torch

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine, SGLangUpdateError

pytestmark = pytest.mark.timeout(60)

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}


def test_a_lora_refusal_in_a_2xx_answer_raises_with_sglangs_error_message():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        real = srv._load_lora

        def load_200(body):                  # SGLang's answer (payloads opened), status 200
            _, ctype, text = real(body)
            return 200, ctype, text

        srv._load_lora = load_200
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        tensors = [("x.lora_A.weight", torch.ones(4, 4))]
        a.load_lora_adapter_from_tensors("L", tensors, CONFIG)
        with pytest.raises(SGLangUpdateError, match="L because it is already loaded"):
            a.load_lora_adapter_from_tensors("L", tensors, CONFIG)
        a.unload_lora_adapter("L")
        srv.script["/unload_lora_adapter"] = [(200, json.dumps(
            {"success": False, "error_message": "LoRA adapter L is not loaded", "loaded_adapters": {}}))]
        with pytest.raises(SGLangUpdateError, match="LoRA adapter L is not loaded"):
            a.unload_lora_adapter("L")


def test_a_server_without_the_lora_route_opened_nothing_and_gets_its_segment_back():
    """404 (a router's URL, an older server): nothing was opened, so the adapter's shared segment
    is given back at once (the tests' leftovers check fails on a segment left behind)."""
    with fake.FakeSGLangServer(tp_size=2, version="0.5.23") as srv:
        srv.script["/load_lora_adapter_from_tensors"] = [(404, json.dumps({"detail": "Not Found"}))]
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        with pytest.raises(SGLangUpdateError, match="HTTP 404") as err:
            a.load_lora_adapter_from_tensors("L", [("x.lora_A.weight", torch.ones(4, 4))], CONFIG)
        assert err.value.opened is False and err.value.status == 404
