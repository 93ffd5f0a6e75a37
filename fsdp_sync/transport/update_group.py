"""Trainer rank 0 opens SGLang's weight-update group with every engine (``method="distributed"``).

An engine told to join (``init_weights_update_group``) blocks in the join, its generation waiting,
and first drops a group of that name it already has. So whatever the trainer side can check is
checked before any engine is told: the group's name free in this process (another manager's group,
not closed, holds it; torch would refuse it only once the engines were joining, theirs replaced),
distinct GPUs under NCCL, every engine's TP size, and the group's store listening on its port (the
user's ``dist_master_port`` bound here, where another program holding it fails at once; or one the
OS picks). The store is held here alone (trainer rank 0 joins as one of its clients), so a failure
after the engines were told closes it: every engine worker in the rendezvous fails at once instead
of at its own timeout (SGLang's: 30 minutes); one that has not connected yet finds the port hosted
again, marked called off (`wire.call_off_join`: the reference engine's workers fail at once, SGLang's
when that store closes, `CALL_OFF_S` later at most); an engine that did join is told to leave.

Not here: the group's wire form (`wire.new_update_group`, `wire.host_store`), what is sent over it
and its teardown after a failed sync (`transport.distributed`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..wire import (call_off_join, destroy_update_group, host_store, join_store, new_update_group,
                    update_group_open)

__all__ = ["EngineCalls", "OpenGroup", "open_group", "outward_address", "check_distinct_gpus", "engine_tp", "check_answer", "destroy_ours"]

log = logging.getLogger("fsdp_sync")

CALL_OFF_S = 15.0
"""How long a failed opening waits, at most, for the engines to answer once their join was called
off: what is left of ``dist_timeout_s`` (the opening's one deadline), but `CALL_OFF_FLOOR_S` at least."""

CALL_OFF_FLOOR_S = 1.0
"""The least a failed opening waits for the engines' answers after calling their join off (the
reference engine's workers answer at once; SGLang's when the store closes). So a failed opening
ends within ``dist_timeout_s`` plus this."""


class EngineCalls:
    """Runs each engine call on a daemon thread of its own and returns its `Future`.

    Not a `ThreadPoolExecutor`: the interpreter joins those threads at exit, so a call given up on
    (an engine that never answers: `DistributedTransport._abandon`, a join called off) kept the
    trainer's process alive after its failed sync until the engine's own timeout (a hung TP
    worker behind ``fsdp-sync serve``: 97 s after the error with the worker stalled 90 s, up to
    the HTTP client's ``timeout_s``, 600 s by default). A call given up on holds nothing here."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(exc)

        threading.Thread(target=run, name=f"fsdp_sync-engine-{getattr(fn, '__name__', 'call')}",
                         daemon=True).start()
        return fut


def outward_address() -> str:
    """This host's address as other hosts reach it (a UDP connect sends no packet); 127.0.0.1
    where there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def engine_tp(engine: Any) -> int:
    """An engine's TP size (``tp_size``, an attribute or a method), which its group ranks follow."""
    tp = getattr(engine, "tp_size", None)
    tp = tp() if callable(tp) else tp
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"cannot tell the TP size of engine {engine!r} (tp_size = {tp!r}); the "
                         f"update group's ranks depend on it")
    return tp


def check_answer(answer: Any, call: str) -> Any:
    """SGLang's in-process Engine answers ``(success, message)``; ours raise. Both are accepted."""
    if isinstance(answer, tuple) and len(answer) >= 2 and isinstance(answer[0], bool):
        if not answer[0]:
            raise RuntimeError(f"{call}: {answer[1]}")
    elif isinstance(answer, dict) and answer.get("success") is False:
        raise RuntimeError(f"{call}: {answer.get('message')}")
    return answer


