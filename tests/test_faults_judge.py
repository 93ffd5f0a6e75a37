"""The fault matrix's rules (`fsdp_sync.cli.faults_cell.judge`) on stubbed rank records, no processes:
what a survivor must raise, how soon, which engine states pass, and the recovery sync. Before them
a cell passed when every survivor raised anything at all, however late (docs/data/faults.json: the
12 stalled-worker cells passed with gloo's RuntimeError on every rank)."""

from __future__ import annotations

import pytest

from fsdp_sync.cli import faults
from fsdp_sync.cli.faults_cell import Cell, Timeouts, judge, worker_point

T = Timeouts()          # process group 6 s, engine reply 4 s, slack 3 s
FIRED = 1000.0
GLOO = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
SYNC = "SyncError: weight sync failed on rank 0: engine update of per-rank bucket 0: EngineError: ..."


def rec(rank: int, raised: str | None = SYNC, after_s: float = 0.02, **more) -> dict:
    out = {"rank": rank, "clean_calls": 7, "raised": raised, "t_raised": FIRED + after_s, "recovery": "ok"}
    if rank == 0:
        out["engine"] = "previous"
    return out | more


def judged(spec: tuple, *records: dict, calls: int | None = 7) -> Cell:
    return judge(Cell(*spec), {r["rank"]: r for r in records}, FIRED, T, calls)


def test_a_clean_cell_passes():
    cell = judged(("tensor", "sync_weights", "worker1", "raise"), rec(0), rec(1))
    assert cell.problems == [] and cell.seconds_to_error == 0.02 and cell.limit_s == T.slack_s


def test_a_raw_backend_error_where_a_sync_error_is_required_fails():
    """A stalled worker: the old matrix passed it with gloo's errors on both ranks (the reply
    timeout, 8 s, came after the process group's, 6 s)."""
    cell = judged(("tensor", "sync_weights", "worker1", "stall"),
                  rec(0, GLOO, 8.02, engine="dead: WorkerDiedError: TP ranks [1] did not answer"),
                  rec(1, "RuntimeError: Application timeout caused pair closure", 6.0))
    assert any("trainer rank 0 raised RuntimeError, not SyncError" in p for p in cell.problems), cell.problems
    assert any("trainer rank 1 raised RuntimeError" in p for p in cell.problems), cell.problems
    assert any("8.02 s after the fault, more than 7 s (the engine's reply timeout 4 s + 3 s)" in p
               for p in cell.problems), cell.problems


@pytest.mark.parametrize("spec, limit", [(("disk", "prepare", "trainer1", "stall"), 9.0),        # pg 6 + 3
                                         (("disk", "sync_weights", "worker0", "stall"), 7.0),    # call 4 + 3
                                         (("disk", "sync_weights", "worker0", "raise"), 3.0),
                                         (("disk", "prepare", "trainer1", "kill"), 3.0)])
def test_a_survivor_60_s_late_fails_against_its_timeout(spec, limit):
    lost = spec[2] == "trainer1" and spec[3] != "raise"
    records = [rec(0, SYNC if not lost else GLOO, 60.0, engine="dead: gone" if spec[3] == "stall" else "previous")]
    if not lost:
        records.append(rec(1, SYNC, 60.0))
    cell = judged(spec, *records)
    assert cell.limit_s == limit
    assert any(f"60.00 s after the fault, more than {limit:g} s" in p for p in cell.problems), cell.problems
    # in time: the same records pass
    records = [r | {"t_raised": FIRED + limit - 0.5} for r in records]
    assert judged(spec, *records).problems == []


def test_the_peer_of_a_dead_trainer_rank_may_get_its_process_groups_error():
    """A rank that dies cannot agree: its peer's gloo error is what the docs promise, at once."""
    cell = judged(("distributed", "swap_rng", "trainer1", "kill"), rec(0, GLOO, 0.01, recovery=""))
    assert cell.problems == [], cell.problems
    # but an exception of the fault itself, or a bug's, is not the process group's
    cell = judged(("distributed", "swap_rng", "trainer1", "kill"), rec(0, "KeyError: 'x'", 0.01))
    assert any("raised KeyError, not SyncError or RuntimeError" in p for p in cell.problems)


