"""``/generate`` fields read as SGLang 0.5.23 reads them (audit H2, the route audit).

From SGLang's ``GenerateReqInput`` / ``SamplingParams`` / ``TokenizerManager``:

- a batch with one string ``rid`` is SGLang's ``_normalize_rid``: ids ``rid_0``, ``rid_1``, ...
  (before: refused);
- ``return_logprob`` without ``logprob_start_len`` (-1) answers ``input_token_logprobs: []`` (the
  scheduler sets the start to the prompt's length) and ``output_token_logprobs_length`` beside
  ``output_token_logprobs`` (before: no ``input_token_logprobs`` key, which a client reading
  SGLang's meta_info indexes);
- every chunk of a streamed batch carries ``index`` (``_stream_batch_responses``), a batch of one
  prompt too (before: only with two results or more);
- ``ignore_eos: null`` is false, as ``SamplingParams.__post_init__`` makes it (before: refused).
"""

from __future__ import annotations

import http.client
import json

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(120)
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def server():
    with ReferenceEngine("tiny", tp_size=1, seed=8) as eng, EngineServer(eng) as srv:
        yield srv


def post(srv, body):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
    finally:
        conn.close()
    if body.get("stream") and resp.status == 200:
        chunks = [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]", chunks
        return resp.status, [json.loads(c) for c in chunks[:-1]]
    return resp.status, json.loads(raw)


def test_a_batch_with_one_string_rid_gets_sglangs_ids(server):
    status, out = post(server, {"input_ids": [[1, 2], [3, 4]], "rid": "job", "sampling_params": GREEDY})
    assert status == 200, out                                        # before: 400 'rid'
    assert [o["meta_info"]["id"] for o in out] == ["job_0", "job_1"]


def test_return_logprob_alone_answers_sglangs_logprob_keys(server):
    status, out = post(server, {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": GREEDY})
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == []                        # before: KeyError
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs_length"] == 3
    status, out = post(server, {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 1,
                                "sampling_params": GREEDY})
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == [6, 7]


def test_every_chunk_of_a_streamed_batch_carries_its_index(server):
    status, chunks = post(server, {"input_ids": [[5, 6]], "stream": True, "sampling_params": GREEDY})
    assert status == 200 and chunks
    assert all(c.get("index") == 0 for c in chunks), chunks          # before: no index
    status, chunks = post(server, {"input_ids": [5, 6], "stream": True, "sampling_params": GREEDY})
    assert status == 200 and chunks and all("index" not in c for c in chunks), chunks   # one prompt


def test_a_null_ignore_eos_is_false(server):
    status, out = post(server, {"input_ids": [5, 6], "sampling_params": GREEDY})
    first = out["output_ids"][0]
    cfg = server.engine.config
    saved = cfg.eos_token_id
    cfg.eos_token_id = first                 # the eos is what greedy makes first
    try:
        status, out = post(server, {"input_ids": [5, 6], "sampling_params": {
            "temperature": 0, "max_new_tokens": 3, "ignore_eos": None, "stop_token_ids": None}})
        assert status == 200, out                                    # before: 400 ignore_eos
        assert out["output_ids"] == [first]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    finally:
        cfg.eos_token_id = saved


@pytest.mark.parametrize("stop", ["", [""]])
def test_an_empty_stop_string_is_refused_not_taken_for_no_stop(server, stop):
    """SGLang's ``stop: ""`` is the stop string ``""``, which every decoded tail holds
    (``Req._check_str_based_finish``): the request ends after one token, ``matched: ""``. This
    engine takes no stop strings; before, ``""`` was read as none and ran to ``max_new_tokens``."""
    status, out = post(server, {"input_ids": [5, 6], "sampling_params": dict(GREEDY, stop=stop)})
    assert status == 400 and "sampling_params.stop" in out["message"], (status, out)
    for neutral in (None, []):
        status, out = post(server, {"input_ids": [5, 6], "sampling_params": dict(GREEDY, stop=neutral)})
        assert status == 200 and len(out["output_ids"]) == 3, (neutral, status, out)


def test_min_new_tokens_masks_the_eos_under_ignore_eos_as_sglang(server):
    """SGLang's ``BatchedMinNewTokensPenalizer`` masks the stop ids and the eos ids until
    ``min_new_tokens`` tokens were made, whatever ``ignore_eos`` says; before, with
    ``ignore_eos`` the eos stayed drawable (a greedy row made it first where SGLang cannot)."""
    status, out = post(server, {"input_ids": [5, 6], "sampling_params": GREEDY})
    first = out["output_ids"][0]
    cfg = server.engine.config
    saved = cfg.eos_token_id
    cfg.eos_token_id = first
    try:
        status, out = post(server, {"input_ids": [5, 6], "return_logprob": True,
                                    "sampling_params": dict(GREEDY, min_new_tokens=1)})
        assert status == 200, out
        assert out["output_ids"][0] != first, out                   # before: == first
        # the first token is the best of the rest: the logits with the eos masked
        logits = server.engine.forward_logits([[5, 6]])[0].float()
        logits[first] = float("-inf")
        assert out["output_ids"][0] == int(logits.argmax())
        status, plain = post(server, {"input_ids": [5, 6], "sampling_params": GREEDY})
        assert plain["output_ids"][0] == first                      # no min_new_tokens: unmasked
    finally:
        cfg.eos_token_id = saved


def test_ignore_eos_ignores_the_stop_token_ids_too_as_sglang(server):
    """SGLang's ``Req._check_token_based_finish`` returns at once under ``ignore_eos``: neither the
    eos nor ``stop_token_ids`` end the request. Before, serve still stopped at the stop ids."""
    status, free = post(server, {"input_ids": [5, 6], "sampling_params": dict(GREEDY, max_new_tokens=6)})
    stop = free["output_ids"][1]
    assert stop not in free["output_ids"][:1]
    status, out = post(server, {"input_ids": [5, 6], "sampling_params": dict(
        GREEDY, max_new_tokens=6, stop_token_ids=[stop])})
    assert status == 200 and out["output_ids"] == free["output_ids"], out     # before: 2 tokens
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    status, out = post(server, {"input_ids": [5, 6], "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop]}})
    assert out["output_ids"] == free["output_ids"][:2]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_a_logprob_start_len_past_the_prompt_is_refused(server):
    """SGLang aborts a request whose ``logprob_start_len`` is higher than its prompt's length
    (``Scheduler.handle_generate_request``); before, serve generated it with no input logprobs."""
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": GREEDY}
    status, out = post(server, dict(body, logprob_start_len=4))
    assert status == 400 and "logprob_start_len=4 is higher than the number of input tokens" in \
        out["message"], (status, out)
    status, out = post(server, dict(body, logprob_start_len=3))            # the prompt's length: none
    assert status == 200 and out["meta_info"]["input_token_logprobs"] == [], out
