"""Mutation pass (H10) over manager.py, manager_pause.py, memory.py, topology.py: the tests that
killed a mutant no other test did. In-process, engines stubbed where only the manager's
bookkeeping is under test."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, fleet
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(60)


class _Remote:
    """A disaggregated replica (another machine's GPUs): records every call made to it."""

    base_url = "http://127.0.0.1:39997"

    def __init__(self):
        self.calls = []

    def get_weight_version(self):
        return "default"

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def set_serving(self, serving, reason=""):
        pass


@pytest.mark.parametrize("multi_stage", [True, False])
@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_a_disaggregated_engines_memory_is_never_released_or_resumed(multi_stage, method, tmp_path):
    """The engine-memory stages run only for a colocated engine (`transport.colocated`): a
    replica on its own GPUs keeps its weights and KV cache across the with block (a resume of
    memory never released is no call to make of SGLang). Killed the mutant that resumed on entry
    whatever the transport."""
    from fsdp_sync.models import build_model, load_config

    eng = _Remote()
    cfg = SyncConfig(method=method, memory_probe="off", multi_stage_wake_up=multi_stage,
                     disk_dir=str(tmp_path))
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [eng], config=cfg)
    assert cfg.free_cache_engine and not m.transport.colocated
    m._check_coverage = lambda: None
    sent = []

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        sent.append(version)
        return None, None

    m._transport_sync = fake_sync
    try:
        with m:
            pass
        assert sent == ["0"] and m.version == "0"
        assert eng.calls == [], eng.calls
    finally:
        m.close()


class _Paused(_Remote):
    """A replica with SGLang's pause calls; ``dead`` is what its own probe says (`fleet.problem`)."""

    def __init__(self, url):
        super().__init__()
        self.base_url, self.paused, self.dead = url, None, None

    def dead_reason(self):
        return self.dead

    def pause_generation(self, mode="abort"):
        self.paused = mode
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.paused = None
        self.calls.append(("continue",))


def test_a_replica_dropped_from_the_retry_holding_part_of_the_first_attempt_stays_paused():
    """Under "quarantine": replica 1 took part of the first attempt and then could not take
    updates; it is quarantined and the sync runs again for replica 0, which commits. Replica 1
    was paused with the others: it must not be continued on its partly new weights (its
    requests aborted, generation held, marked so). Killed the mutant that dropped the stall of
    the replicas left out of the retry."""
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    e0, e1 = _Paused("http://127.0.0.1:39995"), _Paused("http://127.0.0.1:39996")
    cfg = SyncConfig(method="distributed", memory_probe="off", pause_mode="in_place",
                     on_replica_failure="quarantine")
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    attempts = []

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        attempts.append([t.engine for t in targets])
        if len(attempts) == 1:            # replica 1 takes some buckets, then stops answering
            fleet.note_partial([fleet.describe(e1, 1)])
            e1.dead = "worker 0 died (injected)"
            return SyncError("update_weights_from_distributed failed on replica 1"), type(
                "Ctx", (), {"commit_failed": None})()
        return None, None

    m._transport_sync = fake_sync
    try:
        m._sync_full()
        assert attempts == [[e0, e1], [e0]] and m.version == "0"
        assert e0.calls == [("pause", "in_place"), ("continue",)], e0.calls
        assert ("continue",) not in e1.calls and e1.paused == "abort", e1.calls
        (r0, r1) = m.fleet_status()["replicas"]
        assert r0["serving"] and not r0["generation_paused"]
        assert not r1["serving"] and r1["generation_paused"], r1
        assert m.fleet.find(e1).partial
    finally:
        m.close()


def test_a_one_rank_process_group_still_raises_its_own_failure():
    """A trainer of one rank that did init a process group (torchrun --nproc-per-node 1): `agree`
    runs no collective there, but the rank's own error is raised, naming it, not dropped. Killed
    the mutant that answered a group of one as if nothing failed (every failed stage passed)."""
    import torch.distributed as dist

    from fsdp_sync.topology import SyncError, agree

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        agree(None, what="stage 'x'")
        with pytest.raises(SyncError, match=r"stage 'sync_weights' failed on rank 0: RuntimeError: boom"):
            agree(RuntimeError("boom"), what="stage 'sync_weights'")
        with pytest.raises(SyncError, match=r"^verify failed on rank 0: mismatch in q_proj") as info:
            agree(("verify", "mismatch in q_proj"), what="stage 'x'")
        assert info.value.failures == {0: "mismatch in q_proj"}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["off", "rss", "full"])
def test_each_stage_records_the_memory_its_mode_asks_for(mode):
    """`Timeline.stage`: the trainer's memory after the stage in "rss" (the default) and "full"
    (+ USS/PSS), none in "off". Killed the mutant that probed only in "full" mode (the default
    timeline then said nothing of memory, and no test noticed)."""
    from fsdp_sync.memory import Timeline

    tl = Timeline(mode=mode)
    with tl.stage("resume_weights"):
        pass
    (rec,) = tl.stages
    if mode == "off":
        assert rec.memory == {}
        return
    mem = rec.memory["trainer"]
    assert mem["rss"] > 10 << 20 and mem["rss_peak"] >= mem["rss"], mem
    assert ("uss" in mem and "pss" in mem) == (mode == "full"), mem
    if mode == "full":
        assert 0 < mem["uss"] <= mem["pss"] <= mem["rss"] + (1 << 20), mem


