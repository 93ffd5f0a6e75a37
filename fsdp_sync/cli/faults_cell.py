"""One cell of the ``fsdp-sync faults`` matrix: what a cell is (`Cell`, `Timeouts`, the stages and
the engine-worker points), the job that runs it (`run_cell`) and the rules it is judged by (`judge`,
a pure function of the ranks' records, tested without processes).

A cell's job: 2 trainer ranks on gloo, a 2-worker `ReferenceEngine` held by trainer rank 0, the
tiny model. It trains a step and syncs once cleanly (so the engine holds real previous weights and
an update into it is staged, as every sync after a job's first is), trains a step and syncs again
with the fault armed; where every trainer rank is still there and the engine still serves, it
trains and syncs a third time (the recovery sync) and checks the engine then holds exactly those
weights. A worker's fault is armed from the start with ``FSDP_SYNC_FAULT_AFTER`` set to the passes
of its point in the clean sync (`calls_per_sync`, measured once per method); a trainer rank's is
set in its environment after the clean sync. Not here: the matrix over the cells and the command
(`fsdp_sync.cli.faults`), the hook itself (`fsdp_sync.faultpoint`).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..faultpoint import FAULT_ENV
from ..memory import temp_dirs

__all__ = ["Cell", "Timeouts", "cells", "run_cell", "judge", "calls_per_sync", "METHODS", "STAGES",
           "SYNC_POINTS", "VICTIMS", "FAULTS", "BACKEND_ERRORS"]

METHODS = ("tensor", "distributed", "disk")
# the engine worker's points inside `sync_weights` past its first bucket (no trainer point there:
# the manager's hook fires at a stage's entry)
SYNC_POINTS = ("sync_weights.bucket4", "sync_weights.commit", "sync_weights.end")
ENTRY = ("prepare", "resume_weights", "sync_weights") + SYNC_POINTS + (
    "offload_params", "resume_kv_cache", "swap_rng")
EXIT = ("release_memory", "restore_module", "restore_rng")
STAGES = ENTRY + EXIT
AFTER_SYNC = ENTRY[ENTRY.index("offload_params"):] + EXIT    # the new weights are committed by then
VICTIMS = ("trainer0", "trainer1", "worker0", "worker1")
FAULTS = ("kill", "raise", "stall")
WORLD, TP = 2, 2
LATER = 3      # sync_weights.bucket4: the worker's stage command of the sync's 4th engine call
# the engine's weight-update calls: each stages on every worker, then commits (one ``stage`` or
# ``stage_broadcast`` command and one ``commit`` each), whichever method makes it
UPDATE_CALLS = ("update_weights_from_tensor", "load_rank_bucket", "update_weights_from_distributed",
                "update_weights_from_disk")
# what a rank's process group raises when a peer dies or stalls (gloo: RuntimeError); the exception
# a survivor of a dead or stalled *trainer* rank may get instead of a SyncError
BACKEND_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


@dataclass
class Timeouts:
    """The matrix's timeouts (small, so a stall costs seconds). The engine's reply timeout is below
    the process-group timeout, so a stalled worker is named by the engine (a `SyncError` on every
    rank) before the rank waiting for the engine's owner gives up with the process group's own
    error. Real runs' defaults: trainer process group 60 s in `launch.run_ranks` (torch's own
    default: 10 min), engine worker reply ``call_timeout_s`` 900 s, worker receive
    ``update_recv_timeout_s`` 60 s, ``dist_timeout_s`` 600 s. ``slack_s``: how far past its
    timeout (past the fault, for a kill or an exception, which wait on none) a cell's last survivor
    may raise."""
    pg_s: float = 6.0
    call_s: float = 4.0
    recv_s: float = 6.0
    cell_s: float = 150.0
    slack_s: float = 3.0


def worker_point(method: str, stage: str) -> tuple[str, str] | None:
    """The engine command a worker is faulted on in ``stage`` and what its passes before the
    faulted sync are counted in (``"calls"``: one a engine call of a sync; ``"sync"``: one a
    sync), or None if the stage never reaches a worker."""
    stage_cmd = "stage_broadcast" if method == "distributed" else "stage"
    if stage == "sync_weights":
        return stage_cmd, "calls"
    if stage == "sync_weights.bucket4":
        return (stage_cmd, "calls") if method != "disk" else None
    if stage == "sync_weights.commit":
        return "commit", "calls"        # each engine call's commit round (staged into the transaction)
    if stage == "sync_weights.end":
        return "end", "sync"            # end_weight_update: the transaction's commit
    if method == "tensor":   # colocated: the engine-memory stages call the engine
        cmd = {"resume_weights": "resume:weights", "resume_kv_cache": "resume:kv_cache",
               "release_memory": "release"}.get(stage)
        return None if cmd is None else (cmd, "sync")
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
    limit_s: float | None = None      # seconds_to_error above this fails the cell (see `time_limit`)
    survivors: dict = field(default_factory=dict)
    engine: str = ""
    recovery: str = ""
    after: int | None = None          # passes of the worker's point before it acts
    leftovers: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def spec(self) -> str:
        side, rank = self.victim[:-1], int(self.victim[-1])
        point = self.stage if side == "trainer" else worker_point(self.method, self.stage)[0]
        return f"{side}:{rank}:{point}:{self.fault}"

    @property
    def trainer_lost(self) -> bool:
        """A trainer rank dies or stalls: its peer gets out by its process group, not by `agree`."""
        return self.victim.startswith("trainer") and self.fault != "raise"


def cells(methods=METHODS, stages=STAGES, victims=VICTIMS, faults=FAULTS) -> list[Cell]:
    out = []
    for m in methods:
        for s in stages:
            for v in victims:
                for f in faults:
                    c = Cell(m, s, v, f)
                    if v.startswith("trainer") and s in SYNC_POINTS:
                        c.possible = False
                        c.reason = "an engine worker's point: the trainer's hook fires at a stage's entry"
                    elif v.startswith("worker") and worker_point(m, s) is None:
                        c.possible = False
                        c.reason = ("the disk method loads a sync in one engine call: no 4th"
                                    if s == "sync_weights.bucket4" else
                                    f"stage {s!r} does not call the engine with method {m!r}"
                                    + ("" if m == "tensor" else " (not colocated)"))
                    out.append(c)
    return out


# --------------------------------------------------------------------------- the rules

def time_limit(cell: Cell, t: Timeouts) -> tuple[float, str]:
    """The most seconds from the fault to the last survivor's error, and why: a stalled trainer
    rank, the process-group timeout; a stalled worker, the engine's reply timeout; a kill or an
    exception waits on no timeout (a closed connection, a dead process, an `agree`). Plus slack."""
    if cell.fault == "stall":
        base, what = ((t.pg_s, "the process-group timeout") if cell.victim.startswith("trainer")
                      else (t.call_s, "the engine's reply timeout"))
        return base + t.slack_s, f"{what} {base:g} s + {t.slack_s:g} s"
    return t.slack_s, f"{t.slack_s:g} s (a {cell.fault} waits on no timeout)"


def allowed_errors(cell: Cell) -> tuple[str, ...]:
    """What a surviving trainer rank must raise: the same `SyncError` on every rank, except where a
    trainer rank died or stalled, which cannot agree: its peer may get its process group's error."""
    return ("SyncError",) + (BACKEND_ERRORS if cell.trainer_lost else ())


