"""The reference engine's request scheduler (`engines.reference.scheduler`): continuous batching,
weight updates that wait for running requests, SGLang's weight versions and pause modes, and the
out-of-service state, each checked with real tokens against greedy runs of the same weights.

One TP-2 engine serves the module; the ``fresh`` fixture loads the weights of model A under the
version "A" before each test and leaves the engine generating and in service after it. Overlaps
are read from the engine's step records (`ReferenceEngine.step_records`), not from timing: a
request the test acts on either runs until the test ends it (`endless`) or is paused in place by
the engine itself after its third step (`held`), so no outcome depends on the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from fsdp_sync.engines import EngineClosedError, EngineStateError, ReferenceEngine, WeightUpdateError
from fsdp_sync.engines.reference.scheduler import weight_version_spans
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(120)

P1 = [11, 27, 93, 5]
P2 = [201, 3, 64, 64, 17, 88, 42, 9, 120]
LONG = 40         # tokens of a request that is held, then runs to its end
HUGE = 3000       # tokens of a request the test ends itself (~30 s of steps: never reached)


def sp(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


class Bg(threading.Thread):
    """A call in a thread of its own; ``result`` or ``error`` once it returned."""

    def __init__(self, fn, *args, **kwargs) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def get(self, timeout: float = 60.0):
        self.join(timeout)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def greedy(eng, prompt, n) -> list[int]:
    return eng.generate_requests([prompt], sp(n))[0]["output_ids"]


def endless(eng, prompt, after: int = 3) -> tuple[Bg, threading.Event, list]:
    """A greedy request in a thread that runs until ``stop`` is set (then ends aborted), returned
    once it has made ``after`` tokens; and the caller's live results (what ``on_step`` sees)."""
    seen, stop, live = threading.Event(), threading.Event(), []

    def on_step(rs):
        if not live:
            live.extend(rs)
        if len(rs[0]["output_ids"]) >= after:
            seen.set()

    bg = Bg(eng.generate_requests, [prompt], sp(HUGE), on_step=on_step,
            should_abort=lambda k: stop.is_set())
    bg.start()
    assert seen.wait(30), "the request made no tokens"
    return bg, stop, live


def held(eng, prompt, n, after: int = 3) -> Bg:
    """A greedy request in a thread, paused in place by the engine right after its ``after``-th
    step (`ReferenceEngine._pause_after_steps`): it has made exactly ``after`` tokens."""
    eng._pause_after_steps(after)
    bg = Bg(eng.generate_requests, [prompt], sp(n))
    bg.start()
    wait_until(lambda: eng.generation_paused == "in_place")
    return bg


@pytest.fixture(scope="module")
def models():
    cfg = load_config("tiny")
    return build_model(cfg, seed=0).eval(), build_model(cfg, seed=1).eval()


def named(model):
    return list(model.state_dict().items())


@pytest.fixture(scope="module")
def eng():
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096        # room for `HUGE` (RoPE: no weight depends on it)
    with ReferenceEngine(cfg, tp_size=2, kv_cache_tokens=4096) as e:
        yield e


@pytest.fixture
def fresh(eng, models):
    eng.update_weights_from_tensor(named(models[0]), weight_version="A")
    yield eng
    eng.continue_generation()
    eng.set_serving(True)


# --------------------------------------------------------------------------- batching

def test_a_request_joins_the_running_batch_and_keeps_its_greedy_tokens(fresh):
    """B, sent from another thread while A decodes, is prefilled in A's next step and decodes
    beside it; both make exactly the tokens they make alone."""
    eng = fresh
    alone2 = greedy(eng, P2, 12)
    a, stop, _ = endless(eng, P1)
    rb = Bg(eng.generate_requests, [P2], sp(12))
    rb.start()
    rb = rb.get()[0]
    stop.set()
    ra = a.get()[0]
    assert ra["finish_reason"]["type"] == "abort"
    assert rb["output_ids"] == alone2                                   # batched = alone, exactly
    assert ra["output_ids"] == greedy(eng, P1, len(ra["output_ids"]))
    ia, ib = ra["request_id"], rb["request_id"]
    recs = [r for r in eng.step_records() if {ia, ib} & set(r.rows)]
    join = [r for r in recs if ib in r.prefill]
    assert len(join) == 1 and ia in join[0].decode           # prefilled in a step where A decoded
    assert sum(1 for r in recs if {ia, ib} <= set(r.decode)) == 11   # then decoded beside it
    assert max(r.index for r in recs if ib in r.rows) < max(r.index for r in recs if ia in r.rows)
    assert rb["weight_versions"] == [{"version": "A", "start": 0, "end": 12}]


