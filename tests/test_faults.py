"""The fault matrix in small: a few cells covering both victim kinds (trainer rank, engine worker),
every fault kind (SIGKILL, an exception, a stall caught by a timeout) and a worker's point inside
the sync. Each cell is a fresh 2-rank trainer + 2-worker engine job (a clean sync, the faulted one, a
recovery sync); `run_cell` checks that every survivor raised a `SyncError` (or its process group's
error, a dead trainer rank's peer) in time, that the engine serves its previous weights (or is
cleanly dead and says so), that the next sync lands and that nothing is left. The whole matrix is
``fsdp-sync faults``; its rules alone, on stubbed records: tests/test_faults_judge.py."""

from __future__ import annotations

import psutil
import pytest

from fsdp_sync import faultpoint
from fsdp_sync.cli import faults
from fsdp_sync.cli.app import parse_args


def test_fault_point_parses_and_fires_once(monkeypatch):
    monkeypatch.setattr(faultpoint, "_fired", set())
    monkeypatch.setenv(faultpoint.FAULT_ENV, "worker:1:resume:raise")
    faultpoint.fault_point("trainer", 1, "resume")          # other side: nothing
    faultpoint.fault_point("worker", 0, "resume:weights")   # other rank: nothing
    faultpoint.fault_point("worker", 1, "release:weights")  # other point: nothing
    with pytest.raises(faultpoint.InjectedFault, match="worker 1 at resume:weights"):
        faultpoint.fault_point("worker", 1, "resume:weights")
    faultpoint.fault_point("worker", 1, "resume:weights")   # once only
    monkeypatch.setenv(faultpoint.FAULT_ENV, "nonsense")
    with pytest.raises(ValueError, match="FSDP_SYNC_FAULT='nonsense'"):
        faultpoint.fault_point("worker", 1, "x")


def test_fault_point_after_n_passes(monkeypatch):
    """``FSDP_SYNC_FAULT_AFTER=n``: the point is passed n times, then acts (once)."""
    monkeypatch.setattr(faultpoint, "_fired", set())
    monkeypatch.setattr(faultpoint, "_passed", {})
    monkeypatch.setenv(faultpoint.FAULT_ENV, "trainer:0:sync_weights:raise")
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "2")
    faultpoint.fault_point("trainer", 0, "sync_weights")
    faultpoint.fault_point("trainer", 1, "sync_weights")      # another rank is not counted
    faultpoint.fault_point("trainer", 0, "sync_weights")
    with pytest.raises(faultpoint.InjectedFault):
        faultpoint.fault_point("trainer", 0, "sync_weights")
    faultpoint.fault_point("trainer", 0, "sync_weights")      # once only
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "two")
    monkeypatch.setattr(faultpoint, "_fired", set())
    with pytest.raises(ValueError, match="FSDP_SYNC_FAULT_AFTER='two'"):
        faultpoint.fault_point("trainer", 0, "sync_weights")


def test_matrix_lists_impossible_cells_and_cli_filters():
    every = faults.cells()
    assert len(every) == 3 * 12 * 4 * 3
    na = [c for c in every if not c.possible]
    # engine workers are reached only by the sync's points (every method; disk has no 4th engine
    # call) and, colocated, by the engine-memory stages; trainer ranks by every stage but the
    # workers' points inside the sync: per method, 12 stages x 2 workers x 3 faults, less those
    worker_na = (12 - 4 - 3) + (12 - 4) + (12 - 3)
    assert len(na) == (worker_na * 2 + 3 * 3 * 2) * 3
    assert all("does not call the engine" in c.reason or "point" in c.reason or "no 4th" in c.reason
               for c in na)
    args = parse_args(["faults", "--methods", "disk", "--victims", "worker0", "--faults", "raise"])
    sel = faults.cells(args.methods, args.stages, args.victims, args.faults)
    assert [c.stage for c in sel if c.possible] == ["sync_weights", "sync_weights.commit", "sync_weights.end"]
    with pytest.raises(SystemExit):
        parse_args(["faults", "--faults", "explode"])


