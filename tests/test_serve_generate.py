"""`/generate` of `fsdp-sync serve` as an RL client uses SGLang's (issue 21 items 3 and 4).

Against a TP-2 reference engine loaded with a transformers model's weights: log-probs equal
``log_softmax`` of the transformers model's logits at the chosen tokens; ``stream`` gives SGLang's
SSE chunks ending the same output as the plain call; top-k 1 is greedy, top-k 2 draws from the two
most likely, min_p keeps the most likely; ``n`` samples; ``min_new_tokens`` and ``stop_token_ids``;
``meta_info`` with id, finish_reason and weight_version; and a client that goes away, or
``/abort_request``, ends a long request at its next step so nobody waits for it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.models import build_model, load_config
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(120)
PROMPT = [11, 27, 93, 5]


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def server(tiny):
    # a KV cache big enough for the long requests below, and a context long enough for them
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096     # RoPE: no weights depend on it
    with ReferenceEngine(cfg, tp_size=2, kv_cache_tokens=4096, seed=5) as eng:
        eng.update_weights_from_tensor(list(tiny.state_dict().items()))
        with EngineServer(eng) as srv:
            srv.weight_version = "v7"
            yield srv


def post(srv, body, timeout=60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        return resp.status, (json.loads(text) if resp.getheader("Content-Type") == "application/json"
                             else text)
    finally:
        conn.close()


@torch.no_grad()
def test_logprobs_are_the_trainer_models_log_softmax(server, tiny):
    status, out = post(server, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True}})
    assert status == 200, out
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 6 and meta["completion_tokens"] == 6 and meta["prompt_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "v7" and isinstance(meta["id"], str) and meta["id"]
    logits = tiny(input_ids=torch.tensor([PROMPT + ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    got = meta["output_token_logprobs"]
    assert [t for _, t, _ in got] == ids
    for j, (lp, t, text) in enumerate(got):
        assert text is None
        assert abs(lp - float(ref[len(PROMPT) - 1 + j, t])) < 1e-4, (j, lp)
        assert t == int(logits[len(PROMPT) - 1 + j].argmax())          # greedy
    inputs = meta["input_token_logprobs"]                               # SGLang: position 0 is None
    assert [t for _, t, _ in inputs] == PROMPT and inputs[0][0] is None
    for j in range(1, len(PROMPT)):
        assert abs(inputs[j][0] - float(ref[j - 1, PROMPT[j]])) < 1e-4
    # sampled: the reported logprob is the temperature-scaled distribution's, as SGLang's
    status, out = post(server, {"input_ids": PROMPT, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 4, "temperature": 0.7,
                                                    "ignore_eos": True}})
    ids = out["output_ids"]
    logits = tiny(input_ids=torch.tensor([PROMPT + ids])).logits[0].float()
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    for j, (lp, t, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(ref[len(PROMPT) - 1 + j, t])) < 1e-4


def test_sampling_parameters_take_effect(server, tiny):
    greedy = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})[1]["output_ids"]
    top1 = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.5, "top_k": 1, "ignore_eos": True}})[1]["output_ids"]
    assert top1 == greedy
    tiny_p = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "top_p": 1e-6, "ignore_eos": True}})[1]["output_ids"]
    assert tiny_p == greedy                    # top_p keeps only the most likely token
    # n samples of each prompt, consecutive; a batch answers a list
    status, out = post(server, {"input_ids": [PROMPT, [7, 8]], "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "n": 3, "ignore_eos": True}})
    assert status == 200 and len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [4, 4, 4, 2, 2, 2]
    assert len({o["meta_info"]["id"] for o in out}) == 6
    # stop_token_ids end a row (finish_reason stop, matched), min_new_tokens holds them off
    first = greedy[0]
    out = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}})[1]
    assert out["output_ids"] == [first]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    out = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 3}})[1]
    assert len(out["output_ids"]) == 3 and out["output_ids"][0] != first
    assert out["meta_info"]["finish_reason"]["type"] == "length"


@torch.no_grad()
def test_top_k_min_p_and_min_new_tokens_filter_what_is_drawn(server, tiny):
    """top_k=2 at temperature 1: the first token of 64 prompts seeded 0..63 all come from the two
    most likely (both seen); min_p=0.99 leaves only the most likely token where the runner-up is under
    99% of it: greedy; min_new_tokens=3
    holds a stop token off for exactly the first three tokens (the fourth may be it)."""
    logits = tiny(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()
    top = torch.topk(logits, 3)
    assert float(top.values[1] - top.values[2]) > 1e-3          # no near-tie at the cut
    status, out = post(server, {"input_ids": [PROMPT] * 64, "sampling_params": [{
        "max_new_tokens": 1, "temperature": 1.0, "top_k": 2, "sampling_seed": seed,
        "ignore_eos": True} for seed in range(64)]})
    assert status == 200, out
    drawn = [o["output_ids"][0] for o in out]
    assert set(drawn) == set(top.indices[:2].tolist()), sorted(set(drawn))
    greedy = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})[1]["output_ids"]
    probs = torch.softmax(tiny(input_ids=torch.tensor([PROMPT + greedy])).logits[0].float(), dim=-1)
    pairs = torch.topk(probs[len(PROMPT) - 1:len(PROMPT) + 2], 2).values
    assert (pairs[:, 1] < 0.98 * pairs[:, 0]).all(), pairs    # the tiny model is flat: 3 steps
    for seed in (1, 2, 3):
        status, out = post(server, {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 3, "temperature": 1.0, "min_p": 0.99, "sampling_seed": seed,
            "ignore_eos": True}})
        assert status == 200 and out["output_ids"] == greedy[:3], (seed, out)
    # the stop token is greedy's third: held off there, so the first three are greedy's first two
    # and another token; at most the fourth may be the stop
    stop = greedy[2]
    assert stop not in greedy[:2]
    out = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop],
        "min_new_tokens": 3}})[1]
    ids = out["output_ids"]
    assert ids[:2] == greedy[:2] and stop not in ids[:3] and len(ids) >= 4, out
    assert ids[-1] == stop or len(ids) == 6, out


def test_a_tiny_temperature_is_greedy_and_an_unsatisfiable_request_is_refused_alone(server):
    """SGLang samples greedily below a temperature of 1e-6; dividing the logits by 1e-300 made
    them inf and the draw failed, and the failure was every running request's (500 for all).
    A request whose stop tokens cover the whole vocabulary with ``min_new_tokens`` > 0 (nothing
    may be drawn) is refused at once (400 naming the field), not failed with its batch."""
    greedy = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})[1]["output_ids"]
    long_one = {}
    t = threading.Thread(target=lambda: long_one.setdefault("out", post(server, dict(LONG, sampling_params=dict(
        LONG["sampling_params"], max_new_tokens=300)))))
    t.start()
    for temp in (1e-300, 1e-7, 5e-324):
        status, out = post(server, {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 6, "temperature": temp, "ignore_eos": True}})
        assert status == 200 and out["output_ids"] == greedy, (temp, status, out)
    vocab = load_config("tiny").vocab_size
    status, out = post(server, {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 2, "temperature": 1.0, "stop_token_ids": list(range(vocab))}})
    assert status == 400 and "min_new_tokens" in out["message"] and "whole vocabulary" in out["message"], out
    # logprob_start_len without return_logprob: SGLang ignores it (it was a 400 here)
    status, out = post(server, {"input_ids": PROMPT, "logprob_start_len": 0, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and out["output_ids"] == greedy and "input_token_logprobs" not in out["meta_info"], out
    t.join(60)
    status, out = long_one["out"]
    assert status == 200 and len(out["output_ids"]) == 300, (status, out)      # never failed with the others


def test_stream_is_sglangs_sse(server):
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True, "rid": "stream-1",
            "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    raw = resp.read().decode()
    conn.close()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) == 7                                     # one per token
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))   # the output so far
    assert all(c["meta_info"]["id"] == "stream-1" for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 6
    plain = post(server, {k: v for k, v in body.items() if k not in ("stream", "rid")})[1]
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]


LONG = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2000, "temperature": 0,
                                                  "ignore_eos": True}}


def _timed_short(server) -> float:
    t0 = time.monotonic()
    status, out = post(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(out["output_ids"]) <= 2
    return time.monotonic() - t0


def test_a_disconnected_clients_request_is_aborted(server):
    t0 = time.monotonic()                  # how long the long one would take: 20 x 100 tokens
    status, out = post(server, dict(LONG, sampling_params=dict(LONG["sampling_params"],
                                                                max_new_tokens=100)))
    full = 20 * (time.monotonic() - t0)
    assert status == 200 and len(out["output_ids"]) == 100
    sock = socket.create_connection((server.host, server.port))
    body = json.dumps(LONG).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.3)
    sock.close()                                                   # the client goes away
    waited = _timed_short(server)
    assert waited < full / 3, (waited, full)       # before: the short request waited for all of it
    # the engine is free for an update too
    t0 = time.monotonic()       # waits for the aborted row to leave (it may still be ending)
    server.engine.flush_cache(timeout_s=full / 3)
    assert time.monotonic() - t0 < full / 3


def test_abort_request_by_rid_and_all(server):
    results = {}

    def run(rid):
        results[rid] = post(server, dict(LONG, rid=rid), timeout=120)

    for rid, how in (("long-1", {"rid": "long-1"}), ("long-2", {"abort_all": True})):
        t = threading.Thread(target=run, args=(rid,))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/abort_request", json.dumps(how), {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        t.join(timeout=60)
        assert not t.is_alive()
        status, out = results[rid]
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        assert 0 < len(out["output_ids"]) < 2000 and out["meta_info"]["id"] == rid
        assert time.monotonic() - t0 < 30
