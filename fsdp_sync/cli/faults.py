"""Fault injection: the ``fsdp-sync faults`` matrix over the `fault_point` hook (`fsdp_sync.faultpoint`).

The matrix (`run_matrix`, ``fsdp-sync faults``): method × stage × victim × fault, one fresh job per
cell (2 trainer ranks on gloo, a 2-worker `ReferenceEngine` held by trainer rank 0, the tiny model).
Per cell: the seconds from the fault until every surviving process raised, the engine's state
afterwards (its previous weights, the complete new ones when the fault came after the sync, or
cleanly dead with a message; never anything else) and what was left (processes, fds and threads of
this process, ``/dev/shm`` segments of the cell's processes, the job's port, the temp directories
its processes left in the cell's own ``TMPDIR``: not another program's in the machine's). Cells where the victim
is never reached by construction (an engine worker in a stage that does not call the engine) are
listed as ``n/a`` with the reason. Not here: faults of real SGLang servers or of NCCL.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..faultpoint import FAULT_ENV, InjectedFault, fault_point  # noqa: F401 - the hook the matrix sets
from ..memory import temp_dirs

__all__ = ["fault_point", "InjectedFault", "FAULT_ENV", "Cell", "cells", "run_cell", "run_matrix",
           "add_faults_parser", "METHODS", "STAGES", "VICTIMS", "FAULTS", "Timeouts"]

# --------------------------------------------------------------------------- the matrix

METHODS = ("tensor", "distributed", "disk")
ENTRY = ("prepare", "resume_weights", "sync_weights", "offload_params", "resume_kv_cache", "swap_rng")
EXIT = ("release_memory", "restore_module", "restore_rng")
STAGES = ENTRY + EXIT
VICTIMS = ("trainer0", "trainer1", "worker0", "worker1")
FAULTS = ("kill", "raise", "stall")
WORLD, TP = 2, 2


@dataclass
class Timeouts:
    """The matrix's timeouts (small, so a stall costs seconds). Real runs' defaults: trainer
    process group 60 s in `launch.run_ranks` (torch's own default: 10 min), engine worker reply
    ``call_timeout_s`` 900 s, worker receive ``update_recv_timeout_s`` 60 s, ``dist_timeout_s`` 600 s."""
    pg_s: float = 6.0
    call_s: float = 8.0
    recv_s: float = 6.0
    cell_s: float = 150.0


def _worker_point(method: str, stage: str) -> str | None:
    """The engine command a worker is faulted on in ``stage``, None if the stage never calls it."""
    if stage == "sync_weights":
        return "stage_broadcast" if method == "distributed" else "stage"
    if method == "tensor":   # colocated: the engine-memory stages call the engine
        return {"resume_weights": "resume:weights", "resume_kv_cache": "resume:kv_cache",
                "release_memory": "release"}.get(stage)
    return None


@dataclass
class Cell:
    method: str
    stage: str
    victim: str
    fault: str
    possible: bool = True
    reason: str = ""
    ok: bool | None = None
    seconds_to_error: float | None = None
    survivors: dict = field(default_factory=dict)
    engine: str = ""
    leftovers: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def spec(self) -> str:
        side, rank = self.victim[:-1], int(self.victim[-1])
        point = self.stage if side == "trainer" else _worker_point(self.method, self.stage)
        return f"{side}:{rank}:{point}:{self.fault}"


def cells(methods=METHODS, stages=STAGES, victims=VICTIMS, faults=FAULTS) -> list[Cell]:
    out = []
    for m in methods:
        for s in stages:
            for v in victims:
                for f in faults:
                    c = Cell(m, s, v, f)
                    if v.startswith("worker") and _worker_point(m, s) is None:
                        c.possible = False
                        c.reason = (f"stage {s!r} does not call the engine with method {m!r}"
                                    + ("" if m == "tensor" else " (not colocated)"))
                    out.append(c)
    return out


def _cell_rank(rank: int, world: int, method: str, stage: str, tmp: str, t: dict) -> dict:
    """One trainer rank of a cell: set up, train a step, enter/exit the manager once (the fault
    fires somewhere in it), record when it raised and, on rank 0, what the engine serves now."""
    import torch

    from ..config import SyncConfig
    from ..engines import ReferenceEngine
    from ..engines.base import checksum_named_tensors
    from ..weights.export import iter_params
    from ..manager import FSDPShardingManager
    from ..models import build_model, load_config
    from ..topology import make_mesh
    from .trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    # the group was made with the cell's long timeout (a starved machine may take seconds to start
    # a rank, and the rendezvous must wait for it); the with block runs under the short one
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=t["pg_s"]))
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    mesh = make_mesh(world // TP, TP) if method == "tensor" else None
    engine = None
    if rank == 0:
        engine = ReferenceEngine(model_config=cfg, tp_size=TP, dtype=torch.float32, kv_cache_tokens=64,
                                 weights_cpu_backup=True, call_timeout_s=t["call_s"],
                                 update_recv_timeout_s=t["recv_s"], pg_timeout_s=t["pg_s"])
        with open(os.path.join(tmp, "pids"), "a") as f:
            f.write(" ".join(map(str, engine.worker_pids)) + "\n")
        open(os.path.join(tmp, "ready"), "w").close()
    with open(os.path.join(tmp, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    # the engine's start takes longer than the matrix's short process-group timeout on a busy
    # machine: the other ranks wait for it here, outside any collective
    deadline = time.monotonic() + t["cell_s"]
    while not os.path.exists(os.path.join(tmp, "ready")) and time.monotonic() < deadline:
        time.sleep(0.05)
    rec: dict[str, Any] = {"rank": rank}
    try:
        before = engine.weights_checksum() if engine is not None else None
        train_step(module, opt, synthetic_batch(cfg.vocab_size, step=0, rank=rank))
        new = checksum_named_tensors([(n, x.clone()) for n, x in iter_params(module, dtype=torch.float32)])
        conf = SyncConfig(method=method, dtype=torch.float32, bucket_bytes=48 << 10, memory_probe="off",
                          dist_timeout_s=t["recv_s"], disk_dir=os.path.join(tmp, "disk"))
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=conf)
        try:
            with manager:
                pass
            rec["raised"] = None
        except BaseException as exc:  # noqa: BLE001 - what we measure
            rec["raised"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["t_raised"] = time.time()
        if engine is not None:
            rec["engine"] = _engine_state(engine, method, before, new)
        try:
            manager.close()
        except Exception as exc:  # noqa: BLE001 - a broken engine cannot leave a group
            rec["close"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if engine is not None:
            engine.shutdown()
    return rec


def _engine_state(engine, method: str, before: str, new: str) -> str:
    from ..engines import EngineError

    try:
        if method == "tensor":   # colocated: released on the failed entry's way out; CPU backup
            try:
                engine.resume_memory_occupation()
            except EngineError as exc:
                if "not released" not in str(exc) and "already" not in str(exc):
                    raise
        got = engine.weights_checksum()
    except Exception as exc:  # noqa: BLE001 - a dead engine must say so
        msg = f"{type(exc).__name__}: {str(exc)[:200]}"
        return f"dead: {msg}" if "shut it down" in msg or "died" in msg or "cannot serve" in msg \
            else f"ERROR {msg}"
    return "previous" if got == before else "new" if got == new else "HALF-APPLIED"


def _shm(pids: set[int]) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if any(f"_{p}_" in f"_{n}_" or n.startswith(f"torch_{p}_")
                                          for p in pids))


def _alive(pids) -> list[int]:
    import psutil

    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _threads() -> int:
    return threading.active_count()


def _fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _warm() -> None:
    """Start what a first use starts once per process (the resource tracker, a spawn queue's
    machinery, torch's store machinery), so fds and threads before and after a cell compare."""
    from multiprocessing import resource_tracker

    import torch.multiprocessing as mp

    from ..wire import host_store

    resource_tracker.ensure_running()
    # dropped at once: torch's first store in a process opens a pipe pair that stays. A generous
    # timeout: a store's own handshake sometimes stalls 5 s in torch (about 2% of rapid openings)
    host_store(1, 60.0)
    q = mp.get_context("spawn").Queue()
    q.put(1)
    q.get()
    q.close()
    q.join_thread()


def run_cell(cell: Cell, timeouts: Timeouts | None = None) -> Cell:
    """Run one cell in fresh processes; fills in its result (``ok`` and the figures)."""
    import queue
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from . import launch
    from ..wire import host_store

    t = timeouts or Timeouts()
    if not cell.possible:
        return cell
    _warm()
    t0 = time.monotonic()
    fds0, threads0 = _fds(), _threads()
    tmp = tempfile.mkdtemp(prefix="fsdp_sync_fault_")
    log = os.path.join(tmp, "fault.log")
    # the ranks and the engine's workers (started by rank 0) read the spec from their environment;
    # tmp is their TMPDIR, where the temp directories they leave are counted (and nowhere else)
    env = launch.spawn_env({"FSDP_SYNC_FAULT": cell.spec, "FSDP_SYNC_FAULT_LOG": log, "TMPDIR": tmp})
    ctx = launch._context()   # fresh interpreters, or FSDP_SYNC_RANKS_START=forkserver's forks, as run_ranks
    results = ctx.Queue()
    store = host_store(WORLD, t.cell_s)     # listening before the ranks are told its port (as run_ranks)
    port = store.port
    args = (cell.method, cell.stage, tmp, asdict(t))
    procs = [ctx.Process(target=launch._worker, name=f"fsdp_sync-fault-rank{r}",
                         args=(r, WORLD, port, "gloo", t.cell_s, _cell_rank, args, results, env))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    trainer_victim = int(cell.victim[-1]) if cell.victim.startswith("trainer") else None
    expect = {r for r in range(WORLD) if not (r == trainer_victim and cell.fault != "raise")}
    got: dict[int, Any] = {}
    deadline = time.monotonic() + t.cell_s
    import pickle

    while expect - set(got) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(procs[r].exitcode is not None for r in expect - set(got)):
                break
            continue
        got[rank] = pickle.loads(payload) if ok else {"rank": rank, "crashed": payload[-600:]}
    if expect - set(got):
        cell.problems.append(f"HANG: ranks {sorted(expect - set(got))} did not finish within {t.cell_s:.0f}s")
    for p in procs:
        p.join(timeout=5.0 if p.pid and (trainer_victim is None or procs.index(p) != trainer_victim) else 0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    results.close()
    results.join_thread()
    # what fired, who raised, how fast
    fired = None
    if os.path.exists(log):
        with open(log) as f:
            first = f.readline().split()
        fired = float(first[0]) if first else None
    if fired is None:
        cell.problems.append("the fault never fired (the victim did not reach its point)")
    for r in sorted(expect):
        rec = got.get(r, {})
        if "crashed" in rec:
            cell.problems.append(f"rank {r} crashed outside the with block: {rec['crashed']}")
            continue
        if r in got and rec.get("raised") is None:
            cell.problems.append(f"trainer rank {r} did not raise")
        cell.survivors[f"trainer{r}"] = (rec.get("raised") or "")[:200]
    times = [got[r]["t_raised"] for r in expect if "t_raised" in got.get(r, {})]
    if fired is not None and times:
        cell.seconds_to_error = round(max(times) - fired, 2)
    # the engine
    if 0 in got and "engine" in got[0]:
        cell.engine = got[0]["engine"]
        after_sync = STAGES.index(cell.stage) > STAGES.index("sync_weights")
        allowed = ("previous", "new", "dead") if after_sync else ("previous", "dead")
        if not cell.engine.startswith(allowed):
            cell.problems.append(f"engine: {cell.engine} (allowed: {', '.join(allowed)})")
    else:
        cell.engine = "dead: its owner (trainer rank 0) is gone; its workers exit as orphans"
    # leftovers
    pids: set[int] = {p.pid for p in procs if p.pid}
    port_used = port
    try:
        with open(os.path.join(tmp, "pids")) as f:
            pids |= {int(x) for x in f.read().split()}
    except OSError:
        pass
    end = time.monotonic() + max(15.0, t.recv_s + 5)
    while _alive(pids) and time.monotonic() < end:
        time.sleep(0.2)
    left = {"processes": _alive(pids), "shm": _shm(pids),
            "temp_dirs": sorted(temp_dirs(tmp))}
    for p in procs:
        try:
            p.close()
        except ValueError:
            pass
    import gc

    del results, procs, store   # a queue this process never put into keeps its write end until collected
    gc.collect()
    left["fds"] = _fds() - fds0
    left["threads"] = _threads() - threads0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is not a leftover
        try:
            s.bind(("127.0.0.1", port))
            left["port"] = None
        except OSError:
            left["port"] = port
    for pid in left["processes"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    cell.leftovers = {k: v for k, v in left.items() if v}
    if cell.leftovers:
        cell.problems.append(f"left behind: {cell.leftovers}")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    cell.wall_s = round(time.monotonic() - t0, 1)
    cell.ok = not cell.problems
    return cell


def _run_cell_apart(key: tuple, timeouts: dict) -> dict:
    """`run_cell` in a pool process (``--jobs``): its fds and threads are counted there, apart
    from the cells the other pool processes run at the same time (one cell at a time per process,
    as in a run without ``--jobs``)."""
    cell = run_cell(Cell(*key), Timeouts(**timeouts))
    return asdict(cell)


def _key(c: Cell) -> tuple:
    return (c.method, c.stage, c.victim, c.fault)


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

    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("fault cells", total=len(todo))

        def finished(c: Cell) -> None:
            if on_cell is not None:
                on_cell(c, report())
            bar.advance(task)

        if jobs <= 1:
            for c in todo:
                bar.update(task, description=f"{c.method} {c.stage} {c.victim} {c.fault}")
                run_cell(c, t)
                finished(c)
        elif todo:
            import multiprocessing

            with cf.ProcessPoolExecutor(max_workers=jobs,
                                        mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(_run_cell_apart, _key(c), asdict(t)): c for c in todo}
                for f in cf.as_completed(futures):
                    c = futures[f]
                    try:
                        for k, v in f.result().items():
                            setattr(c, k, v)
                    except Exception as exc:  # noqa: BLE001 - a cell's driver died: that cell fails
                        c.ok, c.problems = False, [f"the cell's process failed: {type(exc).__name__}: {exc}"]
                    finished(c)
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
                    "engine job (tiny model, CPU, gloo) and check that every surviving process "
                    "raises within seconds, that the engine then serves its previous weights (or "
                    "the complete new ones after the sync, or is cleanly dead and says so) and that "
                    "nothing is left behind (processes, fds, threads, /dev/shm segments, ports). "
                    "Victims: trainer rank 0 (holds the engine), trainer rank 1, engine worker 0, "
                    "engine worker 1. Faults: kill (SIGKILL), raise (an exception at that point), "
                    "stall (the process sleeps; the others get out by timeouts: trainer process "
                    "group --pg-timeout, engine worker reply --call-timeout and receive "
                    "--recv-timeout; real runs' defaults are 60 s, 900 s and 60 s). Cells where the "
                    "victim is never reached by construction are listed as n/a. Exit code 1 if any "
                    "cell fails. The injection hook is the FSDP_SYNC_FAULT variable "
                    "(see fsdp_sync/faultpoint.py).",
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
                   help="engine worker reply timeout, s (--fleet: the fleet's own default, %s s)"
                        % _fleet_default("call_s"))
    p.add_argument("--recv-timeout", type=ca.positive_float, default=Timeouts.recv_s,
                   help="engine worker receive timeout (and the trainer's dist_timeout_s), s "
                        "(--fleet: the fleet's own default, %s s)" % _fleet_default("recv_s"))
    p.add_argument("--cell-timeout", type=ca.positive_float, default=Timeouts.cell_s,
                   help="a cell that runs longer is a hang, s")
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


_NOT_FLEET = ("stages", "victims", "pg_timeout", "cell_timeout", "jobs", "resume")   # the matrix's alone


def _fleet_default(name: str) -> float:
    """`run_fleet_matrix`'s own default for ``call_s`` / ``recv_s``."""
    import inspect

    from .faults_fleet import run_fleet_matrix

    return inspect.signature(run_fleet_matrix).parameters[name].default


def check_faults_args(args, given: set[str]) -> None:
    """Before any cell runs (ValueError names the flag): ``--resume`` needs ``--json``; with
    ``--fleet``, a method or fault its cells do not cover, or a flag only the matrix takes, is
    refused (each was dropped without a word), and the defaults become the fleet's own: its
    methods and faults, and its timeouts where --call-timeout / --recv-timeout are not given (it
    ran with the matrix's before)."""
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
    if args.resume and not args.json:
        raise ValueError("argument --resume: needs --json PATH (the report of the interrupted run)")


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
            Path(args.json).write_text(json.dumps(rep, indent=1))

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

    t = Timeouts(pg_s=args.pg_timeout, call_s=args.call_timeout, recv_s=args.recv_timeout,
                 cell_s=args.cell_timeout)
    selected = cells(args.methods, args.stages, args.victims, args.faults)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    done: dict = {}
    if args.resume:
        if not args.json:
            raise SystemExit("--resume needs --json PATH (the report of the interrupted run)")
        if Path(args.json).exists():
            old = json.loads(Path(args.json).read_text())
            same = {k: v for k, v in asdict(t).items() if k != "cell_s"}   # cell_s: only the hang limit
            if {k: v for k, v in (old.get("timeouts") or {}).items() if k != "cell_s"} != same:
                raise SystemExit(f"--resume: {args.json} was run with timeouts {old.get('timeouts')}, "
                                 f"this run has {asdict(t)}; give the same ones or another --json")
            done = {_key(Cell(r["method"], r["stage"], r["victim"], r["fault"])): r
                    for r in old["results"] if r.get("possible") and r.get("ok")}

    def save(cell: Cell, rep: dict) -> None:
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(rep, indent=1))
            tmp.replace(args.json)

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = run_matrix(selected, t, progress=not args.no_progress, on_cell=save, jobs=args.jobs, done=done)
    console = Console(width=200)
    table = Table(title="fault matrix")
    for col in ("method", "stage", "victim", "fault", "result", "s to error", "engine after", "left"):
        table.add_column(col)
    for c in selected:
        res = "n/a" if not c.possible else "[green]pass[/]" if c.ok else "[red]FAIL[/] " + "; ".join(c.problems)[:120]
        table.add_row(c.method, c.stage, c.victim, c.fault, res,
                      "" if c.seconds_to_error is None else f"{c.seconds_to_error:.1f}",
                      c.engine[:40] if c.possible else c.reason[:40], str(c.leftovers or "") if c.possible else "")
    console.print(table)
    console.print(f"{report['cells']} cells: {report['ran']} run, {report['impossible']} n/a by construction; "
                  f"{report['passed']} passed, {report['failed']} failed; slowest time to error "
                  f"{report['slowest_seconds_to_error']} s ({report['slowest_cell']}); {report['wall_s']} s "
                  f"(cells' own wall times add up to {report['cells_wall_s']} s)")
    if args.json:
        save(None, report)
        console.print(f"wrote {args.json}")
    return 0 if report["failed"] == 0 else 1
