"""A fleet of rollout replicas (`fsdp_sync.fleet`): one weight version committed on every replica
or on none, a failed replica quarantined and brought back, replicas added and removed between
syncs. Single-process trainer (no process group: the disaggregated methods run without one) and
reference engines at TP 1, each a worker process; a replica is "killed" by SIGKILL of its worker.

Every check compares real weights: each serving replica's tensors against the trainer's, bit
for bit (`_util.digest`), and a replica that must keep the old version against the digests taken
before the sync.
"""

from __future__ import annotations

import pytest
import torch

from _util import digest, perturb_

pytestmark = pytest.mark.timeout(240)

RECIPE = "tiny"


def _engine():
    from fsdp_sync.engines.reference import ReferenceEngine

    return ReferenceEngine(RECIPE, tp_size=1, kv_cache_tokens=64, call_timeout_s=20,
                           update_recv_timeout_s=10)


def _module():
    from fsdp_sync.models import build_model, load_config

    return build_model(load_config(RECIPE), seed=3)


def _served(engine) -> dict:
    return {n: digest(t) for n, t in engine.named_full_tensors()}


def _trained(module) -> dict:
    return {n: digest(t) for n, t in module.state_dict().items() if n in _served_names(module)}


def _served_names(module):
    return {n for n, _ in module.named_parameters()}


def _same(engine, module) -> bool:
    want = {n: digest(p) for n, p in module.named_parameters()}
    got = _served(engine)
    return all(got[n] == want[n] for n in want if n in got) and set(want) <= set(got) | {"lm_head.weight"}


def _kill(engine) -> None:
    import time

    engine._w.procs[0].kill()
    for _ in range(100):
        if engine.dead_reason():
            return
        time.sleep(0.05)
    raise AssertionError("the killed replica was not seen dead")


def _config(method, tmp_path, **kw):
    from fsdp_sync import SyncConfig

    extra = {"disk_dir": str(tmp_path / "ckpt")} if method == "disk" else {"dist_timeout_s": 30.0}
    return SyncConfig(method=method, bucket_bytes=1 << 20, **extra, **kw)


def _manager(module, engines, cfg):
    from fsdp_sync import FSDPShardingManager

    return FSDPShardingManager(module, list(engines), config=cfg)


def _sync(manager) -> None:
    with manager:
        pass


@pytest.fixture
def fleet3():
    engines = [_engine() for _ in range(3)]
    yield engines
    for e in engines:
        e.shutdown()


@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_abort_leaves_every_replica_on_the_old_version(method, tmp_path, fleet3):
    from fsdp_sync.topology import SyncError

    module = _module()
    manager = _manager(module, fleet3, _config(method, tmp_path))
    _sync(manager)
    assert manager.version == "0"
    assert all(_same(e, module) for e in fleet3)
    before = [_served(e) for e in fleet3]
    perturb_(module.parameters())
    _kill(fleet3[1])
    with pytest.raises(SyncError) as info:
        _sync(manager)
    assert "replica 1" in str(info.value) and "no replica committed" in str(info.value)
    assert manager.version == "0"
    for i in (0, 2):
        assert _served(fleet3[i]) == before[i], f"replica {i} changed though the sync aborted"
    manager.close()


