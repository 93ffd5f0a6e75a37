"""Fault injection: the ``fsdp-sync faults`` matrix over the `fault_point` hook (`fsdp_sync.faultpoint`).

The matrix (`run_matrix`, ``fsdp-sync faults``): method × stage × victim × fault, one fresh job per
cell (`fsdp_sync.cli.faults_cell`: 2 trainer ranks on gloo, a 2-worker `ReferenceEngine` held by
trainer rank 0, the tiny model; a clean sync, the faulted one, a recovery sync). Per cell: the
seconds from the fault until every surviving process raised (a `SyncError`, or where a trainer rank
died or stalled its process group's error; within the timeout that applies), the engine's state
afterwards (its previous weights, the complete new ones when the fault came after the sync, or
cleanly dead with a message; never anything else), whether it then takes the next sync, and what
was left (processes, fds and threads of this process, ``/dev/shm`` segments of the cell's
processes, the job's port, the temp directories its processes left in the cell's own ``TMPDIR``:
not another program's in the machine's). Cells where the victim is never reached by construction
(an engine worker in a stage that does not call the engine) are listed as ``n/a`` with the reason.
Not here: faults of real SGLang servers or of NCCL; the fleet's cells (`fsdp_sync.cli.faults_fleet`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict

from ..faultpoint import FAULT_ENV, InjectedFault, fault_point  # noqa: F401 - the hook the matrix sets
from .faults_cell import (FAULTS, METHODS, STAGES, SYNC_POINTS, VICTIMS, Cell, Timeouts, calls_per_sync,
                          cells, judge, run_cell, worker_point)

__all__ = ["fault_point", "InjectedFault", "FAULT_ENV", "Cell", "cells", "run_cell", "run_matrix", "judge",
           "add_faults_parser", "resumed_results", "METHODS", "STAGES", "SYNC_POINTS", "VICTIMS", "FAULTS", "Timeouts"]


# --------------------------------------------------------------------------- the matrix

_STOP = None
"""A pool process's event (`_pool_process`): set by the matrix once it is interrupted."""
_POOL_START = "spawn"      # how pool processes start (tests: "fork", so they keep the test's stand-ins)


def _pool_process(stop) -> None:
    """A pool process (``--jobs``) ignores Ctrl-C between cells (an interrupt there killed it,
    and a broken pool killed the others mid-cell); the matrix interrupts a running cell itself."""
    global _STOP
    _STOP = stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_cell_apart(key: tuple, timeouts: dict, calls: int | None) -> dict:
    """`run_cell` in a pool process (``--jobs``): its fds and threads are counted there, apart
    from the cells the other pool processes run at the same time (one cell at a time per process,
    as in a run without ``--jobs``). Once the matrix is interrupted (`_STOP`), a cell not yet
    started does not start, and a running one gets the Ctrl-C (`run_cell` then ends its job)."""
    if _STOP is not None and _STOP.is_set():
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if _STOP is not None and _STOP.is_set():     # its Ctrl-C came just before the line above
            raise KeyboardInterrupt
        cell = run_cell(Cell(*key), Timeouts(**timeouts), calls)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asdict(cell)


def _interrupt_pool(pool, stop) -> None:
    """The matrix is left by an exception (a Ctrl-C): no cell starts any more, the running ones
    are interrupted, and leaving the pool's ``with`` waits only for them to end their jobs (it
    waited for every cell left in the matrix)."""
    stop.set()
    for pid in list(getattr(pool, "_processes", None) or {}):
        try:
            os.kill(pid, signal.SIGINT)
        except OSError:
            pass
    pool.shutdown(wait=True, cancel_futures=True)


def _needs_calls(c: Cell) -> bool:
    """A worker's fault placed by the engine calls of a sync (`calls_per_sync`)."""
    point = worker_point(c.method, c.stage) if c.victim.startswith("worker") else None
    return point is not None and point[1] == "calls"


def _key(c: Cell) -> tuple:
    return (c.method, c.stage, c.victim, c.fault)


def _calls_or_none(method: str, t: Timeouts) -> int | None:
    """`calls_per_sync`, or None where it fails: each cell that needs it then tries and fails saying why."""
    try:
        return calls_per_sync(method, t)
    except Exception:  # noqa: BLE001 - reported by the cells
        return None