def test_an_exception_on_one_rank_must_be_a_sync_error_on_every_rank():
    cell = judged(("disk", "swap_rng", "trainer1", "raise"), rec(0, engine="new"),
                  rec(1, "InjectedFault: injected fault: trainer 1 at swap_rng"))
    assert any("trainer rank 1 raised InjectedFault, not SyncError" in p for p in cell.problems)


@pytest.mark.parametrize("engine, ok", [
    ("previous", True), ("dead: WorkerDiedError: ... the weights are inconsistent", True),
    ("new", False), ("HALF-APPLIED", False),
    # start-up weights written over in place: no state for an engine that held a sync's weights
    ("unserved: EngineUnavailableError: the start-up weights were partly overwritten", False),
    ("ERROR EngineError: x", False)])
def test_the_engine_states_a_fault_in_the_sync_may_leave(engine, ok):
    cell = judged(("distributed", "sync_weights.bucket4", "worker1", "raise"),
                  rec(0, engine=engine, clean_calls=10), rec(1), calls=10)
    assert (cell.problems == []) is ok, cell.problems


def test_after_the_sync_the_new_weights_are_allowed_too():
    assert judged(("tensor", "restore_rng", "trainer0", "raise"), rec(0, engine="new"), rec(1)).problems == []


def test_an_engine_that_still_serves_must_take_the_recovery_sync():
    cell = judged(("tensor", "release_memory", "worker1", "raise"),
                  rec(0, recovery="failed: SyncError: stage 'resume_weights' failed"), rec(1, recovery="ok"))
    assert any("the recovery sync: rank 0 failed" in p for p in cell.problems), cell.problems
    cell = judged(("tensor", "release_memory", "worker1", "raise"),
                  rec(0, recovery="wrong: after the recovery sync the engine is HALF-APPLIED"), rec(1))
    assert any("rank 0 wrong" in p for p in cell.problems), cell.problems
    # a dead engine is not asked to recover
    cell = judged(("tensor", "sync_weights", "worker1", "kill"),
                  rec(0, engine="dead: TP rank 1 died", recovery="not run: the engine does not serve"),
                  rec(1, recovery="not run: the engine does not serve"))
    assert cell.problems == [], cell.problems


def test_a_fault_placed_in_the_wrong_sync_is_said():
    clean = "SyncError: distributed weight sync failed on rank 0: engine 0 refused per-rank bucket 4"
    cell = Cell("distributed", "sync_weights.bucket4", "worker1", "raise", after=4)
    judge(cell, {0: {"rank": 0, "clean": clean, "t_clean_failed": FIRED + 0.1},
                 1: {"rank": 1, "clean": clean, "t_clean_failed": FIRED + 0.1}}, FIRED, T, 1)
    assert len(cell.problems) == 1 and "the clean sync before the fault failed on rank 0" in cell.problems[0]
    assert "FSDP_SYNC_FAULT_AFTER=4 counted 1 engine update calls a sync" in cell.problems[0]
    cell = judged(("distributed", "sync_weights", "worker1", "raise"), rec(0, clean_calls=9), rec(1), calls=10)
    assert any("made 9 engine update calls, the fault was placed counting 10" in p for p in cell.problems)
    late = judge(Cell("tensor", "sync_weights", "worker1", "raise"), {0: rec(0), 1: rec(1)}, FIRED + 5, T, 7)
    assert any("fired after the faulted sync" in p for p in late.problems), late.problems


def test_the_matrix_reaches_inside_the_sync():
    every = faults.cells()
    assert len(every) == 3 * 12 * 4 * 3
    inside = [c for c in every if c.stage in faults.SYNC_POINTS and c.possible]
    assert {c.victim for c in inside} == {"worker0", "worker1"}
    assert {(c.method, c.stage) for c in inside} == {
        (m, s) for m in faults.METHODS for s in faults.SYNC_POINTS} - {("disk", "sync_weights.bucket4")}
    assert worker_point("distributed", "sync_weights.bucket4") == ("stage_broadcast", "calls")
    assert worker_point("tensor", "sync_weights.end") == ("end", "sync")
    assert Cell("disk", "sync_weights.commit", "worker0", "kill").spec == "worker:0:commit:kill"
    assert len([c for c in every if c.possible]) == 246
