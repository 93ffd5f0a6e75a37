"""Run a function on N local ranks, each in its own process with a gloo (or NCCL) process group.

This is what the demo, the benchmarks and the multi-process tests use to stand up a trainer world
on one machine. Every process group gets a timeout, the whole job gets a deadline, and a rank that
fails or hangs takes the whole job down with its traceback: no rank waits forever and no process
is left behind. The job's rendezvous store is hosted by the calling process, listening before the
ranks start (`wire.host_store`), so no other process can take its port in between.

Ranks start as ``spawn`` children (fresh interpreters) by default. ``FSDP_SYNC_RANKS_START=forkserver``
(the test suite sets it) forks them from one server process that has already imported torch,
transformers and fsdp_sync (`PRELOAD`): each rank then skips seconds of imports, which adds up over
a test run of many small jobs. The server holds no process group, thread pool or CUDA context when
it forks.

It is not a general launcher (no multi-node, no elastic restarts): use torchrun for that; the
library itself only needs an initialized default process group.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from ..engines.reference.procs import claim_temp_dir, forkserver_usable, prefork_worker_server
from ..wire import host_store, join_store

__all__ = ["run_ranks", "RankError", "spawn_env", "PRELOAD"]

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "fsdp_sync.manager", "fsdp_sync.models",
           "fsdp_sync.engines", "fsdp_sync.engines.reference.preloaded"]
"""What the forkserver imports once, before it forks ranks (``FSDP_SYNC_RANKS_START=forkserver``),
in order: `preloaded` last, which freezes the rest (a quick exit for the server, see there)."""


def _context():
    how = os.environ.get("FSDP_SYNC_RANKS_START", "spawn")
    if how not in ("spawn", "forkserver"):
        raise ValueError(f"FSDP_SYNC_RANKS_START must be 'spawn' or 'forkserver', got {how!r}")
    if how == "forkserver" and not forkserver_usable():
        how = "spawn"   # e.g. a TMPDIR too long for the server's socket
    ctx = mp.get_context(how)
    if how == "forkserver":
        claim_temp_dir()        # a named pymp dir, removable once this process is gone
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RankError(RuntimeError):
    """A rank of a `run_ranks` job raised, died or ran past the deadline."""


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What a rank's collective raises when another rank went away first: its failure is a symptom."""


def _others(results: "mp.Queue", procs: list, got: dict, first: int,
            grace_s: float = 2.0) -> tuple[dict[int, str], dict[int, int]]:
    """After rank ``first`` failed: the other ranks' failures that arrive within ``grace_s`` (a rank
    that failed first may be read second), and the ranks gone by then without a result, with
    their exit codes (a crash: a signal, ``os._exit``)."""
    failed: dict[int, str] = {}
    until = time.monotonic() + grace_s
    while len(got) + 1 + len(failed) < len(procs) and time.monotonic() < until:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if ok:
            got[rank] = None
        else:
            failed[rank] = payload
    dead = {r: p.exitcode for r, p in enumerate(procs)
            if r != first and r not in got and r not in failed and p.exitcode is not None}
    return failed, dead


def _failure_report(first: dict[int, str], failed: dict[int, str], dead: dict[int, int]) -> str:
    """One message for a failed job: the cause first (a rank that died without a result, else a
    failure that is not a peer having gone), then one line for each other rank that failed."""
    failed = {**first, **failed}
    causes = [r for r, tb in failed.items() if not any(s in tb for s in _PEER_GONE)]
    lines = [f"rank {r} exited with code {code} without a result" for r, code in sorted(dead.items())]
    if causes or not dead:
        lead = (causes or list(failed))[0]
        lines.insert(0 if causes else len(lines), f"rank {lead} failed:\n{failed.pop(lead)}")
    lines += [f"rank {r} failed too: {(tb.strip().splitlines() or [''])[-1]}" for r, tb in sorted(failed.items())]
    return "\n".join(lines)


