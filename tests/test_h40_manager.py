"""Mutation pass and audit (H40) over manager.py, manager_pause.py, manager_rng.py and
manager_fleet.py: the ``with`` block around a rollout and the fleet's commit. In-process, one
trainer rank (another rank's view simulated where the decision is rank 0's), engines stubbed
where only the manager's bookkeeping is under test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
from fsdp_sync.fleet import CommitError, Fleet
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(60)


class _Replica:
    """A disaggregated replica: its own probe (`fleet.problem`) says it is alive; records calls."""

    def __init__(self, port: int) -> None:
        self.base_url, self.calls = f"http://127.0.0.1:{port}", []

    def dead_reason(self):
        return None

    def get_weight_version(self):
        return "default"

    def set_serving(self, serving, reason=""):
        self.calls.append(("set_serving", serving))

    def pause_generation(self, mode="abort"):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))


def _tiny():
    """A module to sync: its weights are never read where the transport is stood in for."""
    return torch.nn.Linear(4, 4)


def test_after_a_commit_failure_no_rank_syncs_again():
    """on_replica_failure="quarantine", two replicas: replica 1 failed committing version '0',
    replica 0 committed it. Only trainer rank 0's transport sees the commit failure
    (``ctx.commit_failed``); the other ranks read None there and synced again, alone, while rank
    0 went on: with two real ranks (distributed and disk) they waited in collectives rank 0 never
    reached, until the process-group timeout, each rank then raising a different raw gloo error
    (rank 1's manager.version None, rank 0's '0'). Now every rank follows rank 0's decision: no
    second attempt anywhere, version '0' on both."""
    cfg = SyncConfig(method="distributed", memory_probe="off", on_replica_failure="quarantine")
    e0, e1 = _Replica(39981), _Replica(39982)
    ranks = [FSDPShardingManager(_tiny(), [e0, e1], config=cfg),
             FSDPShardingManager(_tiny(), [_Replica(39983)], config=cfg)]
    ranks[1].rank, ranks[1].fleet = 1, Fleet([])       # trainer rank 1: it holds no replica
    said: list = []                                    # what rank 0 broadcast (`_from_rank0`)
    ranks[0]._from_rank0 = lambda obj: (said.append(obj), obj)[1]
    ranks[1]._from_rank0 = lambda obj: said.pop(0)
    attempts = {0: 0, 1: 0}

    def transport(rank):
        def sync(targets, version, step, reload=False):
            fleet.take_noted()
            attempts[rank] += 1
            if attempts[rank] > 1:
                return None, SimpleNamespace(commit_failed=None)
            failed = CommitError([0], {1: ConnectionError("commit lost (injected)")}, version)
            return SyncError(f"committing the update: {failed}"), SimpleNamespace(
                commit_failed=failed if rank == 0 else None)      # the transport's, rank 0 alone
        return sync

    try:
        for rank, m in enumerate(ranks):
            m._check_coverage = lambda: None
            m._transport_sync = transport(rank)
            m._sync_full()
        assert attempts == {0: 1, 1: 1}, attempts
        assert [m.version for m in ranks] == ["0", "0"]
        assert [(r["serving"], r["version"]) for r in ranks[0].fleet_status()["replicas"]] == [
            (True, "0"), (False, None)]
    finally:
        for m in ranks:
            m.close()