def check_distinct_gpus(engines: list, device: torch.device) -> None:
    """NCCL refuses a group with two ranks on one GPU (``Duplicate GPU detected``), and says so
    only once the model is built and the engine started: refuse before joining, naming the GPU.
    Engines that say where their workers run (``gpu_ids()``: the reference engine) are checked;
    others (SGLang, its own ``--base-gpu-id``) are the caller's to place."""
    mine = torch.device(device).index
    mine = torch.cuda.current_device() if mine is None else mine
    for i, engine in enumerate(engines):
        ids = getattr(engine, "gpu_ids", None)
        ids = list(ids()) if callable(ids) else []
        if mine in ids:
            raise ValueError(
                f"method='distributed' on CUDA: trainer rank 0 (cuda:{mine}) and engine {i}'s TP "
                f"worker {ids.index(mine)} would share GPU {mine}, and NCCL refuses one GPU on both "
                f"ends of the weight-update group ({torch.cuda.device_count()} GPUs visible). Put "
                f"the engine on other GPUs (ReferenceEngine(base_gpu_id=...), SGLang's "
                f"--base-gpu-id), or use method='tensor' (colocated, CUDA IPC) on one GPU")


@dataclasses.dataclass
class OpenGroup:
    """A made update group: ``pg`` (trainer rank 0 is its rank 0), ``store`` (hosted while the
    group lives: dropping it closes the port) and each engine's ``rank_offset`` in it."""

    pg: Any
    store: Any
    offsets: list[int]


