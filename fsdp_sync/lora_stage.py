"""The manager's ``sync_weights`` stage under `SyncConfig.lora="adapter"`, and what an adapter
sync does to a fleet of replicas (`fsdp_sync.fleet`), as a full sync does it:

- `sync_weights`: the base once through the configured transport (the manager's full sync), then
  the adapter alone at every sync (`lora_sync.sync_adapter`).
- the replicas an adapter-only sync goes to (``method="distributed"`` / ``"disk"``) are the ones a
  full sync would go to (`targets`, the manager's): those in service, probed first under
  ``on_replica_failure="quarantine"`` so a dead one is taken out before anything is loaded, and
  those out of service that can take updates again; none: refused, as a full sync is. A replica
  found unable to take updates during the sync (a check or a load that fails on a dead one) is
  taken out of service in either mode (``"abort"``: the sync fails saying so; the next goes to
  the others, and it rejoins once it answers).
- `rejoin`: a replica out of service that the sync goes to is given the base first, as `recover`
  gives it (the transport's reload: disk loads the directory the replicas in service loaded; the
  distributed method sends the trainer's base), then the adapter, verified, and the version;
  only then is it back in service. Under a ``pause_mode`` its generation is paused before its
  base is sent and continued once it holds base and adapter (a server a client reaches directly,
  SGLang's, is not kept from requests by being out of service). A failure keeps it out (one
  that took part of the base, or the base but not the adapter, is stalled, `manager_pause.stall`:
  no generation on it; another is continued); the sync goes on for the others.
- `restarted`: a replica in service whose base weights changed since they were synced (a server
  restarted by its supervisor serves its launch weights under its launch version) is taken out
  of service and rejoins: under ``"quarantine"`` in the same sync, the others taking the adapter
  meanwhile; under ``"abort"`` the sync fails and the next brings it in. One engine alone keeps
  `lora_sync.check_engine`'s refusal.
- `publish`: every adapter sync has a version, as every full sync has: the replicas that took
  the adapter are named with it (``update_weight_version``, SGLang's call: its adapter load takes
  no version), before generation resumes; then ``manager.version``. A failed sync names nothing.
- `bring_adapter`: a replica brought in between syncs (`recover`, `add_engine`), once it holds the
  base, gets the adapter the others serve (the manager's copy of the last one loaded) and their
  version, so it serves exactly what they do.
- `verify_base`: a sync that sent the adapter alone verifies the base too.
- a sync that sends the adapter alone compares the trainer ranks' models first
  (`weights.export_checks.agree_on_model`), as a full sync does before its export: ranks holding
  different adapters are refused by name instead of blocking in the export's collectives (the
  first sync of a manager made with ``base_sync_done=True``, as verl makes it, sends no base).

Not here: the adapter's export, checks, load and verify (`lora_sync`); the fleet's state
(`fleet`); moving the base (the transports).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import fleet, manager_pause
from .lora_sync import (active_adapter, adapter_config, check_engine, engine_version, holds,
                        load_adapter, peft_name, refusal, sync_adapter, transactional, verify_adapter)
from .topology import SyncError
from .transport import SyncStats
from .verify import verify_engines
from .weights import export, export_checks
from .weights.adapter_export import AdapterCopy, AdapterExport
from .weights.peft_names import adapter_of

log = logging.getLogger("fsdp_sync")

__all__ = ["sync_weights", "targets", "restarted", "rejoin", "publish", "bring_adapter", "verify_base"]


def sync_weights(manager: Any, sync_full: Any, agree: Any, pause: Any = None, resume: Any = None) -> None:
    """The manager's sync_weights stage under ``lora="adapter"``: the base through ``sync_full``
    (the configured method) when ``manager.base_sync_done`` is False, then the adapter
    (`sync_adapter`); the manager's stats become the adapter's, with the base's beside them.
    Before the base goes, everything the adapter's part would refuse is checked: the module
    (`refusal`: the config, the tensors, the adapter's choice and config) and every engine
    (`check_engine`: its rank bounds, targets, and, for the reference engine, its own load's
    checks): nothing is sent for a sync that the adapter's part would refuse. With
    `SyncConfig.verify`, a sync of the adapter alone verifies the base too (`verify_base`).
    An adapter-only sync into a fleet goes where a full sync would (`targets`), brings rejoining
    replicas in (`rejoin`) and publishes a version (`publish`); see the module docstring.

    ``pause`` / ``resume`` (the manager's ``_pause`` / ``_continue``: `SyncConfig.pause_mode`)
    hold generation on the serving replicas from before the base (or, at an adapter-only sync,
    from just before the adapter's load) until every engine holds the adapter, once: no request
    runs between the new base and its adapter. A failed load follows
    `SyncConfig.on_replica_failure` (`sync_adapter`); at a base sync, a replica that took the base
    but not the adapter and holds the one it served before under that name (a pair no sync
    produced) is stalled (`manager_pause.stall`: requests aborted, paused, out of service in a
    fleet) until a later sync gives it the adapter."""
    full = not manager.base_sync_done
    module, config, name = manager.module, manager.config, manager.config.lora_name
    fleet_mode = config.method != "tensor"       # the manager's rule (`_fleet_mode`)
    version = manager._next_version()            # an adapter-only sync's; a full sync names its own
    reps: list = []
    rejoining: list = []                         # trainer rank 0: out of service, this sync brings in

    def named() -> tuple[list, list[str]]:
        reps = list(manager.fleet.serving)
        if not fleet_mode and manager.topo is not None:
            return reps, [manager.topo.describe() for _ in reps]
        return reps, [r.name for r in reps]

    if full:        # everything the adapter's sync checks, of the module and the engines
        err = None
        try:
            adapter = active_adapter(module)
            err = refusal(module, manager.peft_config, base_sent=True, adapter=adapter)
            if err is None:
                metas = [m for m in export.param_metas(module, config.dtype, lora=True)
                         if adapter is None or adapter_of(m.name) == adapter]
                cfg = adapter_config(module, manager.peft_config, adapter, metas=metas)
                for rep, who in zip(*named()):
                    why = check_engine(rep.engine, cfg, name, None, metas)
                    if why is not None:
                        err = f"{who}: {why}; nothing was sent"
                        break
        except Exception as exc:  # noqa: BLE001 - reported to every rank just below
            err = f"{type(exc).__name__}: {exc}"
        agree(err, what=f"adapter sync of {name!r}")
    else:   # the ranks' models compared before the adapter export's collectives, as a full sync's
        export_checks.agree_on_model(module, config, None, what=f"adapter sync of {name!r}")
        if fleet_mode:     # where a full sync would go: the dead found and taken out first, and
            go = targets(manager, agree, version)          # those whose base changed given it again
            rejoining = [r for r in go if not r.serving] + restarted(manager, [r for r in go if r.serving], agree)
    # based: at a base sync, the replicas that took the new base whole
    held: dict[str, Any] = {"paused": None, "published": False, "based": []}

    def hold(targets: list | None = None) -> None:     # the base's targets, or those serving
        if pause is not None and held["paused"] is None:
            held["paused"] = pause(named()[0] if targets is None else targets)

    def let_go() -> None:
        paused, held["paused"] = held["paused"], []
        if paused:
            resume(paused)

    def mixed(took: list) -> list:
        """At a base sync, the replicas on the new base that hold under ``name`` an adapter other
        than this sync's (``took``: the ones that took it): the one they served before, kept or
        put back, on the new base is a pair no sync produced (one that cannot say: counted)."""
        out = []
        for rep in held["based"]:
            if any(rep is t for t in took):
                continue
            try:
                has = holds(rep.engine, name)
            except Exception:  # noqa: BLE001 - a dead engine serves nothing; stalled all the same
                has = None
            if has is not False:
                out.append(rep)
        return out

    def loaded(serving: list[int], **adapter: Any) -> None:
        if full:         # the base's sync named the version; the adapter went with it
            manager_pause.stall(manager, mixed([reps[i] for i in serving]), None)
            let_go()
            return
        held["published"] = True      # (if only on some replicas: the next sync names another)
        publish(manager, [reps[i] for i in serving], version, agree)   # before generation resumes
        for i in serving:      # stalled by a base sync whose adapter failed: whole again now
            if reps[i].stalled and reps[i].serving:
                reps[i].stalled = reps[i].partial = False
        let_go()
        if fleet_mode:
            rejoin(manager, rejoining, version, adapter)
        why = None       # every replica that held the adapter failed to take its version or rejoin
        if fleet_mode and manager.rank == 0 and not manager.fleet.serving:
            why = (f"no replica serves adapter {name!r} at version {version!r}: "
                   + "; ".join(f"{r.name}: {r.reason}" for r in manager.fleet.out_of_service))
        agree(why, what=f"adapter sync of {name!r}")
        manager.version = version

    try:
        if full:        # paused after the full sync's own checks, before anything is sent
            sync_full(hold)
            held["based"] = list(named()[0])
            manager.lora_base = {id(e): engine_version(e) for e in manager.engines}
        base, manager.base_sync_done = manager.stats, True
        if getattr(manager, "lora_export", None) is None:
            manager.lora_export = AdapterExport(peft_name)
        reps, names = named()
        engines = [r.engine for r in reps]
        several = len(manager.fleet.replicas) > 1 or (manager.topo is not None and manager.topo.dp_size > 1)
        # a copy of the adapter served: to put replicas back, and, in a fleet, to bring one in
        if (fleet_mode and manager.fleet.replicas) or (
                engines and (several or not all(transactional(e) for e in engines))):
            manager.lora_prev = getattr(manager, "lora_prev", None) or AdapterCopy()
        quarantine = blame = None
        if fleet_mode and config.on_replica_failure == "quarantine":
            def quarantine(i: int, why: str) -> None:
                manager.fleet.quarantine(reps[i], why)
        if fleet_mode:
            def blame(i: int, why: str) -> None:     # cannot take updates: out, in either mode
                manager.fleet.quarantine(reps[i], why)
                reps[i].rejoin = config.on_replica_failure != "quarantine"   # "abort": once it answers
        manager.stats = sync_adapter(module, config, engines, manager.peft_config, manager.lora_base,
                                     agree, manager.lora_export, base_sent=full, names=names,
                                     quarantine=quarantine, previous=getattr(manager, "lora_prev", None),
                                     before_load=hold, on_loaded=loaded, blame=blame)
    except BaseException as exc:
        manager.step += int(held["published"])     # its version was named: the next sync's differs
        try:
            if held["based"]:        # the new base with the old adapter: no generation on it
                manager_pause.stall(manager, mixed([]), exc)
            let_go()
        except Exception as cont:  # noqa: BLE001 - the sync's error is the one to raise
            exc.add_note(f"and then: {cont}")
        raise
    let_go()
    if full:
        manager.stats.extra.update({"base_seconds": base.seconds, "base_bytes": base.bytes,
                                    "base_tensors": base.tensors})
        if config.verify != "off":      # the base sync's own verify (`manager._sync_full`)
            manager.stats.extra["base_verify_tensors"] = base.extra.get("verify_tensors")
    if fleet_mode and manager.rank == 0:       # what a full sync's figures say of the fleet: every
        now = manager.stats.extra.get("replicas_out") or []     # replica out, this sync's as it said
        out = [f"{r.name}: {r.reason}" for r in manager.fleet.out_of_service
               if not any(s.startswith(f"{r.name}: ") for s in now)]
        manager.stats.extra.update(version=manager.version, replicas_serving=len(manager.fleet.serving),
                                   replicas_out=now + out)
    manager.step += int(not full)              # counted even if the verify fails
    if not full and config.verify != "off":      # "sample": the manager's turns, as a full sync's
        turn = manager.sample_turns.next(manager.global_steps)         # (`manager._verify`)
        verify_base(module, config, manager.engines, turn, agree, manager.stats)


def targets(manager: Any, agree: Any, version: str) -> list:
    """The replicas an adapter-only sync goes to, as a full sync's (the manager's ``_targets``:
    those in service, probed under ``"quarantine"``, a dead one taken out; those out of service
    that answer and may rejoin); with none, the sync is refused on every rank before anything
    moves, as a full sync's is. Trainer rank 0's list; [] elsewhere."""
    reps = manager._targets()
    why = manager.fleet.no_target(version) if manager.rank == 0 and not reps else None
    agree(why, what=f"adapter sync of {manager.config.lora_name!r}")
    return reps


def restarted(manager: Any, reps: list, agree: Any) -> list:
    """The replicas in service among ``reps`` whose base weights are no longer the ones this
    manager synced (`lora_sync.engine_version` changed: a server its supervisor restarted answers
    its launch version), in a fleet of several replicas: each needs the base again, so it is taken
    out of service, its reason the mismatch, its version None (it serves none of this manager's),
    and ``rejoin`` set. Under ``"quarantine"`` they are returned: this sync's `rejoin` gives them
    the base, then the adapter, as it gives any replica rejoining, and the others take the adapter
    meanwhile. Under ``"abort"`` the sync fails, as it fails for a replica that cannot take
    updates, before anything is loaded; the next sync brings them in. One engine alone keeps
    `lora_sync.check_engine`'s refusal (set ``manager.base_sync_done=False``). Collective (every
    rank agrees); trainer rank 0 decides."""
    name, out, whys = manager.config.lora_name, [], []
    if manager.rank == 0 and len(manager.fleet.replicas) > 1:
        for rep in reps:
            want = manager.lora_base.get(id(rep.engine))
            try:
                now = engine_version(rep.engine) if want is not None else None
            except Exception:  # noqa: BLE001 - cannot tell: the checks that follow say why
                now = None
            if now is None or now == want:
                continue
            why = (f"adapter {name!r}: the engine's base weights are version {now!r}, not the base "
                   f"version {want!r} this manager synced (restarted?): it needs the base again")
            manager.fleet.quarantine(rep, why)
            rep.version, rep.rejoin = None, True
            out.append(rep)
            whys.append(f"{rep.name}: {why}")
    err = None
    if out and manager.config.on_replica_failure != "quarantine":
        err = ("; ".join(whys) + "; quarantined: the next sync gives it the base and the adapter "
               "(under on_replica_failure='quarantine' this one would, the others taking the "
               "adapter); nothing was loaded: every engine keeps its adapter")
    agree(err, what=f"adapter sync of {name!r}")
    if out:
        log.warning("fsdp_sync: adapter %r: base weights changed, rejoining with the base: %s", name,
                    "; ".join(whys))
    return out


def publish(manager: Any, reps: list, version: str, agree: Any) -> None:
    """Name what ``reps`` now serve ``version``: each engine's ``update_weight_version`` (SGLang's
    call; its ``load_lora_adapter`` takes no version) where it takes a name, each replica's
    version, and the base version `lora_sync.check_engine` guards (the engine's own version, read
    back). A replica that cannot take the name serves the new adapter under the old one: in a fleet
    it is taken out of service; under ``"abort"`` (or for the tensor method) the sync fails, saying
    who serves what. Collective (every rank agrees)."""
    fleet_mode, failed = manager.config.method != "tensor", []
    for rep in reps:
        try:
            _name(rep.engine, version)
            manager.lora_base[id(rep.engine)] = engine_version(rep.engine)
            rep.version = version
        except Exception as exc:  # noqa: BLE001 - said below, naming the replica
            failed.append(f"{rep.name}: {type(exc).__name__}: {exc}")
            if fleet_mode:
                manager.fleet.quarantine(rep, f"took adapter {manager.config.lora_name!r} but not its "
                                              f"version {version!r}: {type(exc).__name__}: {exc}")
    err = None
    if failed and (not fleet_mode or manager.config.on_replica_failure != "quarantine"):
        err = (f"{'; '.join(failed)}: took the adapter but not the name of version {version!r}"
               + (" (quarantined)" if fleet_mode else "") + f"; the others serve it as {version!r}")
    agree(err, what=f"adapter sync of {manager.config.lora_name!r}: naming version {version!r}")


def rejoin(manager: Any, rejoining: list, version: str, adapter: dict) -> None:
    """Bring in the replicas out of service that this adapter-only sync goes to (trainer rank 0;
    [] elsewhere): each is checked against the adapter (``adapter``: `sync_adapter`'s tensors,
    cfg, metas, shared), given the base as `recover` gives it (the transport's reload under
    ``version``, collective: every rank runs it as often as rank 0 says), then the adapter, its
    verify and version (`_give_adapter`), and only then put back in service. Under a
    ``pause_mode`` each is paused (`manager_pause.pause`) before its base is sent, as a sync
    pauses its targets and `manager_fleet.send` pauses a replica brought in: a request reaching
    it directly would otherwise run on partly new weights. It is continued once it holds base and
    adapter, or after a failure that left it its old weights; one that kept part of the base, or
    took the whole base but not the adapter (the old adapter on the new base: a pair no sync
    produced), stays paused (`manager_pause.stall`). One that fails (its pause too) stays out
    (`_keep_out`); the sync goes on for the others."""
    name, go = manager.config.lora_name, []
    for rep in rejoining:
        try:
            why = check_engine(rep.engine, adapter["cfg"], name, None, adapter["metas"])
        except Exception as exc:  # noqa: BLE001 - it stays out, saying why
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            go.append(rep)
        else:
            _keep_out(manager, rep, version, why)
    for k in range(manager._from_rank0(len(go))):
        rep = go[k] if k < len(go) else None
        reps = [rep] if rep is not None else []
        try:        # as a sync pauses its targets (`SyncConfig.pause_mode`; agreed, every rank)
            paused = manager_pause.pause(manager, reps)
        except SyncError as exc:
            if rep is not None:
                _keep_out(manager, rep, version, f"{exc}")
            continue
        based = []      # holds the new base whole: its old adapter (or none) on it is no sync's pair
        try:
            err, _ = manager._transport_sync(reps, version, manager.step, reload=True)
            if err is not None:      # no generation on a base it took part of (`manager_pause.stall`)
                manager_pause.stall(manager, manager_pause.kept_part(reps), None)
            based = reps if err is None and manager.config.pause_mode is not None else []
            why = None if rep is None else f"its base: {err}" if err is not None else _give_adapter(
                manager, rep, version, adapter["tensors"], adapter["cfg"], adapter.get("shared"))
            if why is not None and based:     # nor on the new base with the old adapter
                manager_pause.stall(manager, based, None)
        except BaseException as exc:     # an interrupt too: what it kept part of stays paused
            try:
                manager_pause.stall(manager, manager_pause.kept_part(reps) or based, None)
                manager_pause.resume(manager, paused)
            except Exception as cont:  # noqa: BLE001 - the transfer's error is the one to raise
                exc.add_note(f"and then: {cont}")
            raise
        if rep is None:
            continue
        if why is not None:
            _keep_out(manager, rep, version, why)
        else:
            manager.fleet.reinstate(rep, version)
            log.warning("fsdp_sync: %s rejoined at version %s (base and adapter %r)", rep.name, version, name)
            if rep.stalled:     # paused since a failed sync left it partly new: whole now
                rep.stalled = False
                paused = paused if rep in paused else paused + [rep]
        try:                    # (one that kept part of the base stays paused: `resume`)
            manager._continue(paused)
        except RuntimeError as exc:
            log.warning("fsdp_sync: %s: generation there is still paused (%s): the next sync "
                        "continues it", rep.name, exc)


def bring_adapter(manager: Any, rep: Any, version: str | None) -> str | None:
    """After the manager's ``_bring_in`` (`recover`, `add_engine`) gave ``rep`` the base: the
    adapter the replicas in service serve (the manager's copy of the last one loaded; none loaded
    yet: none, an adapter of that name the engine holds unloaded), verified, and ``version``.
    Trainer rank 0 (``rep`` None elsewhere, or without ``lora="adapter"``: nothing). Returns why
    it cannot serve what the others do, or None."""
    if rep is None or manager.config.lora != "adapter":
        return None
    name, prev = manager.config.lora_name, getattr(manager, "lora_prev", None)
    try:
        if prev is None or prev.tensors is None:     # the replicas in service hold no adapter
            if holds(rep.engine, name):
                rep.engine.unload_lora_adapter(name)
            manager.lora_base[id(rep.engine)] = engine_version(rep.engine)
            return None
        why = check_engine(rep.engine, prev.cfg, name, None)
    except Exception as exc:  # noqa: BLE001 - said by the caller, naming the replica
        why = f"{type(exc).__name__}: {exc}"
    why = why or _give_adapter(manager, rep, version, prev.tensors, prev.cfg, None)
    return None if why is None else f"{rep.name} holds the base but not adapter {name!r}: {why}; it stays out"


def _give_adapter(manager: Any, rep: Any, version: str | None, tensors: dict, cfg: dict,
                  shared: Any) -> str | None:
    """Load the adapter into ``rep`` (holding the base now), verify it (`SyncConfig.verify`) and
    name it ``version``; why not, or None."""
    name = manager.config.lora_name
    try:
        load_adapter(rep.engine, name, tensors, cfg, shared)
        why = verify_adapter(rep.engine, name, tensors) if manager.config.verify != "off" else None
        if why is None:
            if version is not None:
                _name(rep.engine, version)
            manager.lora_base[id(rep.engine)] = engine_version(rep.engine)
        return why
    except Exception as exc:  # noqa: BLE001 - said by the caller, naming the replica
        return f"adapter {name!r}: {type(exc).__name__}: {exc}"


def _name(engine: Any, version: str) -> None:
    """``update_weight_version`` where the engine can name its weights (`fleet.set_version`)."""
    if getattr(engine, "takes_weight_version", True) is not False:
        fleet.set_version(engine, version)


def _keep_out(manager: Any, rep: Any, version: str, why: str) -> None:
    """``rep`` failed to rejoin at ``version``: out of service, with why. One that cannot take
    updates (`fleet.problem`) is tried again at a later sync (``"abort"``: once it answers); one
    that answers but refused is held, as a full sync holds it (`Fleet.keep_out`): only `recover`
    brings it back."""
    dead, since = fleet.problem(rep.engine, once=True), rep.quarantined_at
    manager.fleet.quarantine(rep, f"rejoining at version {version!r} failed ({why})"
                             + ("" if dead else "; recover() it once it can take updates"))
    rep.quarantined_at = since or rep.quarantined_at
    rep.held, rep.rejoin = dead is None, dead is not None and manager.config.on_replica_failure != "quarantine"


def verify_base(module: torch.nn.Module, config: Any, engines: list, step: int, agree: Any,
                stats: SyncStats) -> None:
    """`SyncConfig.verify` of the base weights at a sync that sent the adapter alone (collective:
    every trainer rank): what the engines serve against the trainer's base now, as a full sync's
    verify checks it (`verify.verify_engines`, the same mode: ``"sample"`` rotates with
    ``step``). A difference raises the same `SyncError` on every rank, naming the tensor: the
    base changed since it was sent. Its figures go into ``stats.extra`` as ``base_verify_*``."""
    try:
        err, figures = verify_engines(module, config, engines, step)
    except Exception as exc:  # noqa: BLE001 - reported to every rank just below
        err, figures = f"{type(exc).__name__}: {exc}", {}
    stats.extra.update({f"base_{k}": v for k, v in figures.items() if k != "verify"})
    if err is not None and "different from" in err:     # a difference, not an engine that cannot tell
        err = (f"{err} (this sync sent the adapter alone; the base was sent at an earlier sync: "
               f"after changing base weights set manager.base_sync_done=False)")
    agree(err, what=f"verify={config.verify!r} of the base weights under adapter {config.lora_name!r}")
