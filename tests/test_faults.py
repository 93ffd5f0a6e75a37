"""The fault matrix in small: one cell per method, covering both victim kinds (trainer rank, engine
worker) and every fault kind (SIGKILL, an exception, a stall caught by a timeout). Each cell is a
fresh 2-rank trainer + 2-worker engine job; `run_cell` checks that every survivor raised, that the
engine serves its previous weights (or is cleanly dead and says so) and that nothing is left. The
whole matrix is ``fsdp-sync faults``."""

from __future__ import annotations

import pytest

from fsdp_sync import faults
from fsdp_sync.cli import parse_args


def test_fault_point_parses_and_fires_once(monkeypatch):
    monkeypatch.setattr(faults, "_fired", set())
    monkeypatch.setenv(faults.FAULT_ENV, "worker:1:resume:raise")
    faults.fault_point("trainer", 1, "resume")          # other side: nothing
    faults.fault_point("worker", 0, "resume:weights")   # other rank: nothing
    faults.fault_point("worker", 1, "release:weights")  # other point: nothing
    with pytest.raises(faults.InjectedFault, match="worker 1 at resume:weights"):
        faults.fault_point("worker", 1, "resume:weights")
    faults.fault_point("worker", 1, "resume:weights")   # once only
    monkeypatch.setenv(faults.FAULT_ENV, "nonsense")
    with pytest.raises(ValueError, match="FSDP_SYNC_FAULT='nonsense'"):
        faults.fault_point("worker", 1, "x")


def test_matrix_lists_impossible_cells_and_cli_filters():
    every = faults.cells()
    assert len(every) == 3 * 9 * 4 * 3
    na = [c for c in every if not c.possible]
    # engine workers are reached only by sync_weights (every method) and, colocated, by the
    # engine-memory stages: 3 + 1 + 1 stages of 9 per method, x 2 workers x 3 faults
    assert len(na) == (9 - 4 + 2 * (9 - 1)) * 2 * 3
    assert all("does not call the engine" in c.reason for c in na)
    args = parse_args(["faults", "--methods", "disk", "--victims", "worker0", "--faults", "raise"])
    sel = faults.cells(args.methods, args.stages, args.victims, args.faults)
    assert [c.stage for c in sel if c.possible] == ["sync_weights"]
    with pytest.raises(SystemExit):
        parse_args(["faults", "--faults", "explode"])


CELLS = [("distributed", "sync_weights", "trainer0", "kill"),
         ("tensor", "resume_weights", "worker1", "stall"),
         ("disk", "swap_rng", "trainer1", "raise")]


@pytest.mark.timeout(420)
def test_small_fault_matrix():
    bad = []
    for spec in CELLS:
        cell = faults.run_cell(faults.Cell(*spec))
        assert cell.seconds_to_error is not None, (spec, cell.problems)
        if not cell.ok:
            bad.append((spec, cell.problems))
        if spec[2] == "worker1":       # a stalled worker: caught by the reply timeout; engine says so
            assert cell.engine.startswith("dead:") and "did not answer" in cell.engine, cell.engine
        if spec[2] == "trainer1":      # after the sync: the engine serves the complete new weights
            assert cell.engine == "new", cell.engine
            assert "InjectedFault" in cell.survivors["trainer0"]
    assert not bad, bad
