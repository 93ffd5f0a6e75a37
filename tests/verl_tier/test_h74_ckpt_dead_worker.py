"""fsdp_sync's verl checkpoint engine when a rollout worker's process dies (audit H74, item c).

The manager's calls in its order, one process per worker (`test_verl_checkpoint_engine.Workers`:
2 actor ranks, 2 rollout workers). One sync goes through; at the next, rollout worker 1 is killed
after joining the group and before the weights move. The sender's broadcast fails (gloo sees the
socket close), and its error now names the worker: rollout worker 1, group rank 2, its host and
pid, and how many buckets it and the others took. Before, it was gloo's message alone (a peer
address, no worker). Actor rank 1 walks the stream to its end; rollout worker 0 fails at once, as
the sender drops the group (before: at its timeout_s, 600 s by default, holding verl's step).
"""

from __future__ import annotations

import re
import socket
from multiprocessing.connection import wait as mp_wait

import pytest

from fsdp_sync.integrations.verl.checkpoint_engine import FsdpSyncCheckpointEngine
from test_verl_checkpoint_engine import BUCKET, Workers, sync_like_the_manager

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]


def test_a_rollout_worker_that_died_is_named_by_the_sender():
    w = Workers()
    try:
        w.call(w.actors, "new", [{"bucket_size": BUCKET, "is_master": True, "timeout_s": 120},
                                 {"bucket_size": BUCKET, "timeout_s": 120}])
        w.call(w.rollouts, "new", [{"bucket_size": BUCKET, "timeout_s": 120}] * 2)
        answers = sync_like_the_manager(w, 1)
        assert all(answers[i][0][0] == "ok" for i in w.rollouts), answers
        everyone = w.actors + w.rollouts
        meta = [r[1] for r in w.call(everyone, "call", [{"method": "prepare"}] * 4)]
        actor_kw, rollout_kw = FsdpSyncCheckpointEngine.build_topology(2, 2, meta)
        kws = [{k: v[i] for k, v in actor_kw.items()} for i in range(2)] + \
              [{k: v[i] for k, v in rollout_kw.items()} for i in range(2)]
        inits = w.call(everyone, "call", [dict(kw, method="init_process_group") for kw in kws])
        assert all(r[0] == "ok" for r in inits), inits
        dead = w.procs[w.rollouts[1]]
        pid = dead.pid
        dead.kill()
        dead.join(10)
        for i in w.actors:
            w.conns[i].send(("send", {"step": 2}))
        w.conns[w.rollouts[0]].send(("recv", {"step": 2}))
        waiting = {w.conns[i]: i for i in w.actors + w.rollouts[:1]}
        got = {}
        while waiting:
            ready = mp_wait(list(waiting), timeout=120)
            assert ready, f"workers {sorted(waiting.values())} hung"
            for c in ready:
                got[waiting.pop(c)] = c.recv()
        sent = got[0]
        assert sent[0] == "err", sent
        assert sent[1].startswith("RuntimeError: fsdp_sync checkpoint engine: the sender (actor "
                                  "rank 0) failed at bucket "), sent
        assert re.search(rf"; rollout worker 1 \(group rank 2, host {re.escape(socket.gethostname())}, "
                         rf"pid {pid}\) never began receiving this sync, the others took \d+: that "
                         rf"worker's process died", sent[1]), sent
        assert "rollout worker 0 " not in sent[1], sent
        assert got[1] == ("ok", None)             # actor rank 1 walked the stream to its end
        # rollout worker 0: told as the sender drops the group, not at its timeout_s (120 s)
        healthy = got[w.rollouts[0]]
        assert healthy[0] == "err" and healthy[1].startswith(
            "RuntimeError: fsdp_sync checkpoint engine: rank 1: receiving from the sender (actor "
            "rank 0) failed: "), healthy
        # not gloo's timeout: the sender's socket closing, which gloo reports as "closed" or, where
        # its read meets the reset first, "reset" (each seen on one host, run after run)
        assert re.search(r"Connection (closed|reset) by peer", healthy[1]), healthy
        assert "Timed out" not in healthy[1] and "timeout" not in healthy[1].lower(), healthy
    finally:
        w.close()


def test_the_board_names_the_workers_behind_the_others_and_no_one_when_all_are_even():
    """A consumer that stopped without closing its iterator (its receive thread holds two buckets
    and takes no more) stays behind the workers the sender still serves."""
    import torch.distributed as dist

    from fsdp_sync.integrations.verl.checkpoint_engine import _Board

    store = dist.HashStore()
    boards = [_Board(store, "g", r, 4) for r in range(4)]
    for b, n in zip(boards[1:], (7, 3, 7)):
        b.store.set(f"who/{b.rank}", f"host h{b.rank}, pid {b.rank}")
        b.took(n)
    assert boards[0].behind(0.0).startswith(
        "rollout worker 1 (group rank 2, host h2, pid 2) took 3 bucket(s) of this sync, the others "
        "took 7: ")
    boards[2].took(7)
    assert boards[0].behind(0.0) is None
    for b in boards:          # the next sync on the group: counted afresh
        b.next_sync()
    boards[1].took(0)
    assert boards[0].behind(0.0).startswith(
        "rollout worker 1 (group rank 2, host h2, pid 2) never began receiving this sync; rollout "
        "worker 2 (group rank 3, host h3, pid 3) never began receiving this sync, the others took 0: ")