def _worker(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float,
            fn: Callable, args: tuple, results: "mp.Queue", env: dict) -> None:
    import faulthandler
    import tempfile

    import torch.distributed as dist

    faulthandler.enable()   # a rank killed by a fatal signal (SIGSEGV, SIGABRT) prints where it was
    os.environ.update(env)
    if "TMPDIR" in env:
        # the job's own temp directory (`fsdp-sync soak`, the fault matrix: what their processes
        # leave there is theirs): a forkserver's fork has its server's gettempdir() cached
        tempfile.tempdir = None
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        prefork_worker_server()   # FSDP_SYNC_WORKERS_START=forkserver: before any thread starts
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size,
            store=join_store("127.0.0.1", port, world_size, pg_timeout_s),
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(out)
        except Exception as exc:  # noqa: BLE001 - report what could not travel
            raise TypeError(f"rank {rank}: result of {fn.__name__} is not picklable: {exc}") from exc
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
        # written to the pipe before the group goes: its peers' "Connection closed by peer",
        # which the group's teardown causes, then reaches the parent after this rank's cause
        results.close()
        results.join_thread()
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may already be gone
                pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout_s: float = 180.0, pg_timeout_s: float = 60.0,
              env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``env`` is set in every rank before it starts anything (its engine workers inherit it); a
    ``TMPDIR`` there is the temp directory of the rank and of what it starts.
    ``fn`` must be importable (a module-level function). Raises `RankError` with the first failing
    rank's traceback if any rank raises, exits without a result, or the job passes ``timeout_s``;
    all processes are terminated before it returns or raises. A Ctrl-C (or any exception) while
    it waits gives the ranks 0.5 s each, then terminates them, then raises; a second Ctrl-C meanwhile
    does not cut that short (it left ranks in a collective running to their process-group timeout).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    # The job's store, hosted here and listening before any rank is told its port: a port picked
    # free and bound later by rank 0 was once taken in between on a busy CI machine (EADDRINUSE).
    store = host_store(world_size, pg_timeout_s)
    port = store.port
    procs = [
        ctx.Process(target=_worker, name=f"fsdp_sync-rank{r}",
                    args=(r, world_size, port, backend, pg_timeout_s, fn, args, results, env or {}),
                    daemon=False)
        for r in range(world_size)
    ]
    got: dict[int, Any] = {}
    failure: str | None = None
    raised = True   # until the loop ends on its own: left by an exception (Ctrl-C, SystemExit)
    try:
        # inside: a start that fails (a Ctrl-C, an OSError) stops the ranks already started,
        # which otherwise sat in the rendezvous until pg_timeout_s, this interpreter's exit waiting
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(got) < world_size and failure is None:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    failure = f"ranks {missing} passed the {timeout_s:g}s deadline of {fn.__name__}"
                    break
                # gone without a result, whatever its exit code: one that left by os._exit(0)
                # (its own or a library's) was waited for until the deadline
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    # give its traceback a moment to arrive before declaring a silent death
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        failure = (f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                   f"without a result")
                        break
                else:
                    continue
            if ok:
                got[rank] = pickle.loads(payload)
            else:
                failure = _failure_report({rank: payload}, *_others(results, procs, got, rank))
        raised = False
    finally:
        # every rank returned: a moment to exit on their own; a failure or an interrupt: they
        # are stopped (a rank in a collective would wait for its process-group timeout)
        with _HeldInterrupts(drop=raised) as held:
            _stop(procs, 10.0 if failure is None and not raised else 0.5, held)
            results.close()
            results.join_thread()
        del store
    if failure is not None:
        raise RankError(failure)
    return [got[r] for r in range(world_size)]


def _stop(procs: list, grace_s: float, held: "_HeldInterrupts") -> None:
    """Join each of ``procs`` for up to ``grace_s`` (0.5 s once a Ctrl-C is held), then
    terminate, then kill what is still alive."""
    for p in procs:
        until = time.monotonic() + grace_s
        while p.is_alive() and time.monotonic() < min(until, held.since + 0.5):
            p.join(timeout=0.05)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()


class _HeldInterrupts:
    """Holds Ctrl-C (SIGINT) while the ranks are stopped: an interrupt there would leave them
    running, and this interpreter's exit would wait for them (they are not daemons: rank 0 starts
    engine workers) until their process-group timeout. One held shortens the wait for the ranks
    to 0.5 s and is delivered afterwards to the handler it was meant for, unless ``drop``: the job
    is already being left by an exception (the first Ctrl-C's). Main thread only, as signals are."""

    def __init__(self, drop: bool):
        self.drop, self.since, self._old = drop, float("inf"), None

    def __enter__(self) -> "_HeldInterrupts":
        # (None: a handler set outside Python, which could not be put back)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
            self._old = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        self.since = min(self.since, time.monotonic())

    def __exit__(self, *exc) -> None:
        if self._old is None:
            return
        signal.signal(signal.SIGINT, self._old)
        if self.since < float("inf") and not self.drop:
            signal.raise_signal(signal.SIGINT)


def spawn_env(extra: dict | None = None) -> dict:
    """Environment for ranks: one thread each so N ranks on a small machine do not oversubscribe,
    and this process's ``FSDP_SYNC_FAULT*`` settings (`fsdp_sync.faultpoint`), which ranks forked
    from a forkserver started before they were set would not see."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update({k: v for k, v in os.environ.items() if k.startswith("FSDP_SYNC_FAULT")})
    env.update(extra or {})
    return env