def test_more_rows_than_the_kv_cache_holds_queue_and_match_their_lone_runs(fresh):
    """10 rows needing 4135 of 4096 KV slots: the last waits for the first two to free theirs."""
    eng = fresh
    prompts = [[(7 * i + j) % 500 for j in range(400)] for i in range(10)]
    params = [sp(10 + i) for i in range(10)]
    batched = eng.generate_requests(prompts, params)
    assert [len(r["output_ids"]) for r in batched] == [10 + i for i in range(10)]
    assert [r["output_ids"] for r in batched] == [greedy(eng, p, 10 + i) for i, p in enumerate(prompts)]
    ids = [r["request_id"] for r in batched]
    recs = [r for r in eng.step_records() if set(ids) & set(r.rows)]
    first_step = next(r for r in recs if ids[9] in r.prefill)
    assert first_step.index > recs[0].index and ids[0] not in first_step.rows   # after row 0 left
    assert eng.scheduler_stats()["kv_free"] == 4096


# --------------------------------------------------------------------------- updates and versions

def test_an_update_waits_for_running_requests_and_holds_new_ones(fresh, models):
    eng = fresh
    r, stop, _ = endless(eng, P1)
    u = Bg(eng.update_weights_from_tensor, named(models[1]), weight_version="B")
    u.start()
    wait_until(lambda: eng.scheduler_stats()["updates_waiting"] == 1)   # waiting for r
    c = Bg(eng.generate_requests, [P2], sp(10))
    c.start()
    wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)           # held back
    assert u.is_alive() and eng.get_weight_version() == "A"
    stop.set()                                                           # r ends: the update runs
    rr, _, rc = r.get()[0], u.get(), c.get()[0]
    n = len(rr["output_ids"])
    assert rr["weight_versions"] == [{"version": "A", "start": 0, "end": n}]
    assert rc["weight_versions"] == [{"version": "B", "start": 0, "end": 10}]
    assert rc["output_ids"] == greedy(eng, P2, 10)                       # the new weights'
    recs = eng.step_records()
    last_r = max(x.index for x in recs if rr["request_id"] in x.rows)
    assert min(x.index for x in recs if rc["request_id"] in x.rows) > last_r
    eng.update_weights_from_tensor(named(models[0]))
    assert rr["output_ids"] == greedy(eng, P1, n)                        # all of it old weights


def test_input_logprobs_come_from_the_weights_of_the_first_token(fresh, models):
    """A request with ``return_logprob`` and ``logprob_start_len`` arriving while an update waits
    got its input logprobs from a forward run at once (the old weights) and its tokens after the
    update (the new ones), under one weight version. Now both come from one hold of the engine's
    lock, at the row's first step; and a prompt scored alone (``max_new_tokens`` 0) still gets
    them."""
    eng = fresh
    r, stop, _ = endless(eng, P1)
    u = Bg(eng.update_weights_from_tensor, named(models[1]), weight_version="B")
    u.start()
    wait_until(lambda: eng.scheduler_stats()["updates_waiting"] == 1)
    c = Bg(eng.generate_requests, [P2], sp(4), return_logprob=True, logprob_start_len=0)
    c.start()
    wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)
    stop.set()
    r.get(), u.get()
    rc = c.get()[0]
    assert rc["weight_versions"] == [{"version": "B", "start": 0, "end": 4}]
    scored = eng.generate_requests([P2], sp(0), return_logprob=True, logprob_start_len=0)[0]
    assert scored["output_ids"] == [] and len(scored["input_token_logprobs"]) == len(P2)
    assert rc["input_token_logprobs"] == scored["input_token_logprobs"]     # model B's
    eng.update_weights_from_tensor(named(models[0]))
    assert eng.generate_requests([P2], sp(0), return_logprob=True, logprob_start_len=0)[0][
        "input_token_logprobs"] != rc["input_token_logprobs"]                 # model A's differ


