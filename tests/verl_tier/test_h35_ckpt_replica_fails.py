"""fsdp_sync's verl checkpoint engine when one rollout worker stops mid-stream (audit H35).

In process: the engine's sender and receivers over a stand-in for the group's broadcast that, as
gloo's does, waits for every receiver to take each message (a queue of one per receiver; a
sender kept waiting ``WIRE_S`` fails as gloo's send times out). Each receiver's consumer runs in a
thread of its own, as each rollout worker is a process of its own.

- A consumer that fails after its first tensor (verl's own SGLang adapter loading bucket by
  bucket, whose engine refused one), taken with ``for`` and with ``async for``: that worker raises
  its consumer's error, the sender ends, and the other worker gets the whole stream bit-exact.
  Before, the failed worker's receive thread stopped taking buckets: the sender waited out
  ``timeout_s`` (600 s by default) and failed with gloo's timeout, naming no worker, and the
  healthy worker failed too ("received no bucket within timeout_s"), after loading part of it.
- A whole sync through the stand-in: names, order, dtypes, shapes and bits.
- A worker asked for another step than the sender's refuses it naming both; the others finish.
- Two syncs in a row on one group, an actor rank out of the group walking the stream, a sender
  that fails mid-stream; each side refusing the other's call; a second master.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import types

import pytest
import torch

import ckpt_roles

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

BUCKET = ckpt_roles.BUCKET_MB << 20
NAMES = [n for n, _, _ in ckpt_roles.SPECS]
WIRE_S = 30.0     # how long the stand-in's sender waits for a receiver to take a message


class _Work:
    def __init__(self, then=None) -> None:
        self.then = then

    def wait(self) -> None:
        if self.then is not None:
            self.then, then = None, self.then
            then()


class _Pg:
    """One member's handle on the stand-in group: rank 0 sends, rank r > 0 reads queue r - 1."""

    def __init__(self, queues: list, rank: int) -> None:
        self.queues, self.rank = queues, rank


def _broadcast(tensor, group_src=0, group=None, async_op=False):
    """An async send reads its tensor when it is waited for (the latest a backend may): a sender
    that refilled the buffer meanwhile would send the refill."""
    assert group_src == 0
    if group.rank == 0:
        def send():
            data = tensor.clone()
            for r, q in enumerate(group.queues, start=1):
                try:
                    q.put(data, timeout=WIRE_S)
                except queue.Full:
                    raise RuntimeError(f"stand-in gloo: timed out waiting {WIRE_S}s for send to "
                                       f"rank {r}") from None
        if async_op:
            return _Work(send)
        send()
    else:
        got = group.queues[group.rank - 1].get(timeout=WIRE_S)
        tensor.copy_(got)
    return _Work() if async_op else None


@pytest.fixture
def group(monkeypatch):
    """(sender engine, [receiver engines]) joined over the stand-in, as after init_process_group."""
    from fsdp_sync.integrations.verl import checkpoint_engine as ce

    monkeypatch.setattr(ce, "dist", types.SimpleNamespace(broadcast=_broadcast))

    def make(n_rollout: int = 2, timeout_s: float = 30.0):
        queues = [queue.Queue(maxsize=1) for _ in range(n_rollout)]
        engines = []
        for rank in range(1 + n_rollout):
            e = ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, is_master=rank == 0,
                                            timeout_s=timeout_s, device="cpu")
            e.pg, e.rank, e.world_size = _Pg(queues, rank), rank, 1 + n_rollout
            e.held = {"group_name": "g", "rank": rank, "world_size": 1 + n_rollout}
            engines.append(e)
        return engines[0], engines[1:]

    return make


