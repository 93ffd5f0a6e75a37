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


# --------------------------------------------------------------------------- the with block
class _Colocated(_Replica):
    """An engine sharing the trainer's devices, as the tensor method's: the engine-memory stages
    call it. Its sync is recorded in the same list, so the order of the wake-up is seen."""


def _block(tmp_path, *, engine=None, module=None, **cfg):
    """A manager whose transport counts as colocated and whose sync is stood in for (recorded on
    the engine as ``("sync",)``): the stages around it are the real ones."""
    engine = engine or _Colocated(39970)
    m = FSDPShardingManager(module if module is not None else _tiny(), engine,
                            config=SyncConfig(method="disk", disk_dir=str(tmp_path), memory_probe="off", **cfg))
    m.transport.colocated = True
    m._sync_weights = lambda: engine.calls.append(("sync",))
    return m, engine


@pytest.mark.parametrize("multi_stage", [True, False])
def test_wake_up_is_staged_and_the_exit_gives_every_tag_back(tmp_path, multi_stage):
    """multi_stage_wake_up: the weights, then the sync, then the KV cache (only the weights
    resident while the sync's buckets are); off: everything at once. free_cache_engine=False:
    no engine-memory call at all (the engine keeps its memory)."""
    m, eng = _block(tmp_path, multi_stage_wake_up=multi_stage)
    try:
        with m:
            inside = list(eng.calls)
        assert inside == ([("resume", ["weights"]), ("sync",), ("resume", ["kv_cache"])] if multi_stage
                          else [("resume", None), ("sync",)]), inside
        assert eng.calls[len(inside):] == [("release", ["kv_cache", "weights"])], eng.calls
    finally:
        m.close()
    m, eng = _block(tmp_path, multi_stage_wake_up=multi_stage, free_cache_engine=False)
    try:
        with m:
            pass
        assert eng.calls == [("sync",)], eng.calls
    finally:
        m.close()


def test_a_second_enter_inside_the_block_is_refused_and_changes_nothing(tmp_path):
    """Not re-entrant: a second __enter__ (or wake_up) inside the block raises before any stage:
    the engine is not resumed or synced again, the module stays in eval, the generation stream
    stays live; the block's own exit then restores everything once."""
    import asyncio

    module = _tiny()
    m, eng = _block(tmp_path, module=module)
    try:
        module.train()
        torch.manual_seed(5)
        trainer = torch.get_rng_state()
        with m:
            calls, rng = list(eng.calls), torch.get_rng_state()
            with pytest.raises(RuntimeError, match="not re-entrant: already inside its with block"):
                m.__enter__()
            with pytest.raises(RuntimeError, match="not re-entrant"):
                asyncio.run(m.wake_up())
            assert eng.calls == calls and not module.training
            assert torch.equal(torch.get_rng_state(), rng)
        assert eng.calls[len(calls):] == [("release", ["kv_cache", "weights"])], eng.calls
        assert module.training and torch.equal(torch.get_rng_state(), trainer)
    finally:
        m.close()


@pytest.mark.parametrize("stage", ["sync_weights", "offload_params", "resume_kv_cache", "swap_rng"])
def test_a_failed_entry_gives_everything_back_and_the_next_block_runs(tmp_path, monkeypatch, stage):
    """A stage that fails on entry (settled at once, or agreed with the next one) raises a
    `SyncError` naming it; before it comes out the engine's memory is released (both tags), the
    module's modes and the trainer's RNG stream are back, the offloaded parameters reloaded; and
    the next block runs every stage again (a failure kept past its block would fail every later
    one)."""
    import fsdp_sync.manager as mgr

    moves = []
    monkeypatch.setattr(mgr, "move_params", lambda module, device: moves.append(str(device)))
    module = torch.nn.Linear(4, 4, device="meta")      # a parameter off the CPU: it is offloaded
    m, eng = _block(tmp_path, module=module, offload_params=True)
    fail = {"sync_weights": "_sync_weights", "offload_params": "_offload_params",
            "resume_kv_cache": "_resume", "swap_rng": "_swap_rng"}[stage]
    real = getattr(m, fail)

    def once(*args):
        if stage != "resume_kv_cache" or args == (["kv_cache"],):
            monkeypatch.setattr(m, fail, real)
            raise ConnectionError(f"{stage} failed (injected)")
        return real(*args)

    monkeypatch.setattr(m, fail, once)
    try:
        module.train()
        torch.manual_seed(7)
        trainer = torch.get_rng_state()
        with pytest.raises(SyncError, match=f"stage '{stage}' failed.*{stage} failed \\(injected\\)"):
            with m:
                pytest.fail("the block ran after a failed entry")
        assert eng.calls[-1] == ("release", ["kv_cache", "weights"]), eng.calls
        assert module.training and torch.equal(torch.get_rng_state(), trainer)
        assert moves == ([] if stage in ("sync_weights", "offload_params") else ["cpu", "meta"]), moves
        eng.calls.clear()
        with m:
            assert not module.training
        assert eng.calls == [("resume", ["weights"]), ("sync",), ("resume", ["kv_cache"]),
                             ("release", ["kv_cache", "weights"])], eng.calls
        assert module.training and torch.equal(torch.get_rng_state(), trainer)
        assert moves[-2:] == ["cpu", "meta"], moves
    finally:
        m.close()


