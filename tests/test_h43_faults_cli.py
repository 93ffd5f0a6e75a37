"""``fsdp-sync faults`` as a user runs it (H43's audit): a Ctrl-C while a cell runs ends the cell's
processes and removes its temp directory; the verdicts of the matrix, the fleet cells and the soak
(a cell or a process that broke a rule is reported failed, and the exit code says so).

In process: the cell's ranks are forked stand-ins that sleep (no torch, no process group), the
fleet's engines and the soak's job are replaced by what they would have measured."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import types

import psutil
import pytest

from fsdp_sync import wire
from fsdp_sync.cli import faults, faults_cell, launch


def _sleeping_rank(rank, world, port, backend, pg_timeout_s, fn, args, results, env):
    """A rank that got stuck (a stalled victim sleeps an hour): it starts an "engine worker" (a
    child of its own), writes both pids where a cell's rank does (``<tmp>/pids``) and sleeps."""
    tmp = args[1]
    child = subprocess.Popen(["sleep", "3600"])
    with open(os.path.join(tmp, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n{child.pid}\n")
    time.sleep(3600)


class _InterruptedQueue:
    """The cell's result queue, read as Ctrl-C arrives: once every stand-in wrote its pids."""

    def __init__(self, tmp_root, seen: list):
        self.tmp_root, self.seen = tmp_root, seen

    def get(self, timeout=None):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(_pids(self.tmp_root)) == 4:
                self.seen += _pids(self.tmp_root)
                raise KeyboardInterrupt
            time.sleep(0.02)
        raise AssertionError("the stand-in ranks did not start")

    def close(self):
        pass

    def join_thread(self):
        pass


def _pids(root) -> list[int]:
    out = []
    for f in root.glob("fsdp_sync_fault_*/pids"):
        out += [int(x) for x in f.read_text().split()]
    return out


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_cell_ends_its_processes_and_removes_its_temp_dir(tmp_path, monkeypatch):
    """Before: `run_cell` started its ranks outside any try; a Ctrl-C that reached fsdp-sync alone
    (``kill -INT``, a supervisor) printed "interrupted", then the interpreter's exit waited for the
    non-daemon ranks: a stalled trainer rank sleeps an hour, so the command hung with it alive,
    and the cell's temp directory (its disk checkpoint) stayed in /tmp (a terminal's Ctrl-C left
    the directory too)."""
    import multiprocessing
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))          # the cell's mkdtemp lands here
    fork = multiprocessing.get_context("fork")
    seen: list[int] = []

    class Ctx:
        Process = fork.Process

        def Queue(self):
            return _InterruptedQueue(tmp_path, seen)

    monkeypatch.setattr(launch, "_context", lambda: Ctx())
    monkeypatch.setattr(launch, "_worker", _sleeping_rank)
    try:
        with pytest.raises(KeyboardInterrupt):
            faults_cell.run_cell(faults.Cell("disk", "prepare", "trainer1", "stall"))
        left = faults_cell._alive(seen)
        dirs = list(tmp_path.glob("fsdp_sync_fault_*"))
    finally:
        for p in faults_cell._alive(seen):
            os.kill(p, signal.SIGKILL)
        for c in multiprocessing.active_children():
            c.join(timeout=5)
    assert len(seen) == 4 and not left, f"left running: {left} of {seen}"
    assert not dirs, f"the cell's temp directory stayed: {dirs}"


# --------------------------------------------------------------------------- a cell's verdict

_PLAN: dict = {}
"""What the forked stand-in ranks of `_recording_rank` report (set before the cell starts)."""


