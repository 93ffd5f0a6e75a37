"""Reference engine at TP 2, checks H21's mutation pass found no test holding (each fails with the
code it guards mutated), on one module-scoped engine:

- a LoRA load that one worker refuses and the other takes changes nothing and leaves the engine
  usable (`lora_calls`: the stage round's agreement; the staged shard of the rank that said yes is
  dropped, never committed): before, no test refused an adapter on one rank only;
- rows retracted by ``pause_generation("retract")`` go back to the front of the queue in the
  order they came (first come, first served), ahead of a request that arrived while paused
  (`scheduler.Scheduler.pause`): before, no test retracted more than one row;
- a worker that fails while it starts (no room for a KV cache) reports its own error, naming the
  rank (`worker.main`), and the failed start leaves no process behind; a worker whose interpreter
  cannot be started leaves no fd behind (`procs.start`).
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine, WeightUpdateError
from fsdp_sync.models import load_config

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17]]


def adapter(eng, seed, r=2, targets=("q_proj", "down_proj")):
    """peft-named tensors of a rank-``r`` adapter on ``targets`` of every layer of ``eng``'s model."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in eng.hf_names():
        parts = name.split(".")
        if name.endswith(".weight") and len(parts) > 3 and parts[-2] in targets:
            out_dim, in_dim = eng.layout.full_shape(name)
            base = name[:-len(".weight")]
            out[f"base_model.model.{base}.lora_A.weight"] = torch.randn(r, in_dim, generator=g) * 0.1
            out[f"base_model.model.{base}.lora_B.weight"] = torch.randn(out_dim, r, generator=g) * 0.1
    return out, {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets),
                 "bias": "none", "use_dora": False, "use_rslora": False}


@pytest.fixture(scope="module")
def eng():
    """Its own start-up weights (seed 0): nothing here compares with another model."""
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2, max_lora_rank=8) as e:
        yield e


def test_a_lora_load_refused_by_one_worker_only_changes_nothing(eng):
    """TP rank 0 opens and stages a good payload, TP rank 1 cannot open its own: the load is
    refused naming rank 1, the adapter served before (``replace=True``) serves on, bit for bit on
    both ranks, and the engine takes the next load."""
    from fsdp_sync.weights import handles
    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets
    from fsdp_sync.wire import flattened_bucket

    t1, c1 = adapter(eng, 1)
    t2, c2 = adapter(eng, 2)
    eng.load_lora_adapter_from_tensors("a", t1, c1)
    try:
        before = eng.forward_logits(PROMPTS, lora_path="a")
        pieces = eng.lora_rank_pieces("a")
        metas = [TensorMeta.of(n, v) for n, v in t2.items()]
        bkt = plan_buckets(metas, sum(m.nbytes for m in metas) + 64 * (len(metas) + 1))[0]
        flat = handles.empty_shared(bkt.nbytes)
        flatten(bkt, list(t2.values()), out=flat)
        ps = handles.make_payloads(flattened_bucket(flat, bkt), 2)
        try:
            with pytest.raises(WeightUpdateError, match="could not open the LoRA payload for TP rank 1") as ei:
                eng.load_lora_adapter_from_tensors("a", [ps.payloads[0], b"not a payload"], c2,
                                                   load_format="flattened_bucket", replace=True)
            assert "TP rank 0" not in str(ei.value)
        finally:
            ps.release(require_ack=False)
        assert eng.lora_adapters["a"]["r"] == 2 and eng.lora_adapters["a"]["lora_alpha"] == 4
        assert torch.equal(eng.forward_logits(PROMPTS, lora_path="a"), before)
        after = eng.lora_rank_pieces("a")
        for rank in (0, 1):
            assert after[rank].keys() == pieces[rank].keys()
            for name, lst in pieces[rank].items():
                assert all(torch.equal(x[1], y[1]) for x, y in zip(lst, after[rank][name])), (rank, name)
        # the engine is not broken: the same adapter now loads on both ranks
        eng.load_lora_adapter_from_tensors("a", t2, c2, replace=True)
        back = eng.lora_tensors("a")
        assert all(torch.equal(back[n.removeprefix("base_model.model.")], v) for n, v in t2.items())
    finally:
        eng.unload_lora_adapter("a")


def sp(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def in_thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
    th = threading.Thread(target=run, daemon=True)
    th.start()

    def get():
        th.join(60)
        assert not th.is_alive(), "the call did not return"
        if "error" in out:
            raise out["error"]
        return out["result"]
    return get


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_retracted_rows_go_back_first_in_their_order(eng):
    """Three rows paused in place after two steps; a fourth request queues; a retract puts the
    three back before it, in their order: the step that recomputes them prefills r0, r1, r2, then
    the late one, and every row makes its lone greedy tokens."""
    prompts = [[11, 27, 93, 5], [201, 3, 64], [7, 8, 9, 10, 11], [300, 301]]
    alone = [eng.generate_requests([p], sp(6))[0]["output_ids"] for p in prompts]
    eng._pause_after_steps(2)
    first = in_thread(eng.generate_requests, prompts[:3], sp(6))
    try:
        wait_until(lambda: eng.generation_paused == "in_place")
        late = in_thread(eng.generate_requests, prompts[3:], sp(6))
        wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)
        eng.pause_generation("retract")
        assert eng.scheduler_stats()["running"] == 0 and eng.scheduler_stats()["waiting"] == 4
    finally:
        eng.continue_generation()
    res, res_late = first(), late()
    assert [r["output_ids"] for r in res + res_late] == alone
    ids = [r["request_id"] for r in res + res_late]
    recompute = [x for x in eng.step_records() if set(ids) & set(x.prefill)][-1]
    assert recompute.prefill == tuple(ids)