def test_the_exit_restores_the_modes_of_its_own_entry(tmp_path):
    """Each block records the modes at its own entry: a trainer that switched the module to eval
    between blocks (an evaluation phase) gets eval back, not the first block's train."""
    module = _tiny()
    m, _ = _block(tmp_path, module=module)
    try:
        module.train()
        with m:
            pass
        assert module.training
        module.eval()
        with m:
            pass
        assert not module.training
    finally:
        m.close()


def test_an_error_in_the_block_comes_out_as_itself_with_only_real_restore_failures_noted(tmp_path, monkeypatch):
    """The body's exception is what comes out of the block. Restoring well, nothing is noted on
    it (the exit's agree only passed it on); a failure restoring, on this rank or another, is
    noted on it, naming that rank's failure."""
    m, eng = _block(tmp_path)
    try:
        with pytest.raises(KeyError) as info:
            with m:
                raise KeyError("a rollout request failed")
        assert not getattr(info.value, "__notes__", None), info.value.__notes__
        real = m._agree

        def rank1_failed(err, *, what):
            if what != "exit":
                return real(err, what=what)
            exc = SyncError("exit failed on rank 1")
            exc.failures = {0: f"KeyError inside the with block: {err}",
                            1: "RuntimeError: release_memory_occupation on rank 1: CUDA error"}
            raise exc

        monkeypatch.setattr(m, "_agree", rank1_failed)
        with pytest.raises(KeyError) as info:
            with m:
                raise KeyError("a rollout request failed")
        assert any("exit failed on rank 1" in n for n in info.value.__notes__), info.value.__notes__
    finally:
        m.close()


# --------------------------------------------------------------------------- refusals
def test_refusals_at_construction_name_the_rank_the_index_and_the_value(tmp_path):
    """Trainer rank 0 without an engine, and a list of replicas with a None in it, are refused
    before anything is made. Before: [engine, None] was taken; every sync then failed on the
    None (AttributeError) and marked that replica as holding partly new weights."""
    cfg = SyncConfig(method="disk", disk_dir=str(tmp_path))
    for engine, said in ((None, "trainer rank 0: trainer rank 0 needs an engine handle (method 'disk'), got None"),
                         ([], "needs an engine handle (method 'disk'), got []"),
                         ([_Replica(39960), None], "trainer rank 0: engine[1] of the 2 engines is None")):
        with pytest.raises(ValueError) as info:
            FSDPShardingManager(_tiny(), engine, config=cfg)
        assert said in str(info.value), info.value


def test_an_exit_of_the_body_wins_over_an_interrupt_while_restoring(tmp_path, monkeypatch):
    """sys.exit(3) inside the block, then a Ctrl-C while the exit releases the engine's memory:
    SystemExit(3) comes out (the exit code the program asked for), the modes still restored."""
    module = _tiny()
    m, _ = _block(tmp_path, module=module)

    def pressed():
        raise KeyboardInterrupt("pressed during release_memory_occupation")

    try:
        module.train()
        monkeypatch.setattr(m, "_release", pressed)
        with pytest.raises(SystemExit) as info:
            with m:
                raise SystemExit(3)
        assert info.value.code == 3 and module.training
    finally:
        m.close()