def open_group(engines: list, cfg: Any, device: torch.device, backend: str,
               pool: EngineCalls, joins: dict | None = None) -> OpenGroup:
    """Make the update group ``cfg.dist_group_name`` with every engine (see the module); the
    engines' ``init_weights_update_group`` calls run on ``pool`` while this joins as rank 0.
    Raises RuntimeError naming the group, where it was hosted and why, with no engine left in
    the join. Everything here, the call-off included, ends within ``dist_timeout_s`` (plus
    `CALL_OFF_FLOOR_S` where the rendezvous used it all).

    ``joins`` (the caller's, kept from one opening to the next): each engine's call, by
    ``id(engine)``. An engine whose call from an earlier, failed opening still runs is not told
    again (RuntimeError naming it, nothing asked): its TP worker that came late to that group
    waits out its own timeout (the reference engine's ``update_recv_timeout_s``, SGLang's 30
    minutes) while the call holds the engine, and every call asked meanwhile queued behind it,
    each of those waiting out that timeout again: a trainer that synced again every
    ``dist_timeout_s`` never got the engine back (a reference engine with one TP worker 1.5 s
    late: 8 syncs of 8 failed over 48 s, with ``dist_timeout_s=5``, ``update_recv_timeout_s=20``)."""
    deadline = time.monotonic() + cfg.dist_timeout_s
    name = cfg.dist_group_name
    if joins is not None:
        for key in [k for k, (_, f) in joins.items() if f.done()]:
            del joins[key]
        busy = [i for i, e in enumerate(engines) if id(e) in joins and joins[id(e)][0] is e]
        if busy:
            raise RuntimeError(
                f"making the weight-update group {name!r} failed: engine {busy[0]}'s "
                f"init_weights_update_group from an earlier opening that failed is still running (a "
                f"TP worker late to that group waits out its own timeout: the reference engine's "
                f"update_recv_timeout_s, SGLang's 30 minutes); no engine was told to join. Sync "
                f"again once it has ended" + (f" (engines {busy} all wait)" if len(busy) > 1 else ""))
    if update_group_open(name):
        raise RuntimeError(f"making the weight-update group {name!r} failed: a group named {name!r} "
                           f"exists in this process already (another manager's, not closed): close() "
                           f"the manager that made it, or give this one another dist_group_name; no "
                           f"engine was told to join, so the engines' group {name!r} is as it was")
    if device.type == "cuda" and (cfg.dist_backend or "nccl") == "nccl":
        check_distinct_gpus(engines, device)
    tps = [engine_tp(e) for e in engines]
    world = 1 + sum(tps)
    address = cfg.dist_master_address or outward_address()
    # the store listens before any engine is told its port: a port of the user's that another
    # program holds fails here, and one picked free and bound later could be taken in between
    try:
        store = host_store(world, cfg.dist_timeout_s, port=cfg.dist_master_port or 0)
    except Exception as exc:
        # a timeout is the store's own (dist_timeout_s), not another program on the port
        timed_out = isinstance(exc, (TimeoutError, dist.DistStoreError)) or "timed out" in str(exc).lower()
        raise RuntimeError(f"making the weight-update group {name!r} failed: trainer rank 0 cannot "
                           f"host its store on dist_master_port={cfg.dist_master_port} ({exc}); " + (
                               f"it gave up after dist_timeout_s={cfg.dist_timeout_s}s: raise "
                               f"dist_timeout_s on a slow or loaded host, or give" if timed_out else
                               "is another program on it? Give") + " a free port, or None to let the "
                           "OS pick one. No engine was told to join") from exc
    port = store.port
    client = join_store("127.0.0.1", port, None, cfg.dist_timeout_s)    # rank 0's, not the host
    futures, offsets, offset = [], [], 1
    for engine, tp in zip(engines, tps):
        offsets.append(offset)
        futures.append(pool.submit(engine.init_weights_update_group, master_address=address,
                                   master_port=port, rank_offset=offset, world_size=world,
                                   group_name=name, backend=backend))
        if joins is not None:
            joins[id(engine)] = (engine, futures[-1])
        offset += tp
    pg = None
    try:
        pg = _make_group(futures, backend=backend, master_address=address, master_port=port,
                         world_size=world, rank=0, store=client, group_name=name,
                         timeout_s=cfg.dist_timeout_s)
        for i, f in enumerate(futures):     # the group is made: each engine's answer, named
            if not cf.wait([f], timeout=max(0.0, deadline - time.monotonic())).done:
                raise _EngineRefused(f"engine {i} did not answer init_weights_update_group within "
                                     f"dist_timeout_s={cfg.dist_timeout_s}s, though its workers joined")
            if f.exception() is not None:
                raise _EngineRefused(f"engine {i} init_weights_update_group: {f.exception()}") from f.exception()
            check_answer(f.result(), f"engine {i} init_weights_update_group")
    except Exception as exc:
        # the engines' own errors, before the call-off below makes every joining one fail too
        errs = [f"an engine said: {f.exception()}" for f in futures if f.done() and f.exception() is not None]
        if pg is not None:
            destroy_ours(pg)
        why = f"trainer rank 0 failed making it: {type(exc).__name__}: {str(exc)[:300]}"
        try:
            call_off_join(store, name, why)
        except Exception as mark_exc:  # noqa: BLE001 - closing the store below still ends the joins
            log.warning("fsdp_sync: marking the weight-update group %r called off: %s", name, mark_exc)
        store = client = None     # the port closes: every member in the rendezvous fails at once
        tomb = _host_called_off(port, world, name, why, cfg.dist_timeout_s)   # for those yet to connect
        # the call-off counts inside the opening's deadline: a failed rendezvous takes
        # dist_timeout_s, not twice it
        left = deadline - time.monotonic()
        _call_off(engines, futures, name, max(CALL_OFF_FLOOR_S, min(CALL_OFF_S, left)))
        del tomb                  # a member still waiting on it (not ours: SGLang's) fails now
        where = (f"making the weight-update group {name!r} at {address}:{port} (world size {world}, "
                 f"engines' TP sizes {tps}) failed")
        if isinstance(exc, _EngineRefused):
            raise RuntimeError(f"{where}: {exc}") from exc.__cause__
        if isinstance(exc, torch.distributed.DistStoreError):
            errs.append(f"not every engine TP worker joined within dist_timeout_s="
                        f"{cfg.dist_timeout_s}s; each must reach {address}:{port}")
        raise RuntimeError(f"{where}: {exc}" + (f"; {errs[0]}" if errs else "")) from exc
    log.info("fsdp_sync: weight-update group %r: %s:%d, world size %d (%s), backend %s",
             name, address, port, world, tps, backend)
    return OpenGroup(pg, store, offsets)


