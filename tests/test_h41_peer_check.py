"""`integrations.peer_check` in process: ranks are threads over one in-memory store (torch's
HashStore, as the default group's TCPStore answers the same calls), each with its own rank.

- `check_group` (untested outside the verl tier before): every rank of the group checking returns;
  at the next check a rank that does not come is named, by its rank in the group and its global
  rank, on every rank that came (mutant: a peer one check behind counted as there);
- `absent_ranks`: where a missing rank never said it runs fsdp_sync's adapter, the ranks decide
  after ``grace_s`` even if another missing rank did say so (it is late; the answer is "walk verl's
  stream" either way): mutant ``any`` -> ``all`` waited for the late one up to ``timeout_s``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from fsdp_sync.integrations import peer_check

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world(monkeypatch):
    """``run(rank, fn)``: ``fn()`` as global rank ``rank`` in a thread of its own; ``me(rank)``:
    the calling thread is that rank."""
    store = dist.HashStore()
    local = threading.local()
    monkeypatch.setattr(peer_check, "_store", lambda: store)
    monkeypatch.setattr(peer_check, "dist", SimpleNamespace(
        get_rank=lambda: local.rank, is_available=lambda: True, is_initialized=lambda: True))

    def me(rank):
        local.rank = rank

    def run(rank, fn):
        out: dict = {}

        def body():
            me(rank)
            try:
                out["value"] = fn()
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out["error"] = exc

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t, out

    return SimpleNamespace(run=run, me=me, store=store)


def test_check_group_names_the_rank_that_does_not_come_to_the_next_check(world):
    ranks = [4, 7, 9]                      # global ranks; group ranks 0, 1, 2
    first = [world.run(r, lambda: peer_check.check_group(ranks, 60)) for r in ranks]
    for t, out in first:
        t.join(60)
        assert out == {"value": None}, out
    # the next check: global rank 9 runs another adapter now (never comes)
    second = [world.run(r, lambda: peer_check.check_group(ranks, 0.3)) for r in (4, 7)]
    for (t, out), r, group_rank in zip(second, (4, 7), (0, 1)):
        t.join(60)
        err = out.get("error")
        assert isinstance(err, RuntimeError), out
        said = str(err)
        # (rank 7 may be named too where its thread started late: not what is checked here)
        assert said.startswith(f"fsdp_sync's verl adapter on infer-TP rank {group_rank} (global rank {r}): "), said
        assert "infer-TP rank 2 (global rank 9) did not start fsdp_sync's adapter within 0.3 s" in said, said
        assert "VERL_USE_EXTERNAL_MODULES" in said, said


def test_absent_ranks_decides_after_the_grace_when_any_missing_rank_never_announced(world):
    ranks = [0, 1, 2]
    world.me(1)
    peer_check.announce()                   # rank 1 runs fsdp_sync's adapter, but comes late
    t, out = world.run(0, lambda: peer_check.absent_ranks(ranks, 60, grace_s=0.05))
    t.join(30)                              # rank 2 never announced: decided after the grace
    world.me(1)
    late = peer_check.absent_ranks(ranks, 60, grace_s=0.05)    # reads the round's decision
    t.join(60)
    assert out == {"value": [1, 2]} and late == [1, 2], (out, late)