def test_weight_version_follows_commits_only(fresh, models):
    eng = fresh
    A, B = models
    assert eng.get_weight_version() == eng.weight_version == "A"
    eng.update_weights_from_tensor(named(B), weight_version="B1")       # commits: takes it now
    assert eng.get_weight_version() == "B1"
    eng.begin_weight_update()
    eng.update_weights_from_tensor(named(A), weight_version="A2")
    assert eng.get_weight_version() == "B1"                             # staged, not committed
    eng.end_weight_update()
    assert eng.get_weight_version() == "A2"
    a_tokens = greedy(eng, P1, 8)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(named(B), weight_version="dropped")
    with pytest.raises(ValueError, match="not both"):      # an abort names no weights
        eng.end_weight_update(abort=True, weight_version="dropped too")
    eng.end_weight_update(abort=True)
    assert eng.get_weight_version() == "A2" and greedy(eng, P1, 8) == a_tokens
    eng.begin_weight_update()
    with pytest.raises(WeightUpdateError):
        eng.update_weights_from_tensor([("model.norm.weight", A.model.norm.weight[:3])],
                                       weight_version="bad")
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update(weight_version="after a failure")         # closes it, commits nothing
    assert eng.get_weight_version() == "A2"
    eng.begin_weight_update()
    eng.update_weights_from_tensor(named(B))
    eng.end_weight_update(weight_version="B3")
    out = eng.generate_requests([P1, P2], [sp(6), sp(0)])
    assert out[0]["weight_versions"] == [{"version": "B3", "start": 0, "end": 6}]
    assert out[1]["weight_versions"] == [{"version": "B3", "start": 0, "end": 0}]
    assert out[0]["weight_version"] == out[1]["weight_version"] == "B3"
    for bad in (3, b"v"):
        with pytest.raises(ValueError, match="weight_version must be a string"):
            eng.update_weights_from_tensor(named(B), weight_version=bad)
        with pytest.raises(ValueError, match="weight_version must be a string"):
            eng.update_weight_version(bad)
    with pytest.raises(ValueError, match="weight_version must be a string"):
        eng.end_weight_update(weight_version=1.5)


def test_no_token_carries_a_version_its_weights_are_not(fresh, models):
    """Requests loop in two threads while updates commit other weights with their versions: every
    answer is wholly one version's, and its tokens are that version's weights' greedy tokens."""
    eng = fresh
    A, B = models
    want = {"A": greedy(eng, P1, 8)}
    eng.update_weights_from_tensor(named(B), weight_version="B")
    want["B"] = greedy(eng, P1, 8)
    assert want["A"] != want["B"]
    eng.update_weights_from_tensor(named(A), weight_version="A")
    stop, results = threading.Event(), []

    def loop():
        while not stop.is_set():
            results.append(eng.generate_requests([P1], sp(8))[0])

    threads = [Bg(loop) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(4):
        wait_until(lambda n=len(results): len(results) > n)
        w, v = (B, "B") if i % 2 == 0 else (A, "A")
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named(w))
        eng.end_weight_update(weight_version=v)
    stop.set()
    for t in threads:
        t.get()
    assert len(results) >= 4 and {r["weight_version"] for r in results} == {"A", "B"}
    for r in results:
        assert len(r["weight_versions"]) == 1
        assert r["output_ids"] == want[r["weight_version"]], r["weight_versions"]


def test_update_weight_version_tags_later_tokens_and_can_abort_everything(fresh):
    eng = fresh
    r, _, live = endless(eng, P1)
    eng.update_weight_version("A-renamed")
    rid = live[0]["request_id"]
    wait_until(lambda: any(x.version == "A-renamed" and rid in x.rows for x in eng.step_records()))
    eng.update_weight_version("A-3", abort_all_requests=True)
    res = r.get(10)[0]
    assert res["finish_reason"]["type"] == "abort" and "update_weight_version" in res["finish_reason"]["message"]
    spans = res["weight_versions"]
    n = len(res["output_ids"])
    assert [s["version"] for s in spans] == ["A", "A-renamed"] and spans[-1]["end"] == n
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert res["weight_version"] == "A-renamed" and eng.get_weight_version() == "A-3"
    with pytest.raises(ValueError, match="abort_all_requests must be a bool"):
        eng.update_weight_version("x", abort_all_requests="yes")