@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_quarantine_commits_the_healthy_and_a_new_replica_joins(method, tmp_path, fleet3):
    module = _module()
    manager = _manager(module, fleet3, _config(method, tmp_path, on_replica_failure="quarantine"))
    _sync(manager)
    perturb_(module.parameters())
    _kill(fleet3[2])
    _sync(manager)
    assert manager.version == "1"
    status = manager.fleet_status()
    assert [r["serving"] for r in status["replicas"]] == [True, True, False]
    assert "replica 2" in status["replicas"][2]["name"] and status["replicas"][2]["reason"]
    assert manager.engines == fleet3[:2]
    assert manager.stats.extra["version"] == "1" and manager.stats.extra["replicas_serving"] == 2
    assert manager.stats.extra["replicas_out"][0].startswith("replica 2")
    assert all(_same(e, module) for e in fleet3[:2])
    # every sync probes the replica out of service once (no retries: a dead one must not cost
    # each sync the client's backoff), those in service with the client's retries
    import fsdp_sync.fleet as fl

    probes, real = [], fl.problem
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fl, "problem", lambda e, **kw: probes.append((fleet3.index(e), kw)) or real(e, **kw))
        perturb_(module.parameters())
        _sync(manager)
    assert manager.version == "2" and (2, {"once": True}) in probes, probes
    assert {(i, kw.get("once")) for i, kw in probes if i != 2} <= {(0, False), (1, False)}, probes
    # a dead replica cannot be brought back; it is named
    from fsdp_sync.topology import SyncError
    with pytest.raises(SyncError, match="replica 2"):
        manager.recover(fleet3[2])
    manager.remove_engine(fleet3[2])
    # a new replica: out of service until it holds the current version
    fresh = _engine()
    try:
        joined = manager.add_engine(fresh)
        if method == "disk":
            assert joined and _same(fresh, module)
        else:                      # outside the with block: it joins at the next sync
            assert not joined and fresh not in manager.engines
        perturb_(module.parameters())
        _sync(manager)
        assert manager.version == "3" and fresh in manager.engines
        assert all(_same(e, module) for e in manager.engines) and len(manager.engines) == 3
    finally:
        manager.close()
        fresh.shutdown()


@pytest.mark.parametrize("method,phase,fault,mode", [("distributed", "commit", "stall", "abort")])
def test_fleet_fault_cells(method, phase, fault, mode):
    """One cell of ``fsdp-sync faults --fleet`` (the CLI runs all 16; the kill-in-stage cases are
    the tests above): what each must show is in `fsdp_sync.cli.faults_fleet`; here the cell's own
    verdict, and its figures, are checked."""
    from fsdp_sync.cli.faults_fleet import FleetCell, run_fleet_cell

    cell = run_fleet_cell(FleetCell(method, phase, fault, mode), call_s=4.0, recv_s=4.0)
    assert cell.ok, cell.problems
    assert cell.quarantine_s is not None and cell.quarantine_s <= cell.sync_s   # within the sync (both rounded to 10 ms)
    survivors = "v0" if (phase, mode) == ("stage", "abort") else "v1"
    assert cell.replicas_after[0] == cell.replicas_after[2] == survivors
    assert cell.recovered and not cell.leftovers


@pytest.mark.parametrize("pause_mode", ["in_place", None])
def test_pause_mode_brackets_the_sync_on_every_replica(pause_mode, tmp_path):
    """``SyncConfig.pause_mode`` through the manager: a request running on replica 0 when the sync
    starts. ``in_place``: the request is held by the engine right after its 3rd token (the
    engine's test hook: a point that does not depend on the machine's speed), the fleet's sync runs
    while it is paused, and it finishes on the new version, its spans splitting its tokens 3 / 37
    between "0" and "1"; None: the update waits for it, so all its tokens are version "0"'s. Either
    way the new version is committed on both replicas."""
    import threading
    import time

    from fsdp_sync.config import SyncConfig

    engines = [_engine(), _engine()]
    manager = None
    try:
        module = _module()
        manager = _manager(module, engines, SyncConfig(method="distributed", bucket_bytes=1 << 20,
                                                       dist_timeout_s=30.0, pause_mode=pause_mode))
        _sync(manager)
        perturb_(module.parameters())
        started, out = threading.Event(), {}
        if pause_mode == "in_place":
            engines[0]._pause_after_steps(3)

        def generate():
            out["r"] = engines[0].generate_requests(
                [[11, 27, 93]], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
                on_step=lambda rs: len(rs[0]["output_ids"]) >= 3 and started.set())[0]

        t = threading.Thread(target=generate, daemon=True)
        t.start()
        assert started.wait(60)
        if pause_mode == "in_place":
            deadline = time.monotonic() + 30
            while engines[0].generation_paused != "in_place" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engines[0].generation_paused == "in_place"
        _sync(manager)
        t.join(120)
        assert not t.is_alive()
        spans = [(s["version"], s["start"], s["end"]) for s in out["r"]["weight_versions"]]
        n = len(out["r"]["output_ids"])
        assert n == 40 and spans[-1][2] == n
        if pause_mode == "in_place":
            # the manager's continue_generation resumed it: what it made after came from "1"
            assert spans == [("0", 0, 3), ("1", 3, n)], spans
            assert engines[0].generation_paused is None
        else:
            assert spans == [("0", 0, n)], spans
        assert manager.version == "1" and all(e.get_weight_version() == "1" for e in engines)
        assert all(_same(e, module) for e in engines)
    finally:
        if manager is not None:
            manager.close()     # its update group, even when an assertion failed above
        for e in engines:
            e.shutdown()