def _host_called_off(port: int, world: int, name: str, why: str, timeout_s: float) -> Any:
    """A store on the given-up group's port, marked called off (`wire.call_off_join`): an engine
    worker that connects after the group's own store closed would otherwise find the port shut
    and try it again until its timeout (torch's client does, and `wire.join_store` waits for a
    store that is not listening yet). Tried for a second: the port was free a moment ago."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            tomb = host_store(world, timeout_s, port=port)
            call_off_join(tomb, name, why)
            return tomb
        except Exception as exc:  # noqa: BLE001 - a member still to connect waits out its timeout
            if time.monotonic() > deadline:
                log.warning("fsdp_sync: cannot listen on port %d again to call the join of the "
                            "weight-update group %r off: %s", port, name, exc)
                return None
            time.sleep(0.05)


def destroy_ours(pg: Any, what: str = "a half-made weight-update group") -> bool:
    """Abort and destroy this process's end of ``pg`` without raising (the engines are not
    called): whether it was destroyed; a failure is logged, naming ``what``."""
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - destroying it is what matters
        pass
    try:
        destroy_update_group(pg)
        return True
    except Exception as exc:  # noqa: BLE001 - an error path, or a finalizer: never raise
        log.warning("fsdp_sync: destroying %s: %s", what, exc)
        return False


def _call_off(engines: list, futures: list, name: str, wait_s: float) -> None:
    """After the store was closed: wait up to ``wait_s`` for every engine's answer (each worker
    still joining fails at once), and tell an engine that did join to leave the group."""
    _, late = cf.wait(futures, timeout=wait_s)
    for i, (engine, f) in enumerate(zip(engines, futures)):
        if f in late:
            log.warning("fsdp_sync: engine %d still in init_weights_update_group(%r) %.0f s after "
                        "the trainer closed the group's store", i, name, wait_s)
            continue
        if f.exception() is not None:
            continue
        try:
            check_answer(f.result(), "init_weights_update_group")
            check_answer(engine.destroy_weights_update_group(name), "destroy_weights_update_group")
        except Exception as exc:  # noqa: BLE001 - a dead engine cannot answer
            log.warning("fsdp_sync: engine %d leaving the half-made weight-update group %r: %s", i, name, exc)


class _EngineRefused(Exception):
    """An engine's init_weights_update_group failed while the trainer was making the group."""


def _make_group(futures: list, **kw: Any) -> Any:
    """`new_update_group` as rank 0, given up at once when an engine's ``init_weights_update_group``
    fails: that engine will never join, and the rendezvous would otherwise wait out
    ``dist_timeout_s`` (600 s by default). The abandoned rendezvous runs on in a daemon thread
    until the caller closes the group's store (a client of it is all this rank holds); a group
    it completes after all is destroyed there, so its name is free again."""
    made: dict = {}
    lock = threading.Lock()

    def make() -> None:
        try:
            pg = new_update_group(**kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            made["error"] = exc
            return
        with lock:
            if not made.get("given_up"):
                made["pg"] = pg
                return
        # the rendezvous completed after the caller gave it up (an engine whose workers joined
        # but whose call failed, e.g. its client timed out): destroyed, or its name stayed taken
        # and every later opening was refused as "another manager's, not closed"
        destroy_ours(pg, f"the weight-update group {kw.get('group_name')!r}, made after its opening failed")

    t = threading.Thread(target=make, name="fsdp_sync-update-group", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        for i, f in enumerate(futures):
            if not f.done() or not t.is_alive():
                continue
            try:
                check_answer(f.result(), f"engine {i} init_weights_update_group")
            except Exception as exc:  # noqa: BLE001 - the engine's own error, named
                with lock:
                    if "pg" not in made:      # else made just now: the caller destroys it
                        made["given_up"] = True
                        raise _EngineRefused(f"engine {i} init_weights_update_group: {exc} (the "
                                             f"group was not waited for)") from exc
    if "error" in made:
        raise made["error"]
    return made["pg"]