def run_matrix(selected: list[Cell], timeouts: Timeouts | None = None, progress: bool = True,
               on_cell=None, jobs: int = 1, done: dict | None = None) -> dict:
    """Run ``selected`` (impossible cells are only listed); returns the report dict.

    ``jobs`` > 1 runs that many cells at once, in as many pool processes (each cell has its own
    processes, port, tmp dir and segments; fds and threads are counted in the pool process that
    ran it, which runs one cell at a time).
    The cells' short timeouts assume the cores are not oversubscribed: give at most one job per
    4 cores. ``done``: results of cells run before (``--resume``), by (method, stage, victim,
    fault); they are taken as they are. ``on_cell(cell, report)`` after each cell."""
    import concurrent.futures as cf

    from rich.console import Console
    from rich.progress import Progress

    t = timeouts or Timeouts()
    t0 = time.monotonic()
    done = done or {}
    for c in selected:
        if c.possible and _key(c) in done:
            for k, v in done[_key(c)].items():
                if k in Cell.__dataclass_fields__:
                    setattr(c, k, v)
    todo = [c for c in selected if c.possible and c.ok is None]

    def report() -> dict:
        ran = [c for c in selected if c.possible and c.ok is not None]
        slow = max((c for c in ran if c.seconds_to_error is not None), key=lambda c: c.seconds_to_error,
                   default=None)
        return {
            "timeouts": asdict(t), "jobs": jobs,
            "cells": len(selected), "possible": sum(c.possible for c in selected), "ran": len(ran),
            "impossible": sum(not c.possible for c in selected),
            "passed": sum(bool(c.ok) for c in ran), "failed": sum(not c.ok for c in ran),
            "slowest_seconds_to_error": None if slow is None else slow.seconds_to_error,
            "slowest_cell": None if slow is None else f"{slow.method} {slow.stage} {slow.victim} {slow.fault}",
            "wall_s": round(time.monotonic() - t0, 1),
            "cells_wall_s": round(sum(c.wall_s for c in ran), 1),
            "results": [asdict(c) | {"spec": c.spec if c.possible else None} for c in selected],
        }

    # on stderr (stdout keeps the table); where it is no terminal (a log), a line a cell: the bar
    # is drawn there once, at the end of a run of up to an hour
    console = Console(stderr=True)
    logged = progress and not console.is_terminal
    with Progress(console=console, disable=not progress or logged, transient=False) as bar:
        task = bar.add_task("fault cells", total=len(todo))
        count = [0]

        def finished(c: Cell) -> None:
            if on_cell is not None:
                on_cell(c, report())
            bar.advance(task)
            count[0] += 1
            if logged:
                console.print(f"fault cell {count[0]}/{len(todo)}: {c.method} {c.stage} {c.victim} {c.fault}: "
                              f"{'pass' if c.ok else 'FAIL'} ({c.wall_s:g} s)", highlight=False, soft_wrap=True)

        if jobs <= 1:
            for c in todo:
                bar.update(task, description=f"{c.method} {c.stage} {c.victim} {c.fault}")
                run_cell(c, t)
                finished(c)
        elif todo:
            import multiprocessing

            ctx = multiprocessing.get_context(_POOL_START)
            stop = ctx.Event()
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_pool_process,
                                        initargs=(stop,)) as pool:
                try:
                    # measured once here, not once in every pool process
                    calls = {m: _calls_or_none(m, t) for m in sorted({c.method for c in todo if _needs_calls(c)})}
                    futures = {pool.submit(_run_cell_apart, _key(c), asdict(t), calls.get(c.method)): c
                               for c in todo}
                    for f in cf.as_completed(futures):
                        c = futures[f]
                        try:
                            for k, v in f.result().items():
                                setattr(c, k, v)
                        except Exception as exc:  # noqa: BLE001 - a cell's driver died: that cell fails
                            c.ok, c.problems = False, [f"the cell's process failed: {type(exc).__name__}: {exc}"]
                        finished(c)
                except BaseException:
                    _interrupt_pool(pool, stop)
                    raise
    return report()


# --------------------------------------------------------------------------- CLI

