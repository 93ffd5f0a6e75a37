"""A checkpoint's ``generation_config.json`` eos ids end serve's requests, as SGLang's (audit H2).

SGLang 0.5.23 stops a request at the config's ``eos_token_id`` and at its generation config's
(``ModelConfig._get_hf_eos_token_id``: the union; instruct checkpoints such as Qwen2.5's and
Llama 3's list more eos ids there than in ``config.json``). Before, ``fsdp-sync serve --model DIR``
read ``config.json`` alone and generated past an eos SGLang stops at.
"""

from __future__ import annotations

import http.client
import json

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.models import load_config

pytestmark = pytest.mark.timeout(120)


def post(srv, body):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_generation_config_eos_ids_end_requests_as_in_sglang(tmp_path):
    load_config("tiny").save_pretrained(tmp_path)
    sampling = {"temperature": 0, "max_new_tokens": 6}
    with ReferenceEngine(str(tmp_path), tp_size=1, seed=9) as eng:
        assert eng.config.eos_token_id is None
        with EngineServer(eng, model_path=str(tmp_path)) as srv:
            free = post(srv, {"input_ids": [5, 6], "sampling_params": sampling})[1]["output_ids"]
        stop = free[2]
        assert stop not in free[:2]
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 3]}))
        with EngineServer(eng, model_path=str(tmp_path)) as srv:
            status, out = post(srv, {"input_ids": [5, 6], "sampling_params": sampling})
            assert status == 200 and out["output_ids"] == free[:3], out      # before: all 6
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            status, out = post(srv, {"input_ids": [5, 6], "sampling_params": dict(sampling, ignore_eos=True)})
            assert out["output_ids"] == free                                  # ignore_eos: none
        (tmp_path / "generation_config.json").write_text("{not json")
        with pytest.raises(ValueError, match="generation_config.json does not read"):
            EngineServer(eng, model_path=str(tmp_path))