def test_an_aborted_waiting_row_leaves_the_queue_and_never_runs(eng):
    """A request queued while generation is paused, aborted by its caller: it ends at once, with
    no token, the queue is empty again, and once generation goes on no step runs it."""
    stop = threading.Event()
    eng.pause_generation("in_place")
    try:
        get = in_thread(lambda: eng.generate_requests([[5, 6, 7]], sp(4), should_abort=lambda k: stop.is_set()))
        wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)
        stop.set()
        res = get()
        assert res[0]["finish_reason"]["type"] == "abort" and res[0]["output_ids"] == []
        assert eng.scheduler_stats()["waiting"] == 0
    finally:
        eng.continue_generation()
    assert len(eng.generate_requests([[1, 2]], sp(3))[0]["output_ids"]) == 3
    assert not any(res[0]["request_id"] in x.rows for x in eng.step_records())
    assert eng.scheduler_stats()["kv_free"] == eng.kv_cache_tokens


def test_a_seeded_row_draws_each_token_anew(eng):
    """At temperature 1000 the distribution is near uniform over the 512 tokens: twelve draws of
    one seeded row are not one token repeated (they would be if every draw reused one generator
    state), and the same seed draws the same tokens again. Deterministic: fixed seed, fixed weights."""
    params = {"max_new_tokens": 12, "temperature": 1000.0, "sampling_seed": 7, "ignore_eos": True}
    out = eng.generate_requests([[11, 27, 93, 5]], params)[0]["output_ids"]
    assert len(set(out)) > 6, out
    assert eng.generate_requests([[11, 27, 93, 5]], params)[0]["output_ids"] == out


def test_a_distributed_update_of_another_shape_is_refused_naming_both(eng):
    from fsdp_sync.engines.reference.update_items import check_entries

    name = "model.layers.1.self_attn.q_proj.weight"
    full = tuple(eng.layout.full_shape(name))
    bad = (full[0] - 1, full[1])
    check_entries([(name, eng.dtype, full)], eng.layout, eng.dtype, None)          # taken
    with pytest.raises(WeightUpdateError, match=re.escape(f"expected shape {full} for {name!r}, got {bad}")):
        check_entries([(name, eng.dtype, bad)], eng.layout, eng.dtype, None)
    own, shard = next(iter(eng.layout.engine_shapes().items()))
    check_entries([(own, eng.dtype, tuple(shard))], eng.layout, eng.dtype, "per_rank_bucket")
    wrong = (shard[0] * 2, *shard[1:])
    with pytest.raises(WeightUpdateError, match=re.escape(f"expected shape {tuple(shard)} for {own!r} "
                                                          f"(one TP rank shard), got {wrong}")):
        check_entries([(own, eng.dtype, wrong)], eng.layout, eng.dtype, "per_rank_bucket")


def test_an_adapter_whose_replicas_differ_is_not_read_back_as_one(eng):
    """Rank 0's payload and rank 1's differ in layer 0's q_proj lora_A, which both ranks hold
    whole (column-parallel: A is replicated): the read-back names the tensor and the ranks."""
    from fsdp_sync.weights import handles
    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets
    from fsdp_sync.wire import flattened_bucket

    def payloads(t):
        metas = [TensorMeta.of(n, v) for n, v in t.items()]
        bkt = plan_buckets(metas, sum(m.nbytes for m in metas) + 64 * (len(metas) + 1))[0]
        flat = handles.empty_shared(bkt.nbytes)
        flatten(bkt, list(t.values()), out=flat)
        return handles.make_payloads(flattened_bucket(flat, bkt), 2)

    t, c = adapter(eng, 3)
    a0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    other = dict(t, **{a0: t[a0] + 1.0})
    mine, theirs = payloads(t), payloads(other)
    try:
        eng.load_lora_adapter_from_tensors("r", [mine.payloads[0], theirs.payloads[1]], c,
                                           load_format="flattened_bucket")
    finally:
        mine.release(require_ack=False)
        theirs.release(require_ack=False)
    try:
        name = a0.removeprefix("base_model.model.")
        with pytest.raises(WeightUpdateError, match=re.escape(f"TP rank 1's copy of replicated {name!r} "
                                                              f"differs from TP rank 0's")):
            eng.lora_tensors("r")
    finally:
        eng.unload_lora_adapter("r")

def test_a_worker_that_fails_to_start_says_why_naming_its_rank():
    """mem_fraction 1e-9 leaves no KV cache: the worker's own refusal reaches the caller (not a
    bare "worker died"), and the conftest's leftover check sees no process or segment left."""
    from fsdp_sync.engines import EngineError

    with pytest.raises(EngineError, match=r"TP rank 0 failed to start: mem_fraction 1e-09 of .* leaves no "
                                          r"room for a KV cache .* on TP rank 0"):
        ReferenceEngine("tiny", tp_size=1, mem_fraction=1e-9)


def test_an_interpreter_that_cannot_start_leaves_no_fd(monkeypatch):
    from fsdp_sync.engines.reference import procs

    def refuse(*a, **k):
        raise OSError(24, "Too many open files")

    monkeypatch.setenv("FSDP_SYNC_WORKERS_START", "fresh")
    monkeypatch.setattr(procs.subprocess, "Popen", refuse)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        procs.start("fsdp_sync.engines.reference.worker:serve", (), "fsdp_sync-engine-tp0")
    assert sorted(os.listdir("/proc/self/fd")) == before