def _csv(choices):
    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            import argparse

            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def add_faults_parser(sub) -> None:
    from . import args as ca

    p = sub.add_parser(
        "faults", help="run the fault-injection matrix (method × stage × victim × fault)",
        description="Inject one fault per cell into a fresh 2-rank trainer + 2-worker reference "
                    "engine job (tiny model, CPU, gloo): a clean sync first (the engine then holds "
                    "real previous weights), then the faulted sync, then, where every trainer rank "
                    "is there and the engine serves, a recovery sync that must land bit for bit. "
                    "A cell passes when every surviving trainer rank raised a SyncError naming the "
                    "same failing rank and cause (a "
                    "survivor of a killed or stalled trainer rank: its process group's error) "
                    "within the timeout that applies plus --slack (a kill or an exception: --slack "
                    "alone), the engine then serves its previous weights (or the complete new ones "
                    "after the sync, or is cleanly dead and says so), the recovery sync lands, and "
                    "nothing is left behind (processes, fds, threads, /dev/shm segments, ports). "
                    "Victims: trainer rank 0 (holds the engine), trainer rank 1, engine worker 0, "
                    "engine worker 1; the sync_weights.* stages are a worker's points inside the "
                    "sync (its 4th engine call, an engine call's commit, end_weight_update). "
                    "Faults: kill (SIGKILL), raise (an exception at that point), stall (the process "
                    "sleeps; the others get out by timeouts: trainer process group --pg-timeout, "
                    "engine worker reply --call-timeout and receive --recv-timeout; real runs' "
                    "defaults are 60 s, 900 s and 60 s). Cells where the victim is never reached by "
                    "construction are listed as n/a. Exit code 1 if any cell fails. The injection "
                    "hook is the FSDP_SYNC_FAULT variable (see fsdp_sync/faultpoint.py).",
        formatter_class=ca.DefaultsFormatter)
    # string defaults: argparse parses them with ``type`` as it parses the flag, and --help
    # prints them as they are typed
    p.add_argument("--methods", type=_csv(METHODS), default=",".join(METHODS),
                   help="comma list of " + ", ".join(METHODS))
    p.add_argument("--stages", type=_csv(STAGES), default=",".join(STAGES),
                   help="comma list of " + ", ".join(STAGES))
    p.add_argument("--victims", type=_csv(VICTIMS), default=",".join(VICTIMS),
                   help="comma list of " + ", ".join(VICTIMS))
    p.add_argument("--faults", type=_csv(FAULTS), default=",".join(FAULTS),
                   help="comma list of " + ", ".join(FAULTS))
    p.add_argument("--pg-timeout", type=ca.positive_float, default=Timeouts.pg_s, help="trainer process-group timeout, s")
    p.add_argument("--call-timeout", type=ca.positive_float, default=Timeouts.call_s,
                   help="engine worker reply timeout, s; below --pg-timeout (refused otherwise where a worker stalls), so a stalled worker is "
                        "named by the engine before the process group gives up (--fleet: the "
                        "fleet's own default, %s s)" % _fleet_default("call_s"))
    p.add_argument("--recv-timeout", type=ca.positive_float, default=Timeouts.recv_s,
                   help="engine worker receive timeout (and the trainer's dist_timeout_s), s "
                        "(--fleet: the fleet's own default, %s s)" % _fleet_default("recv_s"))
    p.add_argument("--cell-timeout", type=ca.positive_float, default=Timeouts.cell_s,
                   help="a cell that runs longer is a hang, s")
    p.add_argument("--slack", type=ca.positive_float, default=Timeouts.slack_s,
                   help="how far past its timeout a cell's last survivor may raise (past the fault "
                        "for a kill or an exception, which wait on none), s")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here (rewritten after every cell)")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells that passed in --json PATH (an interrupted run with the same "
                        "timeouts) and run the others, failed ones included")
    p.add_argument("--jobs", type=ca.positive_int, default=1,
                   help="cells run at once, each in a process of its own; the short timeouts want "
                        "about 4 idle cores per job")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--fleet", action="store_true",
                   help="run the fleet cells instead: 3 replicas, replica 1 killed or stalled while "
                        "it stages or commits, method distributed|disk x on_replica_failure "
                        "abort|quarantine (16 cells, about 20 s each; --methods, --faults kill,stall "
                        "and --call-timeout/--recv-timeout apply; see fsdp_sync/cli/faults_fleet.py)")
    p.set_defaults(run=cmd_faults, check=check_faults_args)


_NOT_FLEET = ("stages", "victims", "pg_timeout", "cell_timeout", "slack", "jobs", "resume")   # the matrix's alone


def _fleet_default(name: str) -> float:
    """`run_fleet_matrix`'s own default for ``call_s`` / ``recv_s``."""
    import inspect

    from .faults_fleet import run_fleet_matrix

    return inspect.signature(run_fleet_matrix).parameters[name].default