def test_spans_are_sglangs():
    assert weight_version_spans([], "v") == [{"version": "v", "start": 0, "end": 0}]
    assert weight_version_spans(["a", "a", "b", "b", "a"], "c") == [
        {"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 4},
        {"version": "a", "start": 4, "end": 5}]


# --------------------------------------------------------------------------- pause modes

def test_pause_in_place_keeps_the_kv_and_splits_the_spans(fresh, models):
    eng = fresh
    old = greedy(eng, P1, LONG)
    r = held(eng, P1, LONG)
    eng.pause_generation("in_place")                                     # again: no change
    assert eng.generation_paused == "in_place"
    steps = eng.scheduler_stats()["steps"]
    q = Bg(eng.generate_requests, [P2], sp(10))
    q.start()
    wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)           # queued, not refused
    with pytest.raises(EngineStateError, match="paused in place"):
        eng.flush_cache()                                                # SGLang's rule
    with pytest.raises(EngineStateError, match="paused in place"):
        eng.release_memory_occupation(["kv_cache"])
    eng.begin_weight_update()                                            # updates run while paused
    eng.update_weights_from_tensor(named(models[1]))
    eng.end_weight_update(weight_version="B")
    assert eng.scheduler_stats()["steps"] == steps                      # nothing stepped
    eng.continue_generation()
    res, rq = r.get()[0], q.get()[0]
    j = res["weight_versions"][0]["end"]
    assert res["weight_versions"] == [{"version": "A", "start": 0, "end": j},
                                      {"version": "B", "start": j, "end": LONG}]
    assert j == 3 and res["output_ids"][:j] == old[:j]
    prefills = [x for x in eng.step_records() if res["request_id"] in x.prefill]
    assert len(prefills) == 1 and prefills[0].version == "A"            # its KV was kept
    assert rq["weight_versions"] == [{"version": "B", "start": 0, "end": 10}]
    assert rq["output_ids"] == greedy(eng, P2, 10)


def test_pause_retract_recomputes_with_the_new_weights(fresh, models):
    eng = fresh
    old = greedy(eng, P1, LONG)
    r = held(eng, P1, LONG)
    eng.pause_generation("retract")
    assert eng.scheduler_stats()["running"] == 0 and eng.scheduler_stats()["waiting"] == 1
    eng.flush_cache()                                                    # no KV held: allowed
    eng.begin_weight_update()
    eng.update_weights_from_tensor(named(models[1]))
    eng.end_weight_update(weight_version="B")
    eng.continue_generation()
    res = r.get()[0]
    j = res["weight_versions"][0]["end"]
    assert res["weight_versions"] == [{"version": "A", "start": 0, "end": j},
                                      {"version": "B", "start": j, "end": LONG}]
    out = res["output_ids"]
    assert j == 3 and out[:j] == old[:j]
    assert out[j:] == greedy(eng, P1 + out[:j], LONG - j)               # new weights over prompt+prefix
    prefills = [x for x in eng.step_records() if res["request_id"] in x.prefill]
    assert [x.version for x in prefills] == ["A", "B"]


def test_a_disk_update_while_paused_in_place(fresh, models, tmp_path):
    eng = fresh
    models[1].save_pretrained(tmp_path / "B", safe_serialization=True)
    old = greedy(eng, P2, LONG)
    r = held(eng, P2, LONG)
    eng.update_weights_from_disk(str(tmp_path / "B"), weight_version="B-disk")
    assert eng.get_weight_version() == "B-disk"
    eng.continue_generation()
    res = r.get()[0]
    j = res["weight_versions"][0]["end"]
    assert res["weight_versions"] == [{"version": "A", "start": 0, "end": j},
                                      {"version": "B-disk", "start": j, "end": LONG}]
    assert res["output_ids"][:j] == old[:j]


def test_pause_abort_returns_requests_at_once_and_queues_new_ones(fresh):
    eng = fresh
    old = greedy(eng, P1, LONG)
    r = held(eng, P1, LONG)
    eng.pause_generation()                                               # SGLang's default: abort
    res = r.get(10)[0]
    n = len(res["output_ids"])
    assert res["finish_reason"]["type"] == "abort" and n == 3 and res["output_ids"] == old[:n]
    assert res["weight_versions"] == [{"version": "A", "start": 0, "end": n}]
    q = Bg(eng.generate_requests, [P2], sp(5))
    q.start()
    wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)
    with pytest.raises(ValueError, match="'sideways'"):
        eng.pause_generation("sideways")
    eng.continue_generation()
    assert len(q.get()[0]["output_ids"]) == 5


# --------------------------------------------------------------------------- out of service

def test_out_of_service_refuses_generate_but_takes_updates(fresh, models):
    eng = fresh
    r, _, _ = endless(eng, P1)
    why = "quarantined: fleet commit failed on this replica"
    eng.set_serving(False, why)
    res = r.get(10)[0]                                                   # in flight: aborted
    assert res["finish_reason"]["type"] == "abort" and why in res["finish_reason"]["message"]
    assert eng.serving_state == why
    with pytest.raises(EngineStateError, match="quarantined: fleet commit failed"):
        eng.generate([P2], 4)
    eng.update_weights_from_tensor(named(models[1]), weight_version="B")   # the trainer's way back
    assert eng.get_weights_by_name("model.norm.weight").shape[0] > 0
    eng.set_serving(True)
    assert eng.serving_state is None
    out = eng.generate_requests([P2], sp(4))[0]
    assert out["weight_versions"] == [{"version": "B", "start": 0, "end": 4}]
    eng.set_serving(False)
    assert eng.serving_state == "taken out of service"
    eng.set_serving(True)
    for bad in (("no",), (False, 3)):
        with pytest.raises(ValueError, match="set_serving"):
            eng.set_serving(*bad)