@pytest.mark.parametrize("version", ["step-7", None])
def test_the_send_loop_verl_drives_commits_its_version(version):
    """verl's adapter hands its own calls to `TensorTransport.send`, which then closes the engine's
    update bracket: the commit carries the caller's version (or none) instead of failing the sync
    on a version only `sync` used to set."""
    from _ranks import send_bracket
    from fsdp_sync.cli.launch import run_ranks

    r = run_ranks(send_bracket, 1, version, timeout_s=120)[0]
    assert r["calls"] == 0
    if version is None:
        assert r["after"] == r["before"]
    else:
        assert r["after"] == version != r["before"]


def test_a_replica_with_other_math_is_refused_when_added(tmp_path):
    """An elastic replica started from another config (rope_theta) is refused by add_engine before
    it loads anything, names the key, stays out of service, and the fleet syncs on without it."""
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncError

    module = _module()
    good = _engine()
    odd = ReferenceEngine(load_config(RECIPE, rope_theta=1e6), tp_size=1, kv_cache_tokens=64,
                          call_timeout_s=20, update_recv_timeout_s=10)
    manager = _manager(module, [good], _config("disk", tmp_path))
    try:
        _sync(manager)
        before = _served(odd)
        with pytest.raises(SyncError, match=r"rope_theta: trainer 10000.0, engine 1000000.0"):
            manager.add_engine(odd)
        assert odd not in manager.engines and _served(odd) == before
        assert [r["name"] for r in manager.fleet_status()["replicas"]] == ["replica 0"]
        perturb_(module.parameters())
        _sync(manager)
        assert manager.version == "1" and manager.engines == [good] and _same(good, module)
    finally:
        manager.close()
        good.shutdown()
        odd.shutdown()


@pytest.mark.parametrize("method", ["distributed"])
def test_a_replica_brought_in_between_syncs_joins_the_next_one_under_abort(method, tmp_path):
    """Under the default ``on_replica_failure="abort"``, ``add_engine`` (and ``recover`` of a
    replica taken out by hand) outside the with block said the replica joins at the next sync,
    and no sync ever went to it: it stayed out of service on its start-up weights."""
    engines = [_engine(), _engine()]
    module = _module()
    manager = _manager(module, engines[:1], _config(method, tmp_path))
    try:
        _sync(manager)
        assert manager.add_engine(engines[1]) is False and engines[1] not in manager.engines
        perturb_(module.parameters())
        _sync(manager)
        assert manager.engines == engines and all(_same(e, module) for e in engines)
        assert [r["serving"] for r in manager.fleet_status()["replicas"]] == [True, True]
        manager.quarantine(engines[0])
        assert manager.recover(engines[0]) is False and manager.engines == engines[1:]
        perturb_(module.parameters())
        _sync(manager)
        assert manager.engines == engines and all(_same(e, module) for e in engines)
        assert manager.version == "2" and {r["version"] for r in manager.fleet_status()["replicas"]} == {"2"}
    finally:
        manager.close()
        for e in engines:
            e.shutdown()
