"""`integrations.module_stream` cases H41's mutation pass found unpinned (in process, no ranks):

- a failure mid-stream (the adapter's per-tensor step raising on the second bucket) closes the
  module's export at once, while the error is still held: its buffers (a host-shared segment every
  rank maps) do not wait for the error to be dropped (mutant: ``it.close()`` dropped survived:
  the suspended export stayed alive in the traceback's frame);
- the sync's calls are the module's buckets, in export order, each tensor once, bit for bit;
- `agreed` names the FIRST rank that refused, the same text on every rank (mutant: the last).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.integrations import module_stream
from fsdp_sync.transport import SyncStats
from fsdp_sync.weights import export
from fsdp_sync.weights.bucket import plan_buckets


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))


def _calls(module, prepare):
    sync = SimpleNamespace(bucket_bytes=20 << 10, dtype=None, share_host_memory=False)
    plan = plan_buckets(export.param_metas(module, None), sync.bucket_bytes)
    assert len(plan) == 2, [b.names for b in plan]
    topo = SimpleNamespace(tp_size=1, tp_rank=0)
    return plan, module_stream._ModuleCalls(module, plan, sync, topo, SyncStats(),
                                             {"export_s": 0.0}, prepare)


def _done(call):
    """What the send loop does once the engine answered a call: its payloads released, then its
    buffer given back for the next bucket."""
    for ps in call.sets:
        ps.release(unopened=[0])       # no engine opened it (it would have)
    call.on_release()


def test_the_calls_are_the_modules_buckets_in_order_bit_for_bit():
    module = _module()
    sent: list = []
    plan, calls = _calls(module, lambda name, t: sent.append((name, t.clone())))
    got = 0
    for call in calls:
        _done(call)
        got += 1
    assert got == len(plan)
    assert [n for n, _ in sent] == [m.name for m in export.param_metas(module, None)]
    want = dict(module.state_dict())
    assert all(torch.equal(t, want[n]) for n, t in sent)


def test_a_failure_mid_stream_closes_the_export_while_the_error_is_held(monkeypatch):
    closed: list = []
    real = export.iter_buckets

    def watched(*args, **kwargs):
        try:
            yield from real(*args, **kwargs)
        finally:
            closed.append(True)

    monkeypatch.setattr(export, "iter_buckets", watched)

    def prepare(name, t):
        if name == "1.weight":          # the second bucket's first tensor
            raise RuntimeError("the verify record failed")

    plan, calls = _calls(_module(), prepare)
    assert plan[1].names[0] == "1.weight", [b.names for b in plan]
    _done(next(calls))
    try:
        next(calls)
    except RuntimeError as exc:
        held = exc                      # the traceback holds the calls' frame
    assert str(held) == "the verify record failed"
    calls.close()                       # as the send loop does once the failure is agreed
    assert closed == [True], "the module's export is still open while the error is held"
    del held


def _counted(monkeypatch):
    """``export.iter_buckets`` counting what it yields."""
    pulled: list = []
    real = export.iter_buckets

    def counted(*args, **kwargs):
        for item in real(*args, **kwargs):
            pulled.append(item[0].names[0])
            yield item

    monkeypatch.setattr(export, "iter_buckets", counted)
    return pulled


@pytest.mark.parametrize("taken", [0, 1])
def test_calls_closed_before_their_end_walk_the_rest_of_the_export(monkeypatch, taken):
    """A sync that failed after ``taken`` calls (at an engine, an agreement, before its first
    call): every bucket is an all-gather over every trainer rank, which other replicas' ranks walk
    with their own syncs, so the rest is walked (dropped) on close; after a full sync, nothing."""
    pulled = _counted(monkeypatch)
    plan, calls = _calls(_module(), lambda name, t: None)
    for _ in range(taken):
        _done(next(calls))
    calls.close()
    assert pulled == [b.names[0] for b in plan]
    calls.close()                       # once
    assert len(pulled) == len(plan)
    plan, calls = _calls(_module(), lambda name, t: None)
    for call in calls:
        _done(call)
    calls.close()
    assert len(pulled) == 2 * len(plan)


def test_calls_whose_pull_failed_walk_nothing_more(monkeypatch):
    """A pull that raised is the collective that broke: nothing more is walked on close."""
    real = export.iter_buckets
    pulls: list = []

    class Failing:      # its second pull raises; a third would go on (a walk would take it)
        def __init__(self, *args, **kwargs):
            self.gen = real(*args, **kwargs)

        def __next__(self):
            pulls.append(len(pulls))
            if len(pulls) == 2:
                raise RuntimeError("the all-gather of bucket 1 failed")
            return next(self.gen)

        def __iter__(self):
            return self

        def close(self):
            self.gen.close()

    monkeypatch.setattr(export, "iter_buckets", Failing)
    plan, calls = _calls(_module(), lambda name, t: None)
    _done(next(calls))
    with pytest.raises(RuntimeError, match="bucket 1 failed"):
        next(calls)
    calls.close()
    assert pulls == [0, 1], pulls


def test_agreed_names_the_first_rank_that_refused(monkeypatch):
    """Rank 2 of 3 sees ranks 0 and 2 refuse: the text names rank 0, whatever this rank's own."""
    reasons = ["strategy='bucketed'", None, "QAT is on"]

    def all_reduce(flag, op=None, group=None):
        flag.copy_(torch.tensor([1, 0, 0]))          # some rank refused; no digests

    def all_gather_object(out, obj, group=None):
        out[:] = reasons

    monkeypatch.setattr(module_stream, "cpu_group", lambda g: g)
    for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True,
                     "get_world_size": lambda group=None: 3, "all_reduce": all_reduce,
                     "all_gather_object": all_gather_object}.items():
        monkeypatch.setattr(module_stream.dist, name, fn)
    assert module_stream.agreed("QAT is on") == "rank 0: strategy='bucketed'"
    assert module_stream.agreed(None) == "rank 0: strategy='bucketed'"   # a rank that did not refuse