def test_status_reads_proc_kib_as_bytes():
    """`memory.status`: /proc's kB are KiB; the RSS it reports is the one psutil reads from
    statm (pages). Killed the mutant that multiplied by 1000 (every probe 2.4 % low)."""
    import psutil

    from fsdp_sync.memory import status

    for _ in range(3):         # RSS may move between the two reads: take the closest of three
        ours, theirs = status("self")["rss"], psutil.Process().memory_info().rss
        if abs(ours - theirs) < 1 << 20:
            break
    assert theirs > 100 << 20 and abs(ours - theirs) < 1 << 20, (ours, theirs)


def test_a_replica_that_died_before_its_continue_does_not_fail_the_committed_sync():
    """After the commit, continue_generation fails on a replica that just died: it cannot take
    updates (`fleet.problem`), the next sync takes it out; the sync that committed is not failed
    for it, and the live replica is continued. Killed the mutant that raised every continue
    failure."""
    from fsdp_sync.models import build_model, load_config

    e0, e1 = _Paused("http://127.0.0.1:39993"), _Paused("http://127.0.0.1:39994")

    def dies():
        e1.dead = "worker 0 died (injected)"
        raise ConnectionError("connection refused")

    e1.continue_generation = dies
    cfg = SyncConfig(method="distributed", memory_probe="off", pause_mode="abort")
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [e0, e1], config=cfg)
    m._check_coverage = lambda: None

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        return None, None

    m._transport_sync = fake_sync
    try:
        m._sync_full()
        assert m.version == "0" and e0.calls == [("pause", "abort"), ("continue",)], e0.calls
        e1.dead = None
        e1.continue_generation = lambda: (_ for _ in ()).throw(RuntimeError("scheduler busy"))
        with pytest.raises(SyncError, match=r"continue_generation on replica 1 .*scheduler busy.*"
                                            r"version '1' was committed"):
            m._sync_full()        # alive: its failure is the sync's, saying the version committed
        assert m.version == "1"
    finally:
        m.close()


def test_a_stage_after_an_unsettled_failure_does_not_run():
    """offload_params (agreed at the next stage's end) fails: the KV cache is not resumed on top
    of parameters still on the device; the failure is raised naming offload_params. Killed the
    mutant that ran the next stage after a failed unsettled one."""
    from fsdp_sync.models import build_model, load_config

    cfg = SyncConfig(method="distributed", memory_probe="off", multi_stage_wake_up=True)
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [_Remote()], config=cfg)
    m._check_coverage = lambda: None
    m._transport_sync = lambda targets, version, step, reload=False: (fleet.take_noted(), (None, None))[1]
    resumed = []
    m._resume = lambda tags: resumed.append(tags)

    def offload():
        raise RuntimeError("out of host memory (injected)")

    m._offload_params = offload
    try:
        with pytest.raises(SyncError, match=r"stage 'offload_params' failed: RuntimeError: out of host memory"):
            with m:
                pass
        assert resumed == [["weights"]], resumed
    finally:
        m.close()


def test_under_abort_a_replica_blamed_for_a_failed_sync_rejoins_once_it_answers():
    """on_replica_failure="abort": the sync fails; the replica that could not take updates is
    out of service, and the next sync after it answers again brings it back (no recover() by
    hand). Killed the mutant that set its rejoin flag the other way round."""
    from fsdp_sync.models import build_model, load_config

    e0, e1 = _Paused("http://127.0.0.1:39991"), _Paused("http://127.0.0.1:39992")
    cfg = SyncConfig(method="distributed", memory_probe="off", on_replica_failure="abort")
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    sent = []

    def fake_sync(targets, version, step, reload=False):
        fleet.take_noted()
        sent.append([t.engine for t in targets])
        if len(sent) == 1:
            e1.dead = "worker 0 died (injected)"
            return SyncError("update_weights_from_distributed failed on replica 1"), type(
                "Ctx", (), {"commit_failed": None})()
        return None, None

    m._transport_sync = fake_sync
    try:
        with pytest.raises(SyncError, match="no replica committed version '0'.*replica 1"):
            m._sync_full()
        assert [r["serving"] for r in m.fleet_status()["replicas"]] == [True, False]
        e1.dead = None                     # restarted: it answers again
        m._sync_full()
        assert sent[1] == [e0, e1] and m.version == "1"
        assert [(r["serving"], r["version"]) for r in m.fleet_status()["replicas"]] == [(True, "1")] * 2
    finally:
        m.close()


def test_a_replica_taken_out_by_hand_gets_no_sync_until_recover():
    """manager.quarantine(engine) (to drain it) under on_replica_failure="quarantine", where
    replicas out of service that answer rejoin every sync: it is not sent the next version nor
    put back in service; recover() brings it back. Killed the mutant that ignored ``held``."""
    from fsdp_sync.models import build_model, load_config

    e0, e1 = _Paused("http://127.0.0.1:39989"), _Paused("http://127.0.0.1:39990")
    cfg = SyncConfig(method="distributed", memory_probe="off", on_replica_failure="quarantine")
    m = FSDPShardingManager(build_model(load_config("tiny"), seed=0), [e0, e1], config=cfg)
    m._check_coverage = lambda: None
    sent = []
    m._transport_sync = lambda targets, version, step, reload=False: (
        fleet.take_noted(), sent.append([t.engine for t in targets]), (None, None))[2]
    try:
        m.quarantine(e1, "draining")
        m._sync_full()
        assert sent == [[e0]] and m.version == "0"
        assert [(r["serving"], r["reason"]) for r in m.fleet_status()["replicas"]] == [
            (True, None), (False, "draining")]
    finally:
        m.close()