def _run(sender, receivers, consumers, step=1, recv_steps=None, weights=None):
    """The sync's step 5: send on one thread, each receiver's consumer on its own; what each
    returned or raised."""
    out: dict = {}

    def go(key, fn):
        try:
            out[key] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[key] = ("err", exc)

    weights = ckpt_roles.stream(step) if weights is None else weights
    threads = [threading.Thread(target=go, args=("send", lambda: asyncio.run(
        sender.send_weights(weights, global_steps=step))))]
    for i, (e, consume) in enumerate(zip(receivers, consumers)):
        rs = step if recv_steps is None else recv_steps[i]
        threads.append(threading.Thread(target=go, args=(i, lambda e=e, c=consume, rs=rs: c(
            e.receive_weights(global_steps=rs)))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return out


def _all_with_for(received):
    return [(n, t) for n, t in received]


def _all_with_async_for(received):
    return asyncio.run(ckpt_roles.consume(received))


def _fail_after_one_with_for(received):
    for n, _t in received:
        raise ValueError(f"the engine refused {n}")


def _fail_after_one_with_async_for(received):
    async def go():
        async for n, _t in received:
            raise ValueError(f"the engine refused {n}")
    return asyncio.run(go())


@pytest.mark.parametrize("failing", [_fail_after_one_with_for, _fail_after_one_with_async_for],
                         ids=["for", "async_for"])
def test_a_rollout_worker_whose_consumer_fails_mid_stream_lets_the_others_finish(group, failing):
    sender, receivers = group()
    out = _run(sender, receivers, [failing, _all_with_async_for])
    status, err = out[0]
    assert status == "err" and isinstance(err, ValueError), out[0]
    assert str(err) == f"the engine refused {NAMES[0]}"       # its own error, not a timeout
    assert out["send"][0] == "ok", out["send"]
    assert out["send"][1]["checkpoint_engine/fsdp_sync/tensors"] == len(NAMES)
    status, got = out[1]
    assert status == "ok", out[1]
    report = ckpt_roles.check(got, 1)
    assert report["names"] == NAMES and report["bad"] == []
    # the worker that failed makes its group anew at the next sync; the others keep theirs
    assert receivers[0].failed and receivers[0].prepare()["held"] is None
    assert not receivers[1].failed and receivers[1].prepare()["held"] is not None
    assert not sender.failed


def test_a_whole_sync_through_the_stand_in_is_bit_exact_for_every_worker(group):
    sender, receivers = group(n_rollout=3)
    out = _run(sender, receivers, [_all_with_for, _all_with_async_for, _all_with_for], step=4)
    assert out["send"][0] == "ok", out["send"]
    metrics = out["send"][1]
    assert metrics["checkpoint_engine/fsdp_sync/tensors"] == len(NAMES)
    # 11 tensors, 5.9 MiB: two larger than the 1 MiB bucket go alone, the rest packed
    assert metrics["checkpoint_engine/fsdp_sync/buckets"] == 8, metrics
    for i in range(3):
        status, got = out[i]
        assert status == "ok", out[i]
        report = ckpt_roles.check(got, 4)
        assert report["names"] == NAMES and report["bad"] == [], report
        assert receivers[i].last_stats["tensors"] == len(NAMES)
        assert not receivers[i].failed


def test_a_receiver_asked_for_another_step_refuses_it_naming_both_and_the_others_finish(group):
    sender, receivers = group()
    # worker 0 (group rank 1) is asked for step 6, the sender sends step 5; worker 1 for step 5
    out = _run(sender, receivers, [_all_with_for, _all_with_for], step=5, recv_steps=[6, 5])
    status, err = out[0]
    assert status == "err" and "rank 1 expected the weights of step 6, the sender sent step 5" \
        in str(err), out[0]
    assert out["send"][0] == "ok" and out[1][0] == "ok", (out["send"], out[1])
    assert ckpt_roles.check(out[1][1], 5)["bad"] == []
    assert receivers[0].failed and not receivers[1].failed


def test_two_syncs_on_one_group_and_a_failing_sender_tells_every_worker(group):
    """Each sync's receive thread ends at its last bucket (one still listening would take the
    next sync's first header); an actor rank out of the group walks the stream and sends nothing;
    a sender failing mid-stream ends every worker with its message."""
    from fsdp_sync.integrations.verl import checkpoint_engine as ce

    sender, receivers = group()
    walker = ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu")
    walker.rank, walker.world_size = -1, 3
    for step in (1, 2):
        out = _run(sender, receivers, [_all_with_for, _all_with_async_for], step=step)
        assert out["send"][0] == "ok", out["send"]
        for i in range(2):
            assert out[i][0] == "ok", out[i]
            assert ckpt_roles.check(out[i][1], step)["bad"] == []
        walked = []
        assert asyncio.run(walker.send_weights(
            (walked.append(n) or (n, t) for n, t in ckpt_roles.weights(step)), step)) is None
        assert walked == NAMES
    # the failing sync: each weight is a collective over the actor ranks (a barrier of the
    # sender's stream and the out-of-group actor's), so the sender walks its stream to the end
    # after the failure, or the other actor rank waits there
    barrier = threading.Barrier(2, timeout=WIRE_S)

    def collective(weights):
        for item in weights:
            barrier.wait()
            yield item

    walked = []

    def walk():
        asyncio.run(walker.send_weights(
            (walked.append(n) or (n, t) for n, t in collective(ckpt_roles.stream(3, bad_at=5))), 3))

    other = threading.Thread(target=walk)
    other.start()
    out = _run(sender, receivers, [_all_with_for, _all_with_async_for], step=3,
               weights=collective(ckpt_roles.stream(3, bad_at=5)))
    other.join(60)
    assert not other.is_alive() and not barrier.broken
    assert walked == NAMES[:5] + ["model.bad.weight"] + NAMES[5:]
    status, err = out["send"]
    assert status == "err" and "complex64" in str(err), out["send"]
    for i in range(2):
        status, err = out[i]
        assert status == "err" and "the sender (actor rank 0) failed" in str(err) and \
            "model.bad.weight" in str(err), out[i]
        assert receivers[i].failed
    assert sender.failed


def test_a_rollout_worker_or_a_second_master_is_refused_its_wrong_side():
    from fsdp_sync.integrations.verl import checkpoint_engine as ce

    e = ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu")
    e.rank, e.world_size = 1, 3
    with pytest.raises(RuntimeError, match="send_weights on group rank 1; only actor rank 0"):
        asyncio.run(e.send_weights(iter(ckpt_roles.weights(1))))
    e.rank = 0
    with pytest.raises(RuntimeError, match="receive_weights on group rank 0; rollout workers"):
        e.receive_weights()
    master = {"address": "a", "port": 1, "group_name": "g", "device_type": "cpu", "bucket_size": 1}
    meta = [{"master": master}, {"master": None}, {"master": dict(master)}]
    with pytest.raises(ValueError, match=r"actor rank 0, and only it.*reporting a master: \[0, 2\]"):
        ce.FsdpSyncCheckpointEngine.build_topology(1, 2, meta)
    with pytest.raises(ValueError, match="timeout_s must be positive, got -1"):
        ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, timeout_s=-1)


def test_rebuild_group_destroys_the_group_at_finalize_and_never_offers_it(monkeypatch):
    """``engine_kwargs.fsdp_sync.rebuild_group=true``: the group goes at every finalize (its
    connections and, on CUDA, NCCL's buffers are not held while the rollout runs), and prepare
    offers none even while one is held."""
    from fsdp_sync.integrations.verl import checkpoint_engine as ce

    destroyed = []
    monkeypatch.setattr(ce, "destroy_update_group", destroyed.append)
    e = ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu", rebuild_group=True)
    pg = object()
    e.pg, e.held = pg, {"group_name": "g", "rank": 1, "world_size": 2}
    assert e.prepare()["held"] is None
    e.finalize()
    assert destroyed == [pg] and e.pg is None and e.held is None
    # a worker whose last sync failed starts the next one clean: its new group is offered after
    e.failed = True
    e.init_process_group(rank=-1, world_size=3, master={})
    assert not e.failed