@pytest.mark.timeout(60)
def test_shutdown_fails_a_request_in_flight_and_leaves_nothing():
    eng = ReferenceEngine("tiny", tp_size=1)
    try:
        r = held(eng, P1, LONG)
    finally:
        eng.shutdown()
    with pytest.raises(EngineClosedError):
        r.get(20)
    with pytest.raises(EngineClosedError):
        eng.generate([P1], 2)


# --------------------------------------------------------------------------- seeded sampling, streaming

def seeded(tokens: int, seed: int | None = 7, **more) -> dict:
    return {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed, **more}


def test_a_seeded_row_draws_the_same_tokens_whatever_runs_beside_it(fresh):
    """SGLang's ``sampling_seed``: a sampled row's tokens depend on its prompt, seed and the
    weights alone: beside other rows (before or after it in the batch), beside a request running
    in another thread, and after a retract and recompute. Before, the key was refused, and every
    sampled row drew from the worker's one generator in batch order (request A alone, after B and
    before B: three different outputs on one engine seed)."""
    eng = fresh
    alone = eng.generate_requests([P1], seeded(12))[0]["output_ids"]
    assert eng.generate_requests([P1], seeded(12))[0]["output_ids"] == alone
    assert eng.generate_requests([P2, P1], [seeded(12, None), seeded(12)])[1]["output_ids"] == alone
    assert eng.generate_requests([P1, P2], [seeded(12), seeded(12, 8)])[0]["output_ids"] == alone
    other = eng.generate_requests([P1], seeded(12, 8))[0]["output_ids"]
    assert other != alone                                   # the seed decides, not the prompt alone
    bg, stop, _ = endless(eng, P2)                          # a request of another thread runs
    try:
        assert eng.generate_requests([P1], seeded(12))[0]["output_ids"] == alone
    finally:
        stop.set()
        bg.get()
    eng._pause_after_steps(3)                               # retracted after 3 tokens, recomputed
    r = Bg(eng.generate_requests, [P1], seeded(12))
    r.start()
    wait_until(lambda: eng.generation_paused == "in_place")
    eng.pause_generation("retract")
    eng.continue_generation()
    res = r.get()[0]
    assert res["output_ids"] == alone
    assert len([x for x in eng.step_records() if res["request_id"] in x.prefill]) == 2
    # n samples of one seeded request are each the request's own tokens, as SGLang's (every
    # sample carries the request's seed: tokenizer_manager._handle_batch_request)
    samples = [x["output_ids"] for x in eng.generate_requests([P1], seeded(12, n=3))]
    assert samples == [alone] * 3


@pytest.mark.parametrize("bad", [-2 ** 63 - 1, 2 ** 63, 1.5, "7", True])
def test_a_sampling_seed_that_is_no_seed_is_refused(fresh, bad):
    with pytest.raises(ValueError, match=r"sampling_params\.sampling_seed must be"):
        fresh.generate_requests([P1], seeded(4, bad))


def test_a_negative_sampling_seed_is_a_seed_as_in_sglang(fresh):
    """SGLang 0.5.23 takes seeds in [-2**63, 2**63) (``SamplingParams.verify``); serve refused a
    negative one. It draws as any seed: the same tokens twice, others than another seed's."""
    one = fresh.generate_requests([P1], seeded(12, -5))[0]["output_ids"]
    assert fresh.generate_requests([P1], seeded(12, -5))[0]["output_ids"] == one
    low = fresh.generate_requests([P1], seeded(12, -2 ** 63))[0]["output_ids"]
    assert len(one) == len(low) == 12 and one != low


@pytest.mark.parametrize("interval, told", [(None, list(range(1, 13))), (3, [3, 6, 9, 12]), (5, [5, 10, 12])])
def test_on_step_follows_stream_interval(fresh, interval, told):
    """``on_step`` is the Python API's stream: SGLang's ``stream_interval`` spaces it as it spaces
    the server's chunks (before, it was accepted and ``on_step`` ran after every step)."""
    seen = []
    params = sp(12) | ({} if interval is None else {"stream_interval": interval})
    fresh.generate_requests([P1], params, on_step=lambda rs: seen.append(len(rs[0]["output_ids"])))
    assert seen == told