def _disagreement(raised: dict[int, str]) -> str | None:
    """The ranks' `SyncError` s name different failing ranks or causes (the text from "failed on
    rank N"; what failed before it is worded by where each rank heard it: "stage 'sync_weights'
    failed on rank 0: X" on the failed rank, "weight sync failed on rank 0: X" on its peer), or
    None. Compared as far as the shorter one goes (each is cut at 400 characters)."""
    tails = {r: e.split(" failed on ", 1)[1] for r, e in raised.items()
             if e.startswith("SyncError:") and " failed on " in e}
    if len(tails) < 2:
        return None
    n = min(map(len, tails.values()))
    if len({t[:n] for t in tails.values()}) == 1:
        return None
    return ("the trainer ranks' SyncErrors disagree on what failed: "
            + "; ".join(f"rank {r} {raised[r][:160]}" for r in sorted(tails)))


def judge(cell: Cell, got: dict[int, dict], fired: float | None, t: Timeouts,
          calls: int | None = None) -> Cell:
    """Fill in ``cell`` from what its ranks recorded (``got``: rank -> record; a rank that died as
    the fault meant is absent) and when the fault fired; appends every broken rule to
    ``cell.problems``. Pure: the processes are `run_cell`'s."""
    expect = [r for r in range(WORLD) if not (cell.trainer_lost and r == int(cell.victim[-1]))]
    if any("clean" in got.get(r, {}) for r in expect):
        r = next(r for r in expect if "clean" in got.get(r, {}))
        early = fired is not None and fired <= got[r].get("t_clean_failed", fired)
        cell.problems.append(
            f"the clean sync before the fault failed on rank {r}: {got[r]['clean'][:200]}"
            + (f" (the fault fired in it: FSDP_SYNC_FAULT_AFTER={cell.after} counted {calls} engine "
               f"update calls a sync)" if early else ""))
        return cell
    if fired is None:
        cell.problems.append("the fault never fired (the victim did not reach its point)")
    if cell.stage.endswith("bucket4") and calls is not None and calls <= LATER:
        cell.problems.append(f"a sync makes {calls} engine update calls: there is no 4th")
    done = [got[r]["t_raised"] for r in expect if "t_raised" in got.get(r, {})]
    if fired is not None and done and fired > max(done):
        cell.problems.append("the fault fired after the faulted sync (in the recovery sync)")
    clean_calls = got.get(0, {}).get("clean_calls")
    if calls is not None and clean_calls is not None and clean_calls != calls:
        cell.problems.append(f"the clean sync made {clean_calls} engine update calls, the fault was "
                             f"placed counting {calls}")
    allowed = allowed_errors(cell)
    for r in expect:
        rec = got.get(r, {})
        if "crashed" in rec:
            cell.problems.append(f"rank {r} crashed outside the with block: {rec['crashed']}")
            continue
        raised = rec.get("raised")
        cell.survivors[f"trainer{r}"] = (raised or "")[:200]
        if r in got and raised is None:
            cell.problems.append(f"trainer rank {r} did not raise")
        elif raised and raised.split(":", 1)[0] not in allowed:
            cell.problems.append(f"trainer rank {r} raised {raised.split(':', 1)[0]}, not "
                                 f"{' or '.join(allowed)}: {raised[:160]}")
    disagree = _disagreement({r: got[r]["raised"] for r in expect if (got.get(r) or {}).get("raised")})
    if disagree:
        cell.problems.append(disagree)
    times = [got[r]["t_raised"] for r in expect if "t_raised" in got.get(r, {})]
    if fired is not None and times:
        cell.seconds_to_error = round(max(times) - fired, 2)
        cell.limit_s, why = time_limit(cell, t)
        if cell.seconds_to_error > cell.limit_s:
            cell.problems.append(f"the last survivor raised {cell.seconds_to_error:.2f} s after the "
                                 f"fault, more than {cell.limit_s:g} s ({why})")
    # the engine
    if "engine" in got.get(0, {}):
        cell.engine = got[0]["engine"]
        states = ("previous", "new", "dead") if cell.stage in AFTER_SYNC else ("previous", "dead")
        if not cell.engine.startswith(states):
            cell.problems.append(f"engine: {cell.engine} (allowed: {', '.join(states)})")
    else:
        cell.engine = "dead: its owner (trainer rank 0) is gone; its workers exit as orphans"
    # the recovery sync: wherever every trainer rank is there and the engine still serves
    serves = cell.engine.startswith(("previous", "new"))
    cell.recovery = got.get(0, {}).get("recovery", "")
    if not cell.trainer_lost and serves:
        bad = {r: got.get(r, {}).get("recovery", "not run") for r in expect}
        bad = {r: v for r, v in bad.items() if v != "ok"}
        if bad:
            cell.problems.append("the recovery sync: " + "; ".join(f"rank {r} {v[:200]}" for r, v in bad.items()))
    return cell


