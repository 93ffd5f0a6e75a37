"""A trainer rank that fails to make its part of a call (its handles: a full /dev/shm; a copy into
a buffer of the sync: a CUDA out-of-memory; a caller's generator) after the bucket's collectives
ran, while the other ranks wait for it in the call's gather (`transport.unmade`).

Before (H70's audit: two gloo ranks, the tiny model, a reference engine at TP 2, 16 KiB buckets,
`handles.make_payloads` raising for bucket 2 on rank 1 only): rank 1 left the send loop for its
stage's closing agree (an all-reduce) while rank 0 waited in bucket 2's gather: both blocked until
the 15 s group timeout and raised different raw gloo errors; with per-rank buckets they were still
blocked at the job's 60 s deadline. Now rank 1 sends a stand-in to the gather and its error to the
call's agree: rank 0 calls no engine for that call, releases its own payload unopened, and both
ranks raise the same `SyncError` naming rank 1's error; the update is aborted, not committed.

In process: two threads as infer-TP ranks 0 and 1 of one group (`TensorTransport.send`, the loop
`sync` runs too), the gather, broadcast and agree answered as two ranks' would be; the payloads
are real handle tuples in this process's shared memory (so a payload left unreleased shows)."""

from __future__ import annotations

import os
import threading
import types

import pytest
import torch

from fsdp_sync.engines.base import SerializedPerRank
from fsdp_sync.topology import SyncError
from fsdp_sync.transport import SyncStats, tensor as tensor_mod, unmade
from fsdp_sync.transport.call_times import CallTimes
from fsdp_sync.transport.tensor import Call, TensorTransport
from fsdp_sync.weights import handles

pytestmark = pytest.mark.timeout(60)


class _Engine:
    def __init__(self) -> None:
        self.log: list = []
        self.held: list[torch.Tensor] = []

    def begin_weight_update(self) -> None:
        self.log.append("begin")

    def end_weight_update(self, weight_version=None, abort=False) -> bool:
        self.log.append("abort" if abort else "commit")
        return True

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True) -> None:
        (name, value), = named
        self.log.append(name)
        for rank, p in enumerate(value.values):
            rec = handles.open_payload(p, rank)
            self.held.append(rec.value.clone())
            rec.ack()


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def _two_ranks(monkeypatch, fail_on: int | None, fail_at: int, path: str = "send", n_calls: int = 3):
    """``n_calls`` one-tensor calls on two threads (infer-TP ranks 0 and 1), by ``path``: ``send``
    (the loop `sync` runs too: one call gathered, loaded and agreed at a time) or ``pipelined``
    (call k+1 gathered while the engine loads call k); rank ``fail_on`` fails making call
    ``fail_at``. Returns (what each rank raised or None, engine)."""
    barrier = threading.Barrier(2, timeout=20)
    me = threading.local()
    box: list = [None, None]

    def exchange(value):
        box[me.rank] = value
        barrier.wait()
        out = list(box)
        barrier.wait()
        return out

    def gather_to_src(obj, topo):
        out = exchange(obj)
        return out if topo.is_tp_src else None

    def broadcast_from_src(obj, topo):
        return exchange(obj)[0]

    def agree(error, group=None, *, what="sync", digest=None):
        texts = exchange(None if error is None else str(error))
        failed = [r for r, t in enumerate(texts) if t is not None]
        if failed:
            err = SyncError(f"{what} failed on rank {failed[0]}: {texts[failed[0]]}")
            err.failures = {r: texts[r] for r in failed}
            raise err

    monkeypatch.setattr(tensor_mod, "gather_to_src", gather_to_src)
    monkeypatch.setattr(tensor_mod, "broadcast_from_src", broadcast_from_src)
    monkeypatch.setattr(tensor_mod, "agree", agree)
    engine = _Engine()
    raised: list = [None, None]

    def calls(rank):
        for i in range(n_calls):
            if rank == fail_on and i == fail_at:
                raise OSError(28, "No space left on device (injected: /dev/shm full)")
            t = torch.full((64,), float(10 * i + rank))
            sets = [handles.make_payloads(t, 2, ranks=[rank], tagged=True)]
            yield Call(sets, sets[0].payloads[0],
                       lambda g, _i=i: [(f"w{_i}", SerializedPerRank(values=list(g)))], None,
                       i == n_calls - 1, f"tensor 'w{i}'")

    def run(rank):
        me.rank = rank
        topo = types.SimpleNamespace(is_tp_src=rank == 0, tp_size=2, tp_rank=rank, tp_src=0,
                                     describe=lambda: f"rank {rank}/2 (dp 0/1, infer_tp {rank}/2)")
        try:
            tt = TensorTransport()
            if path == "send":
                tt.send(calls(rank), topo=topo, engine=engine if rank == 0 else None)
            else:       # as `sync` sets it up for per-rank buckets (no update bracket here)
                tt.topo, tt.engine, tt.stats, tt._unacked = topo, engine if rank == 0 else None, SyncStats(), None
                tt._times = CallTimes(tt.stats)
                tt._run_pipelined(unmade.made(calls(rank), topo, Call))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            raised[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting for the other"
    return raised, engine


@pytest.mark.parametrize("path", ["send", "pipelined"])
@pytest.mark.parametrize("fail_on,fail_at", [(1, 1), (0, 1), (1, 0), (1, 2)])
def test_a_rank_that_cannot_make_its_payload_fails_every_rank_at_that_call(monkeypatch, fail_on,
                                                                           fail_at, path):
    before = _segments()
    raised, engine = _two_ranks(monkeypatch, fail_on=fail_on, fail_at=fail_at, path=path)
    for rank, exc in enumerate(raised):
        assert isinstance(exc, SyncError), (rank, repr(exc))
        assert "No space left on device (injected" in str(exc), (rank, str(exc))
        assert f"infer_tp {fail_on}/2" in str(exc), (rank, str(exc))
    assert str(raised[0]) == str(raised[1])
    # the calls before it loaded bit-exact from both ranks, nothing of it or after it reached
    # the engine; the update aborted, not committed
    loaded = [f"w{i}" for i in range(fail_at)]
    assert engine.log == (["begin", *loaded, "abort"] if path == "send" else loaded), engine.log
    assert [t[0].item() for t in engine.held] == [float(10 * i + r) for i in range(fail_at) for r in (0, 1)]
    # the other rank's payload of call 1 was released (unopened): nothing left in /dev/shm
    assert _segments() <= before, sorted(_segments() - before)


@pytest.mark.parametrize("path", ["send", "pipelined"])
def test_every_call_made_loads_every_call_and_commits(monkeypatch, path):
    raised, engine = _two_ranks(monkeypatch, fail_on=None, fail_at=0, path=path)
    assert raised == [None, None], raised
    calls = ["w0", "w1", "w2"]
    assert engine.log == (["begin", *calls, "commit"] if path == "send" else calls), engine.log
    assert [t[0].item() for t in engine.held] == [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]
