"""The context length serve holds requests to is SGLang 0.5.23's (audit H2, item 1).

SGLang's ``ModelConfig`` takes ``--context-length`` or ``get_context_length(hf_text_config)``: the
first of ``max_sequence_length``, ``seq_length``, ``max_seq_len``, ``model_max_length``,
``max_position_embeddings`` the config sets (2048 when none), times the ``rope_scaling`` factor
unless ``rope_scaling`` holds ``original_max_position_embeddings`` or its ``rope_type`` is
``llama3``. Before, serve read ``max_position_embeddings`` alone: a config whose
``max_sequence_length`` is shorter was served past SGLang's context (prompts SGLang refuses got
answers), and a ``factor`` beside the default rope (SGLang's context doubled) refused prompts SGLang
serves; ``/v1/models`` reported the same wrong ``max_model_len``, and ``--context-length`` had no
counterpart.
"""

from __future__ import annotations

import http.client
import json

import pytest
from transformers import LlamaConfig

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.rollout import sglang_context_length
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.models import load_config

pytestmark = pytest.mark.timeout(120)
GREEDY = {"temperature": 0, "ignore_eos": True}

# (config keywords on a max_position_embeddings=256 Llama config, SGLang 0.5.23's context length)
CASES = {
    "none": ({}, 256),
    "linear": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 512),
    "linear-legacy-type": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 512),
    "dynamic": ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 1024),
    # transformers 5 adds original_max_position_embeddings to a yarn config: SGLang skips its factor
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 256),
    "yarn-original": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 64}}, 256),
    "llama3-skipped": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}}, 256),
    "default-with-factor": ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, 512),
    "seq_length-wins": ({"seq_length": 512}, 512),
    "max_sequence_length-wins": ({"max_sequence_length": 128, "seq_length": 512}, 128),
    "model_max_length-times-factor": ({"model_max_length": 300,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 600),
}


def config(**kw):
    return LlamaConfig(max_position_embeddings=256, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_the_derived_context_length_is_sglangs(name):
    kw, want = CASES[name]
    assert sglang_context_length(config(**kw)) == want


def test_a_config_without_any_length_key_gets_sglangs_2048():
    cfg = config()
    del cfg.max_position_embeddings
    assert sglang_context_length(cfg) == 2048


def _generate(srv, n_prompt, **sampling):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        body = {"input_ids": [1] * n_prompt, "sampling_params": dict(GREEDY, **sampling)}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
    finally:
        conn.close()
    return resp.status, (len(out["output_ids"]) if resp.status == 200 else out["message"])


def _models(srv):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["max_model_len"]
    finally:
        conn.close()


def test_serve_holds_requests_to_sglangs_context_not_max_position_embeddings():
    cfg = load_config("tiny")
    assert cfg.max_position_embeddings == 256
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"],
                        "factor": 2.0}             # the default rope: SGLang's context is 512
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=1024, seed=3) as eng, EngineServer(eng) as srv:
        assert _generate(srv, 300) == (200, 128)                 # before: 400 (300 >= 256)
        assert eng.context_length == 512 and _models(srv) == 512
        assert _generate(srv, 300, max_new_tokens=None) == (200, 510 - 300)
        status, msg = _generate(srv, 512)
        assert (status, msg) == (400, "The input (512 tokens) is longer than the model's context "
                                      "length (512 tokens)."), msg

        # SGLang's --context-length: shorter is taken, longer refused (its env var aside)
        eng.set_context_length(200)
        assert eng.context_length == 200 and _models(srv) == 200
        assert _generate(srv, 150) == (200, 48)                  # 199 - 150 - 1
        status, msg = _generate(srv, 300)
        assert status == 400 and "longer than the model's context length (200 tokens)" in msg, msg
        with pytest.raises(ValueError, match="greater than the context length derived from the "
                                             "model config \\(512"):
            eng.set_context_length(513)
        assert eng.context_length == 200
        eng.set_context_length(None)
        assert eng.context_length == 512


def test_a_shorter_max_sequence_length_is_the_context_as_in_sglang():
    cfg = load_config("tiny")
    cfg.max_sequence_length = 128                  # SGLang reads it before max_position_embeddings
    with ReferenceEngine(cfg, tp_size=1, seed=3) as eng, EngineServer(eng) as srv:
        assert _models(srv) == 128
        status, msg = _generate(srv, 200, max_new_tokens=8)      # before: 8 tokens past SGLang's context
        assert (status, msg) == (400, "The input (200 tokens) is longer than the model's context "
                                      "length (128 tokens)."), msg
        assert _generate(srv, 100) == (200, 26)                  # 127 - 100 - 1


def test_serve_cli_context_length_holds_requests_to_it():
    """``fsdp-sync serve --context-length N``: SGLang's flag, the limit /v1/models and /generate
    hold (without it serve answered the config's 256)."""
    from urllib.parse import urlparse

    from _util import start_serve

    proc, url = start_serve("--context-length", "100")
    try:
        u = urlparse(url)
        srv = type("Srv", (), {"host": u.hostname, "port": u.port})()
        assert _models(srv) == 100
        status, msg = _generate(srv, 120, max_new_tokens=4)
        assert (status, msg) == (400, "The input (120 tokens) is longer than the model's context "
                                      "length (100 tokens)."), msg
        assert _generate(srv, 90) == (200, 8)                    # 99 - 90 - 1
    finally:
        proc.terminate()
        proc.wait(30)