# --------------------------------------------------------------------------- the job

def _cell_rank(rank: int, world: int, method: str, tmp: str, t: dict, plan: dict) -> dict:
    """One trainer rank of a cell: set up, then the clean sync, the faulted one (``plan["arm"]``:
    the trainer's spec, set once the clean sync is done) and, where ``plan["recover"]``, the
    recovery sync. Records when it raised and, on rank 0, what the engine serves.
    ``plan["calibrate"]``: stop after the clean sync (`calls_per_sync`)."""
    import torch

    from ..config import SyncConfig
    from ..engines import ReferenceEngine
    from ..engines.base import checksum_named_tensors
    from ..manager import FSDPShardingManager
    from ..models import build_model, load_config
    from ..topology import make_mesh
    from ..weights.export import iter_params
    from .trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    # the group was made with the cell's long timeout (a starved machine may take seconds to start
    # a rank, and the rendezvous must wait for it); the syncs run under the short one
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=t["pg_s"]))
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    mesh = make_mesh(world // TP, TP) if method == "tensor" else None
    engine = None
    calls = [0]
    if rank == 0:
        engine = ReferenceEngine(model_config=cfg, tp_size=TP, dtype=torch.float32, kv_cache_tokens=64,
                                 weights_cpu_backup=True, call_timeout_s=t["call_s"],
                                 update_recv_timeout_s=t["recv_s"], pg_timeout_s=t["pg_s"])
        _count_updates(engine, calls)
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

    def trained(step: int) -> str:
        train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
        return checksum_named_tensors([(n, x.clone()) for n, x in iter_params(module, dtype=torch.float32)])

    def sync() -> str | None:
        try:
            with manager:
                pass
            return None
        except BaseException as exc:  # noqa: BLE001 - what we measure
            return f"{type(exc).__name__}: {str(exc)[:400]}"

    manager = None
    try:
        conf = SyncConfig(method=method, dtype=torch.float32, bucket_bytes=48 << 10, memory_probe="off",
                          dist_timeout_s=t["recv_s"], disk_dir=os.path.join(tmp, "disk"))
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=conf)
        previous = trained(0)
        err = sync()
        if err is not None:
            rec.update(clean=err, t_clean_failed=time.time())
            return rec
        rec["clean_calls"] = calls[0]
        if plan.get("calibrate"):
            return rec
        if plan.get("arm"):
            os.environ[FAULT_ENV] = plan["arm"]
        new = trained(1)
        rec["raised"] = sync()
        rec["t_raised"] = time.time()
        if engine is not None:
            rec["engine"] = _engine_state(engine, method, previous, new)
        if plan.get("recover"):
            rec["recovery"] = _recover(rec, engine, method, trained, sync)
    finally:
        if manager is not None:
            try:
                manager.close()
            except Exception as exc:  # noqa: BLE001 - a broken engine cannot leave a group
                rec["close"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if engine is not None:
            engine.shutdown()
    return rec


def _count_updates(engine, calls: list) -> None:
    """Count the engine's weight-update calls (`UPDATE_CALLS`, the outermost where one calls
    another) in ``calls[0]``: the worker commands a sync makes, which the transports' own
    ``stats.engine_calls`` does not count alike (distributed: one a sync)."""
    depth = [0]

    def counted(fn):
        def call(*args, **kwargs):
            calls[0] += depth[0] == 0
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in UPDATE_CALLS:
        setattr(engine, name, counted(getattr(engine, name)))


def _recover(rec: dict, engine, method: str, trained, sync) -> str:
    """The recovery sync, where every rank got a `SyncError` (its group still agrees) and the
    engine still serves: "ok" when the engine then holds exactly the trainer's weights."""
    import torch
    import torch.distributed as dist

    fit = (rec.get("raised") or "").startswith("SyncError:") and (
        engine is None or rec["engine"].startswith(("previous", "new")))
    flag = torch.tensor([1 if fit else 0], dtype=torch.int64)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    except Exception as exc:  # noqa: BLE001 - a broken group: said in the record
        return f"not run: the trainer group cannot agree any more ({type(exc).__name__}: {str(exc)[:120]})"
    if not int(flag.item()):
        return "not run: " + ("the engine does not serve" if not fit and engine is not None
                              else "a rank got no SyncError")
    latest = trained(2)
    err = sync()
    if err is not None:
        return f"failed: {err}"
    if engine is not None:
        state = _engine_state(engine, method, "", latest)
        if state != "new":
            return f"wrong: after the recovery sync the engine is {state}, not the trainer's weights"
    return "ok"


def _engine_state(engine, method: str, previous: str, new: str) -> str:
    """What the engine serves: "previous", "new", "dead: ..." (it says on every call that it
    cannot serve: `dead_reason`), "unserved: ..." (a refusal of a live engine), "ERROR ..." or
    "HALF-APPLIED". Colocated, its memory is resumed to read it and released again after, as
    the manager's exit leaves it."""
    try:
        if method == "tensor":   # colocated: released on the way out (the CPU backup keeps it)
            engine.resume_memory_occupation()
        got = engine.weights_checksum()
        if method == "tensor":
            engine.release_memory_occupation()
    except Exception as exc:  # noqa: BLE001 - a dead engine must say so
        msg = f"{type(exc).__name__}: {str(exc)[:200]}"
        # "partly overwritten": start-up weights an aborted update wrote over in place, served again
        # once every tensor is pushed (not the state of an engine that held a sync's weights)
        return (f"dead: {msg}" if engine.dead_reason() is not None
                else f"unserved: {msg}" if "overwritten" in msg else f"ERROR {msg}")
    return "previous" if got == previous else "new" if got == new else "HALF-APPLIED"


# --------------------------------------------------------------------------- leftovers

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


# --------------------------------------------------------------------------- running a cell

_CALLS: dict[str, int] = {}


def calls_per_sync(method: str, timeouts: Timeouts | None = None) -> int:
    """The engine's weight-update calls in one sync of a cell's job (each is one ``stage`` and one
    ``commit`` command on every worker): measured once per method in this process by running the
    job's clean sync alone, so a worker's fault lands in the sync after it."""
    if method not in _CALLS:
        import tempfile

        from . import launch

        t = timeouts or Timeouts()
        with tempfile.TemporaryDirectory(prefix="fsdp_sync_fault_count_") as tmp:
            recs = launch.run_ranks(_cell_rank, WORLD, method, tmp, asdict(t), {"calibrate": True},
                                    env=launch.spawn_env({FAULT_ENV: "", "TMPDIR": tmp}),
                                    timeout_s=t.cell_s, pg_timeout_s=t.cell_s)
        if "clean" in recs[0]:
            raise RuntimeError(f"counting the engine calls of a {method} sync: {recs[0]['clean']}")
        _CALLS[method] = int(recs[0]["clean_calls"])
    return _CALLS[method]


def _stop_cell(procs: list, tmp: str) -> None:
    """End a cell's job that was left part-way: its ranks, what they started (the engine's
    workers, by the pids the ranks wrote to ``tmp``), then remove ``tmp`` once their
    ``/dev/shm`` segments are gone (or after 5 s)."""
    import shutil

    import psutil

    pids = {p.pid for p in procs if p.pid}
    for p in procs:
        try:
            pids |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        except (psutil.Error, TypeError, ValueError):
            pass
    try:
        with open(os.path.join(tmp, "pids")) as f:
            pids |= {int(x) for x in f.read().split()}
    except (OSError, ValueError):
        pass
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        if p.pid:
            p.join(timeout=5.0)
    end = time.monotonic() + 5.0
    while (_alive(pids) or _shm(pids)) and time.monotonic() < end:
        time.sleep(0.1)
    shutil.rmtree(tmp, ignore_errors=True)


def run_cell(cell: Cell, timeouts: Timeouts | None = None, calls: int | None = None) -> Cell:
    """Run one cell in fresh processes; fills in its result (``ok`` and the figures). ``calls``:
    `calls_per_sync` of its method, measured here where a worker's point needs it and not given."""
    import gc
    import pickle
    import queue
    import shutil
    import socket
    import tempfile

    from . import launch
    from ..wire import host_store

    t = timeouts or Timeouts()
    if not cell.possible:
        return cell
    t0 = time.monotonic()
    worker = worker_point(cell.method, cell.stage) if cell.victim.startswith("worker") else None
    if worker is not None and worker[1] == "calls" and calls is None:
        try:
            calls = calls_per_sync(cell.method, t)
        except Exception as exc:  # noqa: BLE001 - the cell cannot be placed: it fails, saying why
            cell.problems.append(f"{type(exc).__name__}: {str(exc)[:400]}")
            cell.ok, cell.wall_s = False, round(time.monotonic() - t0, 1)
            return cell
    if worker is not None:
        cell.after = (calls if worker[1] == "calls" else 1) + (LATER if cell.stage.endswith("bucket4") else 0)
    _warm()
    fds0, threads0 = _fds(), _threads()
    tmp = tempfile.mkdtemp(prefix="fsdp_sync_fault_")
    procs: list = []
    try:
        log = os.path.join(tmp, "fault.log")
        # the ranks and the engine's workers (started by rank 0) read the spec from their environment;
        # tmp is their TMPDIR, where the temp directories they leave are counted (and nowhere else)
        env = launch.spawn_env({FAULT_ENV: cell.spec if worker else "", "FSDP_SYNC_FAULT_AFTER": str(cell.after or 0),
                                "FSDP_SYNC_FAULT_LOG": log, "TMPDIR": tmp})
        plan = {"arm": None if worker else cell.spec, "recover": not cell.trainer_lost}
        ctx = launch._context()   # fresh interpreters, or FSDP_SYNC_RANKS_START=forkserver's forks, as run_ranks
        results = ctx.Queue()
        store = host_store(WORLD, t.cell_s)     # listening before the ranks are told its port (as run_ranks)
        port = store.port
        args = (cell.method, tmp, asdict(t), plan)
        procs[:] = [ctx.Process(target=launch._worker, name=f"fsdp_sync-fault-rank{r}",
                                args=(r, WORLD, port, "gloo", t.cell_s, _cell_rank, args, results, env))
                    for r in range(WORLD)]
        for p in procs:
            p.start()
        trainer_victim = int(cell.victim[-1]) if cell.victim.startswith("trainer") else None
        expect = {r for r in range(WORLD) if not (r == trainer_victim and cell.trainer_lost)}
        got: dict[int, Any] = {}
        deadline = time.monotonic() + t.cell_s
        while expect - set(got) and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if all(procs[r].exitcode is not None for r in expect - set(got)):
                    break
                continue
            got[rank] = pickle.loads(payload) if ok else {"rank": rank, "crashed": payload[-600:]}
        missing = sorted(expect - set(got))
        dead = [r for r in missing if procs[r].exitcode is not None]
        if dead:            # not a hang: gone without a result (killed, or a crash past the catch)
            cell.problems.append("; ".join(f"rank {r} exited (code {procs[r].exitcode}) without a result"
                                           for r in dead))
        if set(missing) - set(dead):
            cell.problems.append(f"HANG: ranks {sorted(set(missing) - set(dead))} did not finish "
                                 f"within {t.cell_s:.0f}s")
        for r, p in enumerate(procs):
            p.join(timeout=0.1 if r == trainer_victim else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        results.join_thread()
        fired = None
        if os.path.exists(log):
            with open(log) as f:
                first = f.readline().split()
            fired = float(first[0]) if first else None
        judge(cell, got, fired, t, calls)
        # leftovers
        pids: set[int] = {p.pid for p in procs if p.pid}
        try:
            with open(os.path.join(tmp, "pids")) as f:
                pids |= {int(x) for x in f.read().split()}
        except OSError:
            pass
        # a killed process's segments are unlinked by its torch_shm_manager once it notices the death:
        # those a stalled rank killed just above kept from the clean sync (disk) take a moment to go
        # (counted at once, they were reported; they were gone when looked at again); a leak stays
        end = time.monotonic() + max(15.0, t.recv_s + 5)
        while (_alive(pids) or _shm(pids)) and time.monotonic() < end:
            time.sleep(0.2)
        left = {"processes": _alive(pids), "shm": _shm(pids), "temp_dirs": sorted(temp_dirs(tmp))}
        for p in procs:
            try:
                p.close()
            except ValueError:
                pass
        procs.clear()
        del results, store   # a queue this process never put into keeps its write end until collected
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
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        # a Ctrl-C (or any error) while the job runs: its processes are not daemons and a stalled
        # one sleeps for an hour, so this interpreter's exit waited for them, and the cell's temp
        # directory (a disk checkpoint in it) stayed. Ended and removed here, a Ctrl-C held meanwhile
        with launch._HeldInterrupts(drop=True):
            _stop_cell(procs, tmp)
        raise
    cell.wall_s = round(time.monotonic() - t0, 1)
    cell.ok = not cell.problems
    return cell