@pytest.mark.timeout(120)
def test_stalled_worker_is_not_asked_again(monkeypatch):
    """A worker that lets a call time out (stalled while staging an update) breaks the engine:
    the abort round then asks only the responsive worker, which drops what it staged (its shard
    is untouched), diagnostics skip the silent one, and shutdown ends it without a grace wait."""
    import torch

    from fsdp_sync.engines import EngineError, ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    monkeypatch.setenv(faults.FAULT_ENV, "worker:1:stage:stall")   # the workers inherit it
    model = build_model(load_config("tiny"), seed=3)
    e = ReferenceEngine(model_config="tiny", tp_size=2, dtype=torch.float32, kv_cache_tokens=16,
                        call_timeout_s=2.0)
    try:
        pids = list(e.worker_pids)
        shards = e.shard_checksums()
        with pytest.raises(EngineError, match=r"TP ranks \[1\] did not answer .* within 2s"):
            e.update_weights_from_tensor(list(model.state_dict().items()))
        assert e._w.silent == {1}
        assert e.shard_checksums() == [shards[0], None]     # worker 0 aborted; worker 1 not asked
        with pytest.raises(EngineError, match="cannot serve any more"):
            e.weights_checksum()
    finally:
        e.shutdown()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


CELLS = [("distributed", "sync_weights", "trainer0", "kill"),
         ("tensor", "sync_weights", "worker1", "stall"),     # through the abort round
         ("disk", "swap_rng", "trainer1", "raise"),
         ("distributed", "sync_weights.bucket4", "worker1", "raise"),   # inside the sync, into real weights
         # a rank failing as it enters a fleet method's sync: rank 0 checks whether any replica can
         # take it in an agree the failed rank meets (10d16c7's broadcast there hung both until
         # the process-group timeout, gloo errors, no recovery)
         ("disk", "sync_weights", "trainer1", "raise")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", CELLS, ids=["-".join(c) for c in CELLS])    # each a test: spread over workers
def test_small_fault_matrix(spec):
    """Beside each cell another program leaves empty pymp-* directories in the machine's temp
    directory: they are not the cell's (it counted every new one there as its own leftover); the
    cell's processes have a TMPDIR of their own, where their leftovers are counted."""
    import os
    import tempfile
    import threading

    made: list[str] = []
    stop = threading.Event()

    def other_program() -> None:
        while not stop.wait(0.05):
            made.append(tempfile.mkdtemp(prefix="pymp-other-"))

    t = threading.Thread(target=other_program, daemon=True)
    t.start()
    try:
        # 5 s past a timeout (the CLI's default 3 s): a stalled worker's cell took 8.6 s on a
        # stress run of the suite beside six busy processes; one waiting out the process group
        # instead of the reply timeout still fails (its survivors' errors are not SyncError)
        cell = faults.run_cell(faults.Cell(*spec), faults.Timeouts(slack_s=5.0))
    finally:
        stop.set()
        t.join()
        for d in made:
            os.rmdir(d)
    assert made and "temp_dirs" not in cell.leftovers, cell.leftovers
    assert cell.seconds_to_error is not None, (spec, cell.problems)
    if spec[3] == "stall":         # a stalled worker: caught by the reply timeout; engine says so
        assert cell.engine.startswith("dead:") and "did not answer" in cell.engine, cell.engine
        # the engine's reply timeout comes before the process group's: the same SyncError on both
        assert all(v.startswith("SyncError") for v in cell.survivors.values()), cell.survivors
    if spec[2] == "trainer1" and spec[1] == "swap_rng":   # after the sync: the complete new weights
        assert cell.engine == "new", cell.engine
        assert "InjectedFault" in cell.survivors["trainer0"]
    if spec[2] == "trainer1" and spec[1] == "sync_weights":   # nothing sent: the previous weights
        assert cell.engine == "previous" and cell.recovery == "ok", (cell.engine, cell.recovery)
        assert cell.survivors["trainer0"].startswith("SyncError") and "InjectedFault" in cell.survivors["trainer0"]
        assert cell.seconds_to_error < 3, cell.seconds_to_error
    if spec[1] == "sync_weights.bucket4":
        # the 4th engine call of the second sync: the engine staged the update over the first
        # sync's weights and keeps them (before: the first sync, into start-up weights written
        # over in place, an engine that refused to serve); the next sync then lands
        assert cell.after == faults.calls_per_sync("distributed") + 3, cell.after
        assert cell.engine == "previous" and cell.recovery == "ok", (cell.engine, cell.recovery)
    assert cell.ok, (spec, cell.problems)
