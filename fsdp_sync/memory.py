"""Memory probes and the stage timeline.

`probe()` reads a process's memory from /proc (RSS, peak RSS, anonymous and shared-memory RSS;
USS and PSS on request) plus CUDA allocated/reserved when CUDA is in use. `Timeline` records, for each named stage of a sync, its wall time and the memory of the trainer rank and of
the engine's workers after it; it renders to a dict/JSON and to a short log line.

`empty_cache()` hands cached free memory back: torch's CUDA cache, and the free pages of glibc's
heap (``malloc_trim``).

Not here: deciding which stage runs when (manager), freeing anything, or the memory tags and
their release/resume orders (the engine protocol's, `engines.base`).
"""

from __future__ import annotations

import os
import sys

import ctypes
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import psutil
import torch

__all__ = ["probe", "StageRecord", "Timeline", "empty_cache", "status", "temp_dirs"]


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim   # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


_LIBC: Any = None


def temp_dirs(root: str | None = None) -> set[str]:
    """The temporary directories that processes of a sync made and did not remove: Python
    multiprocessing's ``pymp-*`` (its listeners' sockets) and ``torch-shm-dir-*`` (a
    ``torch_shm_manager``'s socket), in ``root`` (default: the temp directory). A running owner
    keeps a socket bound in its directory and removes the directory when it exits; what counts is a
    directory with no socket a live process has bound: empty (an exited owner's) or holding a dead
    one (a killed owner's). Who made one cannot be told afterwards, so the machine's temp directory
    holds every other program's too: `fsdp-sync soak` and the fault matrix give their job a
    ``TMPDIR`` of its own (`cli.launch.run_ranks`'s ``env``) and count only there; the verl tier
    counts new ones with its other leftovers."""
    import glob
    import tempfile

    root = root or tempfile.gettempdir()
    found = glob.glob(os.path.join(root, "pymp-*")) + glob.glob(os.path.join(root, "torch-shm-dir-*"))
    held = _bound_socket_dirs()
    out = set()
    for d in found:
        try:
            if held is not None and d not in held:
                out.add(d)
            elif not os.listdir(d):   # not allowed to see other processes' sockets: empty ones only
                out.add(d)
        except OSError:
            continue    # removed meanwhile, or not ours to read
    return out


def _bound_socket_dirs() -> set[str] | None:
    """The directories of the Unix sockets live processes have bound (None: not allowed to see)."""
    import psutil

    try:
        conns = psutil.net_connections("unix")
    except (psutil.AccessDenied, OSError):
        return None
    return {os.path.dirname(c.laddr) for c in conns if isinstance(c.laddr, str) and c.laddr}


def empty_cache() -> None:
    """Give cached free memory back to the system: torch's CUDA cache, and the free pages of
    glibc's heaps (``malloc_trim(0)``; a no-op without glibc).

    Why the heap too: glibc keeps what a process frees at the top of its heaps and in per-thread
    arenas, so a trainer rank's RSS creeps up over thousands of steps (training alone, with no
    sync at all: +2.5 MiB over 400 steps of the soak's tiny model, all of it handed back by one
    ``malloc_trim``, see docs/reliability.md "Soak") and a colocated engine finds less memory than is free.
    The trim takes well under a millisecond for the soak's trainer; it only returns whole free
    pages, never memory in use.

    The device is synchronized first, as verl does after a weight update before it resumes the
    engine's KV cache: the work queued on the freed blocks is done when they are handed back."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_STATUS_KEYS = {"VmRSS:": "rss", "VmHWM:": "rss_peak", "RssAnon:": "anon", "RssShmem:": "shmem"}


def status(pid: int | str) -> dict[str, int]:
    """RSS, its peak, and its anonymous and shared-memory parts from /proc/<pid>/status (~50 µs)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = _STATUS_KEYS.get(line.split(None, 1)[0])
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            out["rss"] = int(psutil.Process(None if pid == "self" else int(pid)).memory_info().rss)
        except psutil.Error:
            pass
    return out