def _recording_rank(rank, world, port, backend, pg_timeout_s, fn, args, results, env):
    """A rank that reports the record `_PLAN` gives it: it raised 0.05 s after the fault (times
    set by the test, not read here: a loaded machine may start a rank seconds late)."""
    import pickle

    import tempfile

    with open(os.path.join(args[1], "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    if rank == _PLAN.get("exits"):      # gone without a result (killed, a crash past the catch)
        os._exit(3)
    if rank == _PLAN.get("leaves"):     # what a killed multiprocessing listener's owner leaves
        tempfile.mkdtemp(prefix="pymp-", dir=env["TMPDIR"])
    if rank == 0:
        with open(env["FSDP_SYNC_FAULT_LOG"], "a") as f:
            f.write(f"{_PLAN['t']} {os.getpid()} raise\n")
    results.put((rank, True, pickle.dumps(dict(_PLAN[rank], t_raised=_PLAN["t"] + 0.05))))


SYNC = "SyncError: weight sync failed on rank 1: stage 'prepare': InjectedFault: injected fault"
PASSING = {0: {"rank": 0, "clean_calls": 3, "raised": SYNC, "engine": "previous", "recovery": "ok"},
           1: {"rank": 1, "clean_calls": 3, "raised": SYNC, "recovery": "ok"}}
ONE_CELL = ["faults", "--methods", "disk", "--stages", "prepare", "--victims", "trainer1", "--faults", "raise",
            "--json"]


@pytest.fixture
def stand_in_ranks(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(launch, "_context", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(launch, "_worker", _recording_rank)
    yield _PLAN
    _PLAN.clear()
    for c in multiprocessing.active_children():
        c.join(timeout=5)


@pytest.mark.timeout(120)
def test_a_cell_that_breaks_a_rule_is_reported_failed_and_the_command_exits_1(stand_in_ranks, tmp_path, capsys):
    """The matrix's verdict end to end (`run_cell` -> `run_matrix` -> ``fsdp-sync faults``): a
    cell whose rank did not raise and left a temp directory is ``ok: false`` in the JSON with
    both rules, ``failed`` counts it, the table says FAIL and the exit code is 1; those are its
    only problems (the stand-in ranks keep every other rule). Every multi-process cell test passes, so a verdict that ignored its
    problems survived them."""
    import json

    from fsdp_sync.cli import app as cli

    out = tmp_path / "faults.json"
    stand_in_ranks.update(PASSING, t=time.time())
    stand_in_ranks[1] = dict(PASSING[1], raised=None)       # the faulted sync went through on rank 1
    stand_in_ranks["leaves"] = 1                             # and it left a temp directory
    assert cli.main([*ONE_CELL, str(out)]) == 1
    got = capsys.readouterr()
    text = " ".join(got.out.split())
    rep = json.loads(out.read_text())
    cell = rep["results"][0]
    assert (rep["ran"], rep["passed"], rep["failed"]) == (1, 0, 1) and cell["ok"] is False, cell
    assert cell["problems"][0] == "trainer rank 1 did not raise", cell["problems"]
    assert len(cell["problems"]) == 2 and cell["problems"][1].startswith("left behind: {'temp_dirs': ["), cell
    assert list(cell["leftovers"]) == ["temp_dirs"] and "/pymp-" in cell["leftovers"]["temp_dirs"][0], cell
    assert "FAIL" in text and "0 passed, 1 failed" in text, text
    # progress where stderr is no terminal (a log): a line a cell, not one bar at the end
    assert f"fault cell 1/1: disk prepare trainer1 raise: FAIL ({cell['wall_s']:g} s)" in got.err, got.err
    assert "fault cell" not in got.out


@pytest.mark.timeout(120)
def test_a_rank_that_exits_without_a_result_is_said_to_have_exited_not_hung(stand_in_ranks):
    """A rank that died at once was reported as "HANG: ranks [1] did not finish within 150s" (the
    cell failed, rightly, but sent its reader looking for a hang). It is failed as exited, with
    its exit code, and nothing calls it a hang."""
    stand_in_ranks.update(PASSING, t=time.time(), exits=1)
    cell = faults_cell.run_cell(faults.Cell("disk", "prepare", "trainer1", "raise"))
    assert cell.ok is False and cell.problems[0] == "rank 1 exited (code 3) without a result", cell.problems
    assert not any("HANG" in p for p in cell.problems), cell.problems


def test_the_report_counts_a_failed_cell_that_measured_nothing(monkeypatch):
    """A cell that failed before any time to error was measured (a hang, a fault that never
    fired) is counted failed as one that raised late is."""
    def hung(c, t, calls=None):
        c.ok, c.problems = False, ["HANG: ranks [0, 1] did not finish within 150s"]
        return c

    monkeypatch.setattr(faults, "run_cell", hung)
    rep = faults.run_matrix([faults.Cell("disk", "prepare", "trainer1", "raise")], progress=False)
    assert (rep["ran"], rep["passed"], rep["failed"]) == (1, 0, 1) and rep["slowest_cell"] is None, rep


@pytest.mark.timeout(60)
def test_a_fleet_cell_that_crashes_is_failed_and_the_command_exits_1(monkeypatch, tmp_path, capsys):
    """``fsdp-sync faults --fleet``: a cell whose job raised (here: no engine could start) is
    failed with the error, counted, and the exit code is 1; in a log, a line a cell says so."""
    import json

    from fsdp_sync.cli import app as cli
    from fsdp_sync.engines import reference

    class NoEngine:
        def __init__(self, *a, **k):
            raise RuntimeError("no engine here")

    monkeypatch.setattr(reference, "ReferenceEngine", NoEngine)
    out = tmp_path / "fleet.json"
    assert cli.main(["faults", "--fleet", "--methods", "disk", "--faults", "kill", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert (rep["cells"], rep["ran"], rep["passed"], rep["failed"]) == (4, 4, 0, 4), rep
    assert all(c["ok"] is False and c["problems"] == ["RuntimeError: no engine here"] for c in rep["results"])
    got = capsys.readouterr()
    assert "0 passed, 4 failed" in " ".join(got.out.split())
    # progress where stderr is no terminal (a log): a line a cell (the bar was transient: nothing)
    assert [line.split(": FAIL")[0] for line in got.err.splitlines()] == [
        f"fleet cell {i}/4: disk {p} kill {m}" for i, (p, m) in
        enumerate([("stage", "abort"), ("stage", "quarantine"), ("commit", "abort"), ("commit", "quarantine")], 1)]


@pytest.mark.parametrize("spec, got, fired, calls, why", [
    (("disk", "prepare", "trainer1", "raise"), {1: {"raised": None}}, 1000.0, None, "trainer rank 1 did not raise"),
    (("disk", "prepare", "trainer1", "raise"), {1: {"crashed": "Traceback: KeyError"}}, 1000.0, None,
     "rank 1 crashed outside the with block: Traceback: KeyError"),
    (("disk", "prepare", "trainer1", "raise"), {}, None, None, "the fault never fired"),
    (("tensor", "sync_weights.bucket4", "worker1", "raise"), {}, 1000.0, 3, "a sync makes 3 engine update calls: there is no 4th"),
], ids=["no-raise", "crashed", "never-fired", "no-4th-call"])
def test_the_rules_the_judge_tests_did_not_break(spec, got, fired, calls, why):
    """Rules of `judge` no test broke (each could be dropped with every test passing)."""
    from fsdp_sync.cli.faults_cell import Timeouts, judge

    records = {r: dict(PASSING[r], clean_calls=calls or 3, t_raised=1000.02, **got.get(r, {})) for r in (0, 1)}
    cell = judge(faults.Cell(*spec), records, fired, Timeouts(), calls)
    assert [p for p in cell.problems if why in p], cell.problems
    clean = judge(faults.Cell(*spec), {r: dict(PASSING[r], clean_calls=7, t_raised=1000.02) for r in (0, 1)},
                  1000.0, Timeouts(), 7 if calls else None)
    assert clean.problems == [], clean.problems


def test_the_ranks_sync_errors_must_name_the_same_failure():
    """The help says every survivor raises the same SyncError; nothing compared them (a rank told
    another rank's failure, or another cause, passed). The failed rank words what failed by where
    it heard it (docs/data/faults.json: 6 cells), and each is cut at 400 characters: from "failed
    on rank" they must agree."""
    from fsdp_sync.cli.faults_cell import Timeouts, judge

    spec = ("tensor", "sync_weights", "trainer1", "raise")
    cause = "InjectedFault: injected fault: trainer 1 at sync_weights" + " x" * 300

    def judged(e0: str, e1: str) -> list[str]:
        got = {0: dict(PASSING[0], raised=e0[:400], t_raised=1000.02),
               1: dict(PASSING[1], raised=e1[:400], t_raised=1000.02)}
        return judge(faults.Cell(*spec), got, 1000.0, Timeouts(), None).problems

    assert judged(f"SyncError: weight sync failed on rank 1: {cause}",
                  f"SyncError: stage 'sync_weights' failed on rank 1: {cause}") == []
    problems = judged(f"SyncError: weight sync failed on rank 0: {cause}",
                      f"SyncError: stage 'sync_weights' failed on rank 1: {cause}")
    assert len(problems) == 1 and problems[0].startswith("the trainer ranks' SyncErrors disagree on what "
                                                         "failed: rank 0 SyncError: weight sync failed on rank 0"), problems
    assert judged(f"SyncError: weight sync failed on rank 1: {cause}",
                  "SyncError: weight sync failed on rank 1: EngineError: TP ranks [1] did not answer") != []


def test_a_matrix_of_cells_that_cannot_be_run_is_refused(capsys):
    """Only cells n/a by construction: it ran nothing, printed "0 run" and exited 0 (a fault check
    that checked nothing passed); refused before anything starts now, saying why and what to pick."""
    from fsdp_sync.cli import app as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["faults", "--methods", "disk", "--stages", "prepare", "--victims", "worker0"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "none of the 3 selected cells can run (stage 'prepare' does not call the engine with method " \
           "'disk' (not colocated)); select a stage the victim reaches" in err, err


# --------------------------------------------------------------------------- the hook's names

def test_a_point_is_matched_whole_or_with_its_tags(monkeypatch):
    """``worker:0:stage`` is the stage command of the tensor and disk methods; the worker's points
    ``stage_broadcast`` (the distributed method's) and ``stage_aside`` (inside staging) share its
    first letters and must not fire it (nor use up its ``FSDP_SYNC_FAULT_AFTER`` passes)."""
    from fsdp_sync import faultpoint

    monkeypatch.setattr(faultpoint, "_fired", set())
    monkeypatch.setattr(faultpoint, "_passed", {})
    monkeypatch.setenv(faultpoint.FAULT_ENV, "worker:0:stage:raise")
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "1")
    for point in ("stage_broadcast", "stage_aside", "stage_commit", "stages"):
        faultpoint.fault_point("worker", 0, point)
    faultpoint.fault_point("worker", 0, "stage")             # its one pass
    with pytest.raises(faultpoint.InjectedFault, match="worker 0 at stage:weights"):
        faultpoint.fault_point("worker", 0, "stage:weights")   # tags: the same point


# --------------------------------------------------------------------------- the soak's verdict

def test_a_soak_fails_threads_that_grow_and_a_process_that_is_gone():
    from fsdp_sync.cli.soak import _meets, summarise

    MiB = 2**20

    def sample(s, threads=4, gone=False):
        return {"sync": s, "p": None if gone else {"rss": 200 * MiB, "fds": 10, "threads": threads},
                "shm": 0, "temp_dirs": 0}

    rows = summarise({"m": [sample(s, threads=4 + s // 50) for s in (5, 55, 105)]}, ["p"], 5)
    assert rows[0]["threads_growth"] == 2 and rows[0]["fds_growth"] == 0 and not _meets(rows[0], 100)
    rows = summarise({"m": [sample(5), sample(55), sample(105, gone=True)]}, ["p"], 5)
    assert rows[0] == {"method": "m", "process": "p", "error": "process gone"} and not _meets(rows[0], 100)


@pytest.mark.timeout(120)
def test_ctrl_c_with_jobs_stops_the_matrix_and_ends_the_running_cells(tmp_path, monkeypatch):
    """``--jobs 2``: a Ctrl-C that reached fsdp-sync left the pool's ``with``, which waited for
    every cell left in the matrix (each one's hour-long stall included); a terminal's Ctrl-C also
    reached the idle pool processes, whose death broke the pool. Now the running cells are
    interrupted (their `run_cell` ends their jobs), the queued ones do not start, and it is
    over in seconds. Pool processes forked here keep the sleeping stand-in ranks."""
    import multiprocessing
    import tempfile
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch, "_context", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(launch, "_worker", _sleeping_rank)
    monkeypatch.setattr(faults, "_POOL_START", "fork")
    # nothing of torch in the forked pool processes (this process's threads may hold its locks):
    # no store, no first-use warm-up (these cells are interrupted, their fds never counted)
    monkeypatch.setattr(faults_cell, "_warm", lambda: None)
    monkeypatch.setattr(wire, "host_store", lambda *a, **k: types.SimpleNamespace(port=0))
    seen: set[int] = set()
    rescued: list[int] = []
    done = threading.Event()

    def ctrl_c() -> None:
        deadline = time.monotonic() + 60
        while len(seen) < 8 and time.monotonic() < deadline:       # two cells' ranks and workers
            seen.update(_pids(tmp_path))
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)
        if not done.wait(30):            # a hang guard, far past the second or so it takes
            rescued.extend(faults_cell._alive(seen | set(_pids(tmp_path))))
            for p in rescued:
                os.kill(p, signal.SIGKILL)

    cells = [faults.Cell("disk", "prepare", v, f) for v, f in (("trainer1", "stall"), ("trainer0", "stall"),
                                                             ("trainer1", "raise"))]
    # a process started in the background by a shell without job control ignores SIGINT (the
    # test's Ctrl-C then never arrived): the handler a terminal's python has, for this test
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=ctrl_c, daemon=True)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            faults.run_matrix(cells, progress=False, jobs=2)
    finally:
        signal.signal(signal.SIGINT, old)
        done.set()
        t.join()
        left = faults_cell._alive(seen)
        for p in left:
            os.kill(p, signal.SIGKILL)
    assert len(seen) == 8 and not rescued and not left, (seen, rescued, left)
    assert not list(tmp_path.glob("fsdp_sync_fault_*"))
    assert all(c.ok is None for c in cells)


def test_a_1000_sync_soak_that_leaks_exits_1(monkeypatch, capsys):
    """``--syncs 1000`` (the judged target): a trainer growing 2 KiB a sync (+1.95 MiB per 1000)
    is "target NOT met", exit 1; flat, "target met", exit 0. (Only the short run's exit code was
    tested: the judged run could exit 0 on a leak with every test passing.) The job is replaced
    by its samples."""
    from fsdp_sync import cli
    from fsdp_sync.cli import soak

    MiB = 2**20

    def job(rss):
        series = [{"sync": s, "trainer0": {"rss": int(rss(s)), "fds": 10, "threads": 4}, "shm": 0, "temp_dirs": 0}
                  for s in sorted(soak.sample_points(0, 1000, 100))]

        def run_ranks(fn, world, *args, **kwargs):
            return [{"series": {"disk": series}, "seconds": {"disk": 1.0}, "procs": ["trainer0"],
                     "tracemalloc": None}]
        return run_ranks

    argv = ["soak", "--syncs", "1000", "--warmup", "0", "--every", "100", "--methods", "disk", "--png", ""]
    monkeypatch.setattr(launch, "run_ranks", job(lambda s: 300 * MiB + s * 2048))
    assert cli.main(argv) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "RSS grew +1.95 MiB per 1000 syncs, budget 1 MiB" in text and "target NOT met" in text, text
    monkeypatch.setattr(launch, "run_ranks", job(lambda s: 300 * MiB))
    assert cli.main(argv) == 0
    assert "target met" in capsys.readouterr().out


def test_the_soak_counts_the_segments_of_its_processes_only():
    """`soak._shm_of`: the ``/dev/shm`` segments the given processes made (torch names them
    ``torch_<pid>_...``), not another process's, not one whose pid only starts the same."""
    from fsdp_sync.cli.soak import _shm_of

    pid = os.getpid()
    before = _shm_of([pid])
    names = [f"/dev/shm/torch_{pid}_h43_0", f"/dev/shm/torch_{pid}7_h43_1", "/dev/shm/torch_1_h43_2"]
    try:
        for n in names:
            open(n, "w").close()
        assert _shm_of([pid]) == before + 1
        assert _shm_of([pid, 1]) == _shm_of([pid]) + _shm_of([1]) and _shm_of([1]) >= 1
    finally:
        for n in names:
            os.unlink(n)
    assert _shm_of([pid]) == before


@pytest.mark.timeout(60)
def test_a_fleet_report_interrupted_mid_write_leaves_the_last_whole_one(monkeypatch, tmp_path):
    """``--fleet --json`` rewrote its report in place: a Ctrl-C mid-write left half a JSON file
    (`--resume` then refused it). It goes to a temp file renamed over it, as the matrix's does:
    a write interrupted after the first cell's report leaves that report whole."""
    import json
    from pathlib import Path

    from fsdp_sync.cli import app as cli
    from fsdp_sync.engines import reference

    class NoEngine:
        def __init__(self, *a, **k):
            raise RuntimeError("no engine here")

    real, writes = Path.write_text, []

    def half_then_ctrl_c(self, data, *a, **k):
        writes.append(self.name)
        if len(writes) == 2:             # the second report: half of it, then a Ctrl-C
            real(self, data[: len(data) // 2], *a, **k)
            raise KeyboardInterrupt
        return real(self, data, *a, **k)

    monkeypatch.setattr(reference, "ReferenceEngine", NoEngine)
    monkeypatch.setattr(Path, "write_text", half_then_ctrl_c)
    out = tmp_path / "fleet.json"
    assert cli.main(["faults", "--fleet", "--methods", "disk", "--faults", "kill", "--json", str(out),
                     "--no-progress"]) == 130                 # 'interrupted', as a Ctrl-C says
    assert len(writes) == 2, writes
    rep = json.loads(out.read_text())            # whole: the first cell's report
    assert rep["ran"] == 1 and rep["results"][0]["problems"] == ["RuntimeError: no engine here"], rep