def test_close_inside_the_block_is_refused_and_the_exit_still_gives_memory_back(tmp_path):
    m, eng = _block(tmp_path)
    with m:
        with pytest.raises(RuntimeError, match=r"close\(\) inside the with block: leave the block first"):
            m.close()
        assert m.transport is not None
    assert eng.calls[-1] == ("release", ["kv_cache", "weights"]), eng.calls
    m.close()
    with pytest.raises(RuntimeError, match="was closed"):
        with m:
            pass
    assert eng.calls[-1] == ("release", ["kv_cache", "weights"]) and eng.calls.count(("sync",)) == 1


# --------------------------------------------------------------------------- pause modes
def test_the_base_of_an_adapter_sync_continues_no_replica_before_its_adapter():
    """lora="adapter": the base's sync runs under lora_stage's hold (one pause around base and
    adapter). A replica a failed sync left paused (``stalled``) rejoins with the base: it is
    marked whole and put in service, but not continued before the adapter is loaded (the caller
    continues every replica it holds then): no request on the new base with the old adapter."""
    cfg = SyncConfig(method="distributed", memory_probe="off", pause_mode="retract",
                     on_replica_failure="quarantine")
    e0, e1 = _Replica(39951), _Replica(39952)
    m = FSDPShardingManager(_tiny(), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    m._transport_sync = lambda targets, version, step, reload=False: (fleet.take_noted(), (None, None))[1]
    try:
        rep = m.fleet.find(e1)
        m.fleet.quarantine(rep, "holds partly new weights from a failed sync")
        rep.stalled = rep.partial = rep.rejoin = True
        held = []
        m._sync_full(hold=lambda targets: held.append([t.engine for t in targets]))
        assert held == [[e0, e1]] and m.version == "0"
        assert ("continue",) not in e0.calls + e1.calls, (e0.calls, e1.calls)
        assert rep.serving and not rep.stalled and not rep.partial and rep.version == "0"
    finally:
        m.close()


def test_a_pause_failing_on_one_replica_continues_the_ones_paused_and_sends_nothing():
    """pause_generation fails on replica 1: the sync raises naming the call, the replica and the
    mode, replica 0 (paused just before) is continued, and nothing is sent."""
    cfg = SyncConfig(method="distributed", memory_probe="off", pause_mode="in_place")
    e0, e1 = _Replica(39941), _Replica(39942)

    def refuses(mode="abort"):
        raise ConnectionError("connection reset (injected)")

    e1.pause_generation = refuses
    m = FSDPShardingManager(_tiny(), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    sent = []
    m._transport_sync = lambda targets, version, step, reload=False: sent.append(version)
    try:
        with pytest.raises(SyncError, match=r"pause_generation\(mode='in_place'\) on replica 1 .*connection reset"):
            m._sync_full()
        assert e0.calls == [("pause", "in_place"), ("continue",)] and sent == [], (e0.calls, sent)
        assert m.version is None
    finally:
        m.close()


def test_a_sync_that_every_replica_failed_commits_no_version_under_quarantine():
    """on_replica_failure="quarantine": every replica stopped answering during the sync. Nothing
    is left to sync again: the sync fails naming them, no second attempt goes to an empty
    fleet, and the manager publishes no version nobody holds."""
    cfg = SyncConfig(method="distributed", memory_probe="off", on_replica_failure="quarantine")
    e0, e1 = _Replica(39921), _Replica(39922)
    m = FSDPShardingManager(_tiny(), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    attempts = []

    def sync(targets, version, step, reload=False):
        fleet.take_noted()
        attempts.append([t.engine for t in targets])
        for e in (e0, e1):
            e.dead_reason = lambda: "worker 0 died (injected)"
        return SyncError("update_weights_from_distributed failed"), SimpleNamespace(commit_failed=None)

    m._transport_sync = sync
    try:
        with pytest.raises(SyncError, match=r"no replica committed version '0'.*replica 0.*replica 1"):
            m._sync_full()
        assert attempts == [[e0, e1]] and m.version is None
        assert [r["serving"] for r in m.fleet_status()["replicas"]] == [False, False]
    finally:
        m.close()