def _rollup(pid: int | str) -> dict[str, int]:
    """USS and PSS from /proc/<pid>/smaps_rollup (a few ms in a torch process)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            vals = {}
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    vals[parts[0][:-1]] = int(parts[1]) * 1024
        out["pss"] = vals.get("Pss", 0)
        out["uss"] = vals.get("Private_Clean", 0) + vals.get("Private_Dirty", 0)
    except OSError:
        pass
    return out


def probe(pid: int | None = None, *, full: bool = True) -> dict[str, int]:
    """Memory of a process (default: this one) in bytes: rss, rss_peak, anon, shmem from
    /proc/<pid>/status, with ``full`` also uss and pss (smaps_rollup); plus CUDA allocator stats
    when this process uses CUDA."""
    who = "self" if pid is None else pid
    out = status(who)
    if full:
        out.update(_rollup(who))
    if pid is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update(cuda_allocated=int(torch.cuda.memory_allocated()),
                   cuda_reserved=int(torch.cuda.memory_reserved()),
                   cuda_max_allocated=int(torch.cuda.max_memory_allocated()))
    return out


@dataclass
class StageRecord:
    name: str
    seconds: float
    memory: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # time.perf_counter() at the stage's start (same clock as samplers)
    watch_error: str | None = None   # the stage's watcher failed (`Timeline.watch`): how


def _enter_watch(watcher: Any, rec: StageRecord) -> Any:
    """Enter a stage's watcher (a context manager, or a callable making one): the entered one, or
    None. A watcher that fails is recorded in ``rec.watch_error``, never raised: the stage runs
    on every rank alike, so that its collectives stay in step (a measurement is not the sync)."""
    if watcher is None:
        return None
    try:
        cm = watcher() if callable(watcher) else watcher
        cm.__enter__()
        return cm
    except Exception as exc:  # noqa: BLE001 - recorded, see above
        rec.watch_error = f"entering: {type(exc).__name__}: {exc}"
        return None


@dataclass
class Timeline:
    """Stages of one enter/exit in order, each with seconds and memory after it."""

    stages: list[StageRecord] = field(default_factory=list)
    engine_pids: list[int] = field(default_factory=list)
    mode: str = "rss"    # "rss": /proc status only (cheap); "full": + uss/pss (smaps_rollup); "off": none
    # stage name -> a context manager (or a callable making one) entered just before that stage
    # starts and left just after it ends, outside its seconds: a measurement of that stage alone
    # (`fsdp-sync bench`'s CUDA allocator peaks of ``sync_weights``, `cli.bench.gpu_memory`); one
    # that raises is recorded in the stage's ``watch_error``, and the stage goes on (`_enter_watch`)
    watch: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        t0 = time.perf_counter()
        rec = StageRecord(name, 0.0, started=t0)
        watcher = _enter_watch(self.watch.get(name), rec)
        rec.started = t0 = time.perf_counter()
        try:
            yield rec
        finally:
            rec.seconds = time.perf_counter() - t0
            if self.mode != "off":
                full = self.mode == "full"
                rec.memory["trainer"] = probe(full=full)
                if self.engine_pids:
                    # read from /proc, not asked of the engine: no RPC, works on a dead worker too
                    rec.memory["engine"] = {"workers": [dict(probe(p, full=full), pid=p)
                                                        for p in self.engine_pids]}
            self.stages.append(rec)
            if watcher is not None:
                try:
                    watcher.__exit__(*sys.exc_info())
                except Exception as exc:  # noqa: BLE001 - a measurement never fails the stage
                    rec.watch_error = f"leaving: {type(exc).__name__}: {exc}"

    def seconds(self, name: str) -> float:
        return sum(s.seconds for s in self.stages if s.name == name)

    def to_dict(self) -> list[dict]:
        return [asdict(s) for s in self.stages]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        def mb(rec: StageRecord) -> str:
            m = rec.memory.get("trainer", {})
            v = m.get("cuda_allocated", m.get("rss", 0))
            return f"{v / 2**20:.0f}MB"
        return " | ".join(f"{s.name} {s.seconds * 1e3:.1f}ms {mb(s)}" for s in self.stages)