def check_faults_args(args, given: set[str]) -> None:
    """Before any cell runs (ValueError names the flag): ``--call-timeout`` below ``--pg-timeout``
    where a worker is stalled (its cells are judged on it, `Timeouts`); ``--resume`` needs
    ``--json``, which
    (where it exists) must be a fault report run with the same timeouts (`resumed_results`); with
    ``--fleet``, a method or fault its cells do not cover, or a flag only the matrix takes, is
    refused (each was dropped without a word), and the defaults become the fleet's own: its
    methods and faults, and its timeouts where --call-timeout / --recv-timeout are not given (it
    ran with the matrix's before); a selection none of whose cells can run is refused (it ran
    nothing and exited 0)."""
    if args.fleet:
        for dest, name in (("call_timeout", "call_s"), ("recv_timeout", "recv_s")):
            if dest not in given:
                setattr(args, dest, _fleet_default(name))
        from .faults_fleet import FLEET_FAULTS, FLEET_METHODS

        for dest, covered in (("methods", FLEET_METHODS), ("faults", FLEET_FAULTS)):
            bad = [x for x in getattr(args, dest) if x not in covered]
            if dest in given and bad:
                raise ValueError(f"argument --{dest}: --fleet covers {', '.join(covered)}, got "
                                 f"{', '.join(bad)}")
            setattr(args, dest, tuple(x for x in getattr(args, dest) if x in covered))
        ignored = [f"--{d.replace('_', '-')}" for d in _NOT_FLEET if d in given]
        if ignored:
            raise ValueError(f"--fleet runs the fleet's own cells and does not take {', '.join(ignored)} "
                             f"(it takes --methods, --faults, --call-timeout, --recv-timeout, --json)")
    if not args.fleet:
        chosen = cells(args.methods, args.stages, args.victims, args.faults)
        if not any(c.possible for c in chosen):
            # it ran nothing, printed "0 run" and exited 0: a check that checked nothing passed
            raise ValueError(f"argument --stages/--victims: none of the {len(chosen)} selected cells can "
                             f"run ({chosen[0].reason}); select a stage the victim reaches (an engine "
                             f"worker's sync_weights.* points, a trainer rank's stage entries)")
    stalled_worker = "stall" in args.faults and any(v.startswith("worker") for v in args.victims)
    if not args.fleet and stalled_worker and args.call_timeout >= args.pg_timeout:
        # a stalled worker's cells then fail whatever the sync does: trainer rank 1 gives up with
        # its process group's error before rank 0 hears the engine name the worker
        raise ValueError(f"argument --call-timeout: {args.call_timeout:g} s must be below --pg-timeout "
                         f"{args.pg_timeout:g} s, so a stalled engine worker is named by the engine (one "
                         f"SyncError on every trainer rank) before the process group gives up; lower "
                         f"--call-timeout or raise --pg-timeout (or leave out --faults stall on workers)")
    if args.resume and not args.json:
        raise ValueError("argument --resume: needs --json PATH (the report of the interrupted run)")
    if args.resume and not args.fleet:     # a file that is no fault report: one line, not a traceback
        resumed_results(args.json, _timeouts(args))


def _timeouts(args) -> Timeouts:
    return Timeouts(pg_s=args.pg_timeout, call_s=args.call_timeout, recv_s=args.recv_timeout,
                    cell_s=args.cell_timeout, slack_s=args.slack)


def resumed_results(path: str, t: Timeouts) -> dict:
    """``--resume``: the results of the cells that passed in the report at ``path`` (none while
    it does not exist), by (method, stage, victim, fault). ValueError naming ``--json`` when the
    file is not a fault report or was run with other timeouts than ``t`` (``cell_s`` aside)."""
    from pathlib import Path

    if not Path(path).exists():
        return {}
    hint = ("give the report of an interrupted fsdp-sync faults run, or another --json (a new "
            "file) to run every cell")
    try:
        old = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"argument --json: --resume reads {path}, which is not JSON ({exc.msg}, line "
                         f"{exc.lineno} column {exc.colno}); {hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"argument --json: --resume cannot read {path} ({exc}); {hint}") from None
    results = old.get("results") if isinstance(old, dict) else None
    if not isinstance(results, list) or not isinstance(old.get("timeouts"), dict):
        got = f"keys {sorted(old)[:8]}" if isinstance(old, dict) else f"a JSON {type(old).__name__}"
        raise ValueError(f"argument --json: --resume reads {path}, which is not a fault report (an "
                         f"object with 'timeouts' and 'results'; got {got}); {hint}")
    names = ("method", "stage", "victim", "fault")
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in names):
            raise ValueError(f"argument --json: --resume reads {path}, whose results[{i}] is not a fault "
                             f"cell (its {', '.join(names)}; got {str(r)[:80]}); {hint}")
    same = {k: v for k, v in asdict(t).items() if k != "cell_s"}   # cell_s: only the hang limit
    if {k: v for k, v in old["timeouts"].items() if k != "cell_s"} != same:
        raise ValueError(f"argument --json: --resume: {path} was run with timeouts {old['timeouts']}, "
                         f"this run has {asdict(t)}; give the same ones or another --json")
    return {_key(Cell(*(r[k] for k in names))): r for r in results if r.get("possible") and r.get("ok")}


