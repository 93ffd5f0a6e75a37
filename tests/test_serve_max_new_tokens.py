"""``max_new_tokens`` missing or null, and the context limits, as SGLang 0.5.23 (serve3 audit, D2).

SGLang checks prompt + ``max_new_tokens`` against the context only for a ``max_new_tokens`` the
request gives (``TokenizerManager._validate_one_request``); its scheduler then takes a missing one
as 128 and a null one as ``1 << 30``, and caps every one at ``max_req_len - prompt - 1`` with
``max_req_len = context - 1`` (``init_req_max_new_tokens``), ``min_new_tokens`` with it; a prompt of
``context - 6`` tokens or more is refused (``validate_input_length``). Before, a missing or null
one was the default 128 checked against the context: a 200-token prompt on a 256-token model was
refused, and null gave 128 tokens where SGLang gives up to the context.
"""

from __future__ import annotations

import http.client
import json

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.generation import Sampling
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(90)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with ReferenceEngine("tiny", tp_size=1, seed=2) as eng:       # context: 256 tokens
        assert eng.config.max_position_embeddings == 256
        with EngineServer(eng) as srv:
            yield srv


def generate(srv, prompt, **sampling):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        body = {"input_ids": prompt, "sampling_params": dict(GREEDY, **sampling)}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
    finally:
        conn.close()
    if resp.status != 200:
        return resp.status, out["message"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": len(out["output_ids"])}
    return 200, len(out["output_ids"])


MISSING = {}
NULL = {"max_new_tokens": None}


@pytest.mark.parametrize("prompt_len, sampling, want", [
    (200, MISSING, 54),            # 128 capped at 255 - 200 - 1; before: 400, 328 > 256 tokens
    (200, NULL, 54),               # before: the same 400
    (3, NULL, 251),                # up to the context; before: 128
    (3, MISSING, 128),             # SGLang's default
    (249, MISSING, 5),
    (3, dict(NULL, min_new_tokens=300), 251),   # min_new_tokens capped too, not refused
], ids=["200-missing", "200-null", "3-null", "3-missing", "249-missing", "null-min-new"])
def test_a_missing_or_null_max_new_tokens_is_capped_by_the_context(server, prompt_len, sampling, want):
    assert generate(server, [1] * prompt_len, **sampling) == (200, want)


def test_a_given_max_new_tokens_is_checked_then_capped_as_sglang(server):
    assert generate(server, [1] * 200, max_new_tokens=56) == (200, 54)   # 256 fits; capped (before: 56)
    status, msg = generate(server, [1] * 200, max_new_tokens=57)
    assert status == 400 and msg.startswith(
        "Requested token count exceeds the model's maximum context length of 256 tokens. You "
        "requested a total of 257 tokens: 200 tokens from the input messages and 57 tokens"), msg
    status, msg = generate(server, [1, 2, 3], min_new_tokens=200)         # against the default 128
    assert status == 400 and "min_new_tokens (200) must be <= max_new_tokens (128)" in msg, msg


def test_prompts_near_the_context_are_refused_as_sglang_refuses_them(server):
    status, msg = generate(server, [1] * 256, max_new_tokens=0)
    assert (status, msg) == (400, "The input (256 tokens) is longer than the model's context "
                                  "length (256 tokens)."), msg
    for sampling in (MISSING, NULL, {"max_new_tokens": 1}):
        status, msg = generate(server, [1] * 250, **sampling)
        assert status == 400 and msg.startswith(
            "Input length (250 tokens) exceeds the maximum allowed length (250 tokens)."), msg


def test_in_process_calls_follow_the_same_rules(server):
    eng = server.engine
    [r] = eng.generate_requests([[1] * 200], None)                  # no sampling_params at all
    assert len(r["output_ids"]) <= 54 and (r["finish_reason"]["type"] == "stop"
                                            or len(r["output_ids"]) == 54)
    [out] = eng.generate([[1] * 200], max_new_tokens=None, ignore_eos=True)
    assert len(out) == 54


def test_the_kv_cache_caps_only_a_length_not_given():
    """SGLang's ``max_req_len`` is below its KV pool too: a length not given is capped by this
    engine's KV cache (never refused for it); a given one is left for the KV check to refuse."""
    from fsdp_sync.engines.reference.generation import NO_LIMIT
    from fsdp_sync.engines.reference.rollout import fit_max_new_tokens

    s = Sampling.from_sglang({}, eos=[])
    assert s.max_new_tokens == 128
    assert fit_max_new_tokens(10, s, given=False, context=256, kv_tokens=64).max_new_tokens == 52
    null = Sampling.from_sglang({"max_new_tokens": None, "min_new_tokens": 70}, eos=[])
    assert null.max_new_tokens == NO_LIMIT
    fitted = fit_max_new_tokens(10, null, given=False, context=None, kv_tokens=64)
    assert (fitted.max_new_tokens, fitted.min_new_tokens) == (52, 52)
    given = Sampling.from_sglang({"max_new_tokens": 60}, eos=[])
    assert fit_max_new_tokens(10, given, given=True, context=256, kv_tokens=64) == given
    assert fit_max_new_tokens(10, given, given=True, context=None, kv_tokens=64) == given
    assert fit_max_new_tokens(100, s, given=False, context=256, kv_tokens=64).max_new_tokens == 0
