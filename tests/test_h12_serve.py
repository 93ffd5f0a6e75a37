"""``n`` > 1 samples of `fsdp-sync serve`'s ``/generate`` as SGLang 0.5.23 runs them (helper H12).

With a ``sampling_seed`` every sample is the same tokens: SGLang applies the seed only under
``--enable-deterministic-inference`` (``SamplingBatchInfo.from_schedule_batch``), and there every
sample carries the request's sampling params (``TokenizerManager._handle_batch_request``) and
``sampler.multinomial_with_seed`` hashes the seed with the token's position alone. Before, serve
gave each sample a seed of its own (distinct samples).

SGLang's ``TokenizerManager._handle_batch_request`` (n > 1) drops the request's own ids from
``rid_to_state`` after the prefix warm-up and sends each sample as a request of its own under a
fresh uuid4 hex id (``GenerateReqInput.regenerate_rid``), answered in its ``meta_info.id``;
``TokenizerManager.abort_request`` returns at once for an id it does not hold. So a sample is
aborted by its own id, alone, and the request's ``rid`` aborts none of them. Before, serve named
the samples ``{rid}-{k}`` (ids nothing could abort) and the request's ``rid`` aborted them all.
"""

from __future__ import annotations

import http.client
import json
import re

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.models import load_config

pytestmark = pytest.mark.timeout(120)
HEX = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server():
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096     # RoPE: no weights depend on it; room for long requests
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=4096, seed=3) as eng, EngineServer(eng) as srv:
        yield srv


def call(srv, route, body, timeout=60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def test_each_sample_has_its_own_id_and_the_requests_rid_is_not_one(server):
    sp = {"max_new_tokens": 3, "temperature": 1.0, "n": 3, "ignore_eos": True}
    status, out = call(server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"],
                                             "sampling_params": sp})
    assert status == 200 and len(out) == 6, out
    ids = [o["meta_info"]["id"] for o in out]
    assert all(HEX.fullmatch(i) for i in ids) and len(set(ids)) == 6, ids      # before: a-0, a-1, ...
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 3, 2, 2, 2]
    # n = 1 keeps the request's ids
    status, out = call(server, "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"],
                                             "sampling_params": dict(sp, n=1)})
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["a", "b"], out


def test_a_sample_is_aborted_by_its_own_id_and_the_requests_rid_aborts_none(server):
    """Streamed, so the samples' ids are known while they run: ``/abort_request`` with the
    request's rid leaves both running; with sample 0's id it ends sample 0 alone (finish reason
    abort) while sample 1 goes on, until its own id ends it. Before, the rid ended both at the
    same step (equal lengths) and a sample's id ended nothing."""
    body = {"input_ids": [5, 6, 7], "rid": "job", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "n": 2, "ignore_eos": True}}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    last: dict[int, dict] = {}
    aborted: list[str] = []
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        for line in resp.fp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            last[chunk["index"]] = chunk
            if len(last) < 2:
                continue
            ids = [last[k]["meta_info"]["id"] for k in (0, 1)]
            if not aborted:
                assert all(HEX.fullmatch(i) for i in ids) and ids[0] != ids[1], ids
                for rid in ("job", "job_0", "job-0"):        # none is a sample's id
                    assert call(server, "/abort_request", {"rid": rid})[0] == 200
                assert call(server, "/abort_request", {"rid": ids[0]})[0] == 200
                aborted.append(ids[0])
            elif (len(aborted) == 1 and last[0]["meta_info"]["finish_reason"] is not None
                  and len(last[1]["output_ids"]) > len(last[0]["output_ids"]) + 5):
                assert call(server, "/abort_request", {"rid": ids[1]})[0] == 200
                aborted.append(ids[1])
    finally:
        conn.close()
    reasons = [last[k]["meta_info"]["finish_reason"] for k in (0, 1)]
    n0, n1 = (len(last[k]["output_ids"]) for k in (0, 1))
    assert len(aborted) == 2, (aborted, reasons, n0, n1)
    assert [r["type"] for r in reasons] == ["abort", "abort"], reasons
    assert 0 < n0 < n1 < 2000, (n0, n1)          # sample 1 went on after sample 0 was aborted


def test_the_samples_of_a_seeded_request_are_the_same_tokens(server):
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    one = call(server, "/generate", {"input_ids": [9, 8, 7], "sampling_params": dict(sp, sampling_seed=4)})[1]
    status, out = call(server, "/generate", {"input_ids": [9, 8, 7],
                                             "sampling_params": dict(sp, sampling_seed=4, n=4)})
    assert status == 200 and [o["output_ids"] for o in out] == [one["output_ids"]] * 4, out
    status, out = call(server, "/generate", {"input_ids": [9, 8, 7], "sampling_params": dict(sp, n=4)})
    assert status == 200 and len({tuple(o["output_ids"]) for o in out}) > 1, out   # unseeded: they differ