def _cmd_fleet(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from .faults_fleet import FLEET_FAULTS, FLEET_METHODS, fleet_cells, run_fleet_matrix

    # check_faults_args refused what the fleet does not cover; without it (a caller's own
    # namespace) the matrix's defaults keep what the fleet covers
    methods = [m for m in args.methods if m in FLEET_METHODS]
    faults = [f for f in args.faults if f in FLEET_FAULTS]
    selected = fleet_cells(methods=methods, faults=faults)

    def save(rep: dict) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            _write_report(args.json, rep)

    report = run_fleet_matrix(selected, progress=not args.no_progress, on_cell=save,
                              call_s=args.call_timeout, recv_s=args.recv_timeout)
    save(report)
    table = Table(title="fleet fault cells (replica 1 of 3 is the victim)")
    for col in ("method", "phase", "fault", "mode", "result", "sync s", "to quarantine s",
                "version", "replicas after", "next sync"):
        table.add_column(col)
    for c in selected:
        res = "[green]pass[/]" if c.ok else "[red]FAIL[/] " + "; ".join(c.problems)[:100]
        table.add_row(c.method, c.phase, c.fault, c.mode, res, str(c.sync_s),
                      "" if c.quarantine_s is None else str(c.quarantine_s), str(c.version_after),
                      ",".join(c.replicas_after), "ok" if c.recovered else "FAIL")
    console = Console(width=200)
    console.print(table)
    console.print(f"{report['cells']} cells: {report['passed']} passed, {report['failed']} failed; "
                  f"{report['wall_s']} s" + (f"; wrote {args.json}" if args.json else ""))
    return 0 if report["failed"] == 0 else 1


def cmd_faults(args) -> int:
    from pathlib import Path

    if getattr(args, "fleet", False):
        return _cmd_fleet(args)

    from rich.console import Console
    from rich.table import Table

    t = _timeouts(args)
    selected = cells(args.methods, args.stages, args.victims, args.faults)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    done: dict = {}
    if args.resume:
        if not args.json:
            raise SystemExit("--resume needs --json PATH (the report of the interrupted run)")
        try:                        # checked before (`check_faults_args`), unless a caller's own args
            done = resumed_results(args.json, t)
        except ValueError as exc:
            print(f"fsdp-sync faults: error: {exc}", file=sys.stderr)
            return 2

    def save(cell: Cell, rep: dict) -> None:
        if args.json:
            _write_report(args.json, rep)

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = run_matrix(selected, t, progress=not args.no_progress, on_cell=save, jobs=args.jobs, done=done)
    console = Console(width=200)
    table = Table(title="fault matrix")
    for col in ("method", "stage", "victim", "fault", "result", "s to error", "engine after", "next sync", "left"):
        table.add_column(col)
    for c in selected:
        res = "n/a" if not c.possible else "[green]pass[/]" if c.ok else "[red]FAIL[/] " + "; ".join(c.problems)[:120]
        table.add_row(c.method, c.stage, c.victim, c.fault, res,
                      "" if c.seconds_to_error is None else f"{c.seconds_to_error:.1f}",
                      c.engine[:40] if c.possible else c.reason[:40], c.recovery[:20],
                      str(c.leftovers or "") if c.possible else "")
    console.print(table)
    slowest = ("no time to error measured" if report["slowest_cell"] is None else
               f"slowest time to error {report['slowest_seconds_to_error']} s ({report['slowest_cell']})")
    console.print(f"{report['cells']} cells: {report['ran']} run, {report['impossible']} n/a by construction; "
                  f"{report['passed']} passed, {report['failed']} failed; {slowest}; {report['wall_s']} s "
                  f"(cells' own wall times add up to {report['cells_wall_s']} s)")
    if args.json:
        save(None, report)
        console.print(f"wrote {args.json}")
    return 0 if report["failed"] == 0 else 1


def _write_report(path: str, rep: dict) -> None:
    """Write a report whole or not at all (a Ctrl-C mid-write leaves the last one): to a temp file
    beside it, then renamed over it."""
    from pathlib import Path

    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(rep, indent=1))
    tmp.replace(path)
