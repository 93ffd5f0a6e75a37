"""`fsdp-sync serve`'s LoRA routes answer as SGLang 0.5.23 does (``LoRAUpdateOutput``: ``success``,
``error_message``, ``loaded_adapters``; before: ``message`` only), a ``lora_path`` outside
``--allowed-disk-dir`` is refused naming ``lora_path`` (before: ``model_path``), and loading a name
already loaded from a directory says so (before: that the directory has no adapter_config.json,
read before the name was checked). A TP-1 engine, bodies posted as SGLang's clients post them.
"""

from __future__ import annotations

import http.client
import json

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.models import build_model, load_config
from test_lora_engine import make_adapter

pytestmark = pytest.mark.timeout(180)


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read().decode())
    finally:
        conn.close()


def test_lora_answers_are_sglangs(tmp_path):
    from safetensors.torch import save_file

    tiny = build_model(load_config("tiny"), seed=0).eval()
    allowed = tmp_path / "allowed"
    (allowed / "b").mkdir(parents=True)
    tensors, config = make_adapter(tiny, r=4, alpha=16, seed=1)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(allowed / "b" / "adapter_model.safetensors"))
    (allowed / "b" / "adapter_config.json").write_text(json.dumps(config))
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=1) as eng, \
            EngineServer(eng, allowed_disk_dirs=[str(allowed)], update_wait_s=30.0) as srv:
        eng.load_lora_adapter_from_tensors("a", tensors, config)
        status, answer = _post(srv, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(allowed / "b")})
        assert status == 200 and answer["success"] and answer["error_message"] == ""
        assert answer["loaded_adapters"] == {"a": "__tensor__", "b": str(allowed / "b")}
        # the name again, from a directory without the files: the name is what is wrong
        status, answer = _post(srv, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(allowed)})
        assert status == 400 and not answer["success"]
        assert "an adapter named 'b' is already loaded" in answer["error_message"]
        assert answer["message"] == answer["error_message"]
        assert answer["loaded_adapters"] == {"a": "__tensor__", "b": str(allowed / "b")}
        # outside --allowed-disk-dir: the field named is the one sent
        status, answer = _post(srv, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path)})
        assert status == 403 and answer["message"].startswith(f"lora_path {str(tmp_path)!r} (resolved")
        status, answer = _post(srv, "/unload_lora_adapter", {"lora_name": "b"})
        assert status == 200 and answer["error_message"] == "" and answer["loaded_adapters"] == {"a": "__tensor__"}
        status, answer = _post(srv, "/unload_lora_adapter", {"lora_name": "nope"})
        assert status == 400 and answer["error_message"].startswith("unload_lora_adapter('nope'): no such adapter")
        assert torch.equal(eng.lora_tensors("a")["model.layers.0.self_attn.q_proj.lora_A.weight"].float(),
                           tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
