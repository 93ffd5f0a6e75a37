"""The fleet cells of ``fsdp-sync faults --fleet``: one replica of three killed or stalled while
it stages an update or while it commits it, under each `SyncConfig.on_replica_failure`, for the
two methods that sync several replicas (distributed, disk).

One cell: a one-process trainer (the tiny model), three `ReferenceEngine` replicas (TP 1), a sync
to version 0, a training step, then the sync to version 1 with replica 1's worker faulted
(`ReferenceEngine._set_fault`: ``die_in_stage``, ``stall_in_stage``, ``die_in_commit``,
``stall_in_commit``), then (abort: after ``remove_engine`` of the victim) a sync to version 2.
What each cell must show, by real weights (every replica's checksum against the trainer's):

    stage  + abort       the sync raises naming replica 1; replicas 0 and 2 keep version 0's weights
    stage  + quarantine  no error; replicas 0 and 2 hold version 1; replica 1 is out of service
    commit + abort       the sync raises naming replica 1; 0 and 2 hold version 1 (a commit cannot
                         be undone), replica 1 is out of service, the manager's version stays 0
    commit + quarantine  no error; 0 and 2 hold version 1; replica 1 is out of service

and afterwards the fleet syncs version 2 to the survivors, bit for bit, and nothing is left over
(child processes) once the engines are shut down. ``quarantine_s``: from the start of the faulted
sync to the moment replica 1 was taken out of service.

Not here: the trainer/worker matrix (`faults`), faults of real SGLang servers.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FleetCell", "fleet_cells", "run_fleet_cell", "run_fleet_matrix", "FLEET_METHODS",
           "PHASES", "FLEET_FAULTS", "MODES"]

FLEET_METHODS = ("distributed", "disk")
PHASES = ("stage", "commit")
FLEET_FAULTS = ("kill", "stall")
MODES = ("abort", "quarantine")
VICTIM = 1


@dataclass
class FleetCell:
    method: str
    phase: str
    fault: str
    mode: str
    ok: bool | None = None
    problems: list[str] = field(default_factory=list)
    error: str = ""
    sync_s: float | None = None
    quarantine_s: float | None = None
    version_after: str | None = None
    replicas_after: list[str] = field(default_factory=list)
    recovered: bool | None = None
    leftovers: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def fleet_cells(methods=FLEET_METHODS, phases=PHASES, faults=FLEET_FAULTS, modes=MODES) -> list[FleetCell]:
    return [FleetCell(m, p, f, o) for m, p, f, o in itertools.product(methods, phases, faults, modes)]


def _checksum(engine: Any) -> str:
    return "dead" if engine.dead_reason() else engine.weights_checksum()


def _trainer_checksum(module: Any) -> str:
    from ..engines.base import checksum_named_tensors
    from ..weights import export

    return checksum_named_tensors(list(export.iter_params(module, dtype=None)))


def run_fleet_cell(cell: FleetCell, *, call_s: float = 6.0, recv_s: float = 6.0) -> FleetCell:
    """Run one cell (see the module docstring) and fill in what it saw; ``ok`` says whether it
    showed what it must."""
    import psutil
    import torch

    from ..config import SyncConfig
    from ..engines.reference import ReferenceEngine
    from ..manager import FSDPShardingManager
    from ..models import build_model, load_config
    from ..topology import SyncError

    t0 = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}   # not the cell's
    tmp = tempfile.mkdtemp(prefix="fsdp_sync-fleet-")
    engines: list = []
    manager = None
    problems = cell.problems
    try:
        engines = [ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=call_s,
                                   update_recv_timeout_s=recv_s) for _ in range(3)]
        module = build_model(load_config("tiny"), seed=0)
        cfg = SyncConfig(method=cell.method, bucket_bytes=1 << 20, on_replica_failure=cell.mode,
                         dist_timeout_s=recv_s * 3, **({"disk_dir": tmp} if cell.method == "disk" else {}))
        manager = FSDPShardingManager(module, engines, config=cfg)
        with manager:
            pass
        v0 = _trainer_checksum(module)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01)
        v1 = _trainer_checksum(module)
        engines[VICTIM]._set_fault(0, f"{'die' if cell.fault == 'kill' else 'stall'}_in_{cell.phase}")
        t_sync = time.monotonic()
        try:
            with manager:
                pass
        except SyncError as exc:
            cell.error = str(exc)
        cell.sync_s = round(time.monotonic() - t_sync, 2)
        rep = manager.fleet.replicas[VICTIM]
        if rep.quarantined_at is not None:
            cell.quarantine_s = round(rep.quarantined_at - t_sync, 2)
        cell.version_after = manager.version
        sums = [_checksum(e) for e in engines]
        cell.replicas_after = ["v0" if s == v0 else "v1" if s == v1 else s[:12] for s in sums]
        want_error = cell.mode == "abort"
        if want_error and "replica 1" not in cell.error:
            problems.append(f"abort: expected an error naming replica 1, got {cell.error or 'none'!r}")
        if not want_error and cell.error:
            problems.append(f"quarantine: the sync raised {cell.error[:200]!r}")
        survivors = "v0" if (cell.phase, cell.mode) == ("stage", "abort") else "v1"
        for i in (0, 2):
            if cell.replicas_after[i] != survivors:
                problems.append(f"replica {i} holds {cell.replicas_after[i]}, expected {survivors}")
        want_version = "1" if cell.mode == "quarantine" else "0"
        if manager.version != want_version:
            problems.append(f"manager.version {manager.version!r}, expected {want_version!r}")
        quarantined = cell.mode == "quarantine" or cell.phase == "commit"
        if quarantined and rep.serving:
            problems.append("replica 1 still in service")
        if quarantined and engines[VICTIM] in manager.engines:
            problems.append("replica 1 still synced")
        # the fleet goes on without it
        if rep.serving or cell.mode == "abort":
            manager.remove_engine(engines[VICTIM])
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01)
        v2 = _trainer_checksum(module)
        with manager:
            pass
        cell.recovered = all(_checksum(engines[i]) == v2 for i in (0, 2))
        if not cell.recovered:
            problems.append("the next sync did not bring replicas 0 and 2 to version 2")
    except Exception as exc:  # noqa: BLE001 - a cell that crashed is a failed cell
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if manager is not None:
            manager.close()
        for e in engines:
            e.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and not _per_process_helper(p)]
        _, alive = psutil.wait_procs(children, timeout=5)
        cell.leftovers = [p.pid for p in alive]
        if alive:
            problems.append(f"processes left: {cell.leftovers}")
    cell.ok = not problems
    cell.wall_s = round(time.monotonic() - t0, 1)
    return cell


def run_fleet_matrix(selected: list[FleetCell], *, progress: bool = True, on_cell=None,
                     call_s: float = 6.0, recv_s: float = 6.0) -> dict:
    """Run ``selected`` one after another; returns the report (``on_cell(report)`` after each)."""
    from rich.console import Console
    from rich.progress import Progress

    t0 = time.monotonic()

    def report() -> dict:
        ran = [c for c in selected if c.ok is not None]
        return {"matrix": "fleet", "cells": len(selected), "ran": len(ran),
                "passed": sum(bool(c.ok) for c in ran), "failed": sum(not c.ok for c in ran),
                "timeouts": {"call_s": call_s, "recv_s": recv_s},
                "wall_s": round(time.monotonic() - t0, 1), "results": [asdict(c) for c in selected]}

    console = Console(stderr=True)
    logged = progress and not console.is_terminal      # a log: a line a cell (no bar is drawn there)
    with Progress(console=console, disable=not progress or logged, transient=True) as bar:
        task = bar.add_task("fleet cells", total=len(selected))
        for i, c in enumerate(selected):
            run_fleet_cell(c, call_s=call_s, recv_s=recv_s)
            bar.advance(task)
            if logged:
                console.print(f"fleet cell {i + 1}/{len(selected)}: {c.method} {c.phase} {c.fault} {c.mode}: "
                              f"{'pass' if c.ok else 'FAIL'} ({c.wall_s:g} s)", highlight=False, soft_wrap=True)
            if on_cell is not None:
                on_cell(report())
    return report()


# started once per process by multiprocessing and torch and kept for its life, by design (the
# first cell of a process that starts engine workers through a forkserver starts them)
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "torch_shm_manager")


def _per_process_helper(proc) -> bool:
    import psutil

    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False        # gone already: wait_procs sees it gone
    return any(h in cmd for h in _HELPERS)

