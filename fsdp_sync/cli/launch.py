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


def _worker(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float,
            fn: Callable, args: tuple, results: "mp.Queue", env: dict) -> None:
    import tempfile

    import torch.distributed as dist

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
    all processes are terminated before it returns or raises.
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
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    failure: str | None = None
    try:
        while len(got) < world_size and failure is None:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    failure = f"ranks {missing} passed the {timeout_s:g}s deadline of {fn.__name__}"
                    break
                dead = [r for r, p in enumerate(procs)
                        if r not in got and p.exitcode is not None and p.exitcode != 0]
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
                failure = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            p.join(timeout=10.0 if failure is None else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()
        del store
    if failure is not None:
        raise RankError(failure)
    return [got[r] for r in range(world_size)]


def spawn_env(extra: dict | None = None) -> dict:
    """Environment for ranks: one thread each so N ranks on a small machine do not oversubscribe,
    and this process's ``FSDP_SYNC_FAULT*`` settings (`fsdp_sync.faultpoint`), which ranks forked
    from a forkserver started before they were set would not see."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update({k: v for k, v in os.environ.items() if k.startswith("FSDP_SYNC_FAULT")})
    env.update(extra or {})
    return env

