"""The manager's fleet membership (`FSDPShardingManager`, ``method="distributed"``/``"disk"``):
which replicas a sync goes to, what a failed sync does to them, and bringing one in.

- `targets`: the replicas a sync goes to: those in service, and those out of service that can
  take an update again (to rejoin at the new version).
- `after_failure`: a failed sync's decision (trainer rank 0's, followed on every rank): raise, or
  quarantine the replicas that cannot take updates and return the ones to sync again (and whether
  to: not after a commit failure, where the others committed).
- `bring_in`: `recover` and `add_engine`: the replica brought to the version the others serve
  (sent or loaded now, or at the next sync), then put in service; `send`: that transfer, under a
  ``pause_mode`` with its generation paused as a sync pauses its targets, continued once it holds
  the whole version (or kept paused, holding part of it or the base without its adapter, as
  `manager_pause.stall` says).

Not here: the fleet's own state (`fleet`), pausing and continuing generation (`manager_pause`),
the sync itself (the manager's ``_sync_full`` and the transports).
"""

from __future__ import annotations

import logging
from typing import Any

from . import fleet, lora_stage, manager_pause
from .topology import SyncError

__all__ = ["targets", "after_failure", "bring_in", "not_added", "send"]

log = logging.getLogger("fsdp_sync")


def targets(manager: Any) -> list:
    """The replicas this sync goes to: those in service, and quarantined ones that can take
    an update again (asked once, not with the client's retries; they rejoin at the new version)."""
    reps = manager.fleet.serving
    if manager._fleet_mode:
        quarantine = manager.config.on_replica_failure == "quarantine"
        reps = []
        for r in manager.fleet.replicas:
            if r.held or (not r.serving and not quarantine and not r.rejoin):
                continue
            why = fleet.problem(r.engine, once=not r.serving) if (quarantine or not r.serving) else None
            if why is None:
                reps.append(r)
            elif r.serving:          # died since the last sync: out before anything is sent
                manager.fleet.quarantine(r, why)
    return reps


def after_failure(manager: Any, targets: list, err: SyncError, ctx: Any, version: str) -> tuple[list, bool]:
    """A sync failed. Trainer rank 0 finds the replicas that cannot take updates (`fleet.problem`),
    failed committing, or rejoined it (`Fleet.blame`), and every rank follows its decision:
    raise (``"abort"``, or nothing to blame on a replica), or take them out and return ``(the
    replicas to sync, whether to sync them again)``: not after a commit failure (the others hold
    the version). Rank 0's word on every rank: only rank 0's transport sees ``ctx.commit_failed``,
    and a rank syncing again alone waits in collectives the others never reach."""
    decision = None
    if manager._fleet_mode and manager.rank == 0 and len(targets) > 0:
        decision = manager.fleet.blame(targets, ctx.commit_failed, version)
    decision = manager._from_rank0(decision) if manager._fleet_mode else None
    if decision and decision["refused"]:    # maybe a rejoiner's refusal: out, the others again
        return (manager.fleet.keep_out(targets, decision["refused"], err, version) if manager.rank == 0
                else []), True
    if not decision or not decision["failed"]:
        raise err
    failed, committed = decision["failed"], decision["committed"]
    names = "; ".join(f"{targets[i].name if manager.rank == 0 else f'replica {i}'}: {why}"
                      for i, why in sorted(failed.items()))
    quarantine = manager.config.on_replica_failure == "quarantine"
    untold = {}
    if manager.rank == 0:      # out of service in either mode; under "abort" it rejoins once it answers
        for i, why in failed.items():
            untold[i] = manager.fleet.quarantine(targets[i], why)
            targets[i].rejoin = not quarantine
    if committed is not None:             # cannot be undone on those that committed
        if manager.rank == 0:
            for i in committed:           # what they serve now, as fleet_status() says
                targets[i].version = version
            # a failed commit leaves no version the fleet agreed on (SGLang: the new weights under
            # the old name, or half post-processed): under a pause_mode its requests are aborted
            # and it is not continued with the others until a sync commits there
            manager_pause.stall(manager, [targets[i] for i in sorted(failed)], err)
            for i in sorted(i for i in failed if untold.get(i)):      # (a dead one answers nothing)
                if fleet.problem(targets[i].engine, once=True) is None:
                    err.add_note(_still_routed(manager, targets[i], untold[i]))
        if quarantine and committed:
            log.warning("fsdp_sync: version %s committed on %d replicas; quarantined: %s%s",
                        version, len(committed), names, "".join(f"; {n}" for n in getattr(err, "__notes__", [])))
            return ([targets[i] for i in committed] if manager.rank == 0 else []), False
        raise fleet.restate(err, f"{err}; quarantined (committing cannot be undone on the replicas "
                            f"that committed version {version!r}): {names}") from None
    if not quarantine or len(failed) == len(targets):
        hint = ("" if quarantine else "; with SyncConfig.on_replica_failure='quarantine' the healthy "
                "replicas would commit and these be taken out of service")
        raise fleet.restate(err, f"{err}; no replica committed version {version!r}; replicas that "
                            f"cannot take updates (quarantined): {names}{hint}") from None
    log.warning("fsdp_sync: quarantined %s; syncing version %s to the %d others",
                names, version, len(targets) - len(failed))
    return ([r for i, r in enumerate(targets) if i not in failed] if manager.rank == 0 else []), True


def _still_routed(manager: Any, rep: Any, untold: str) -> str:
    """What to tell of ``rep``, which failed its commit and could not be taken out of service."""
    return (f"{rep.name} could not be taken out of service ({untold}): a router still sends it "
            f"requests, which " + ("wait (its generation stays paused)" if manager.config.pause_mode
                                   is not None else "it answers from whatever its failed commit left")
            + "; take it out of the router's rotation (DELETE /workers/{id}) until a sync commits there")


def bring_in(manager: Any, engine: Any, what: str, *, refused: str | None = None) -> bool:
    """``what`` (``"recover"``, ``"add_engine"``): bring the replica of ``engine`` (trainer rank 0;
    None elsewhere) to the version the replicas in service hold, as trainer rank 0 decides: refuse
    (it cannot take updates, or its config, or ``refused``: `add_engine`'s own refusal), send or
    load it now, leave it to the next sync (returns False), or put it in service as it is (nothing
    committed yet). Returns whether it serves now. The decision goes to every rank with the
    ranks' stage settings compared (`FSDPShardingManager._from_rank0`): before any ``with``
    block nothing else compared them, and a rank refusing alone (``method='tensor'`` there) left
    the others in the collective until the process group's timeout. A new replica is told it is
    joining (out of service) only once it is not refused: before, a refused one kept answering
    503 "joining" until restarted."""
    action, rep, reason, version = "serve", None, "", manager.version
    if refused is not None and manager.rank == 0:
        action, reason = "refuse", refused
    elif manager.rank == 0 and manager._fleet_mode:
        try:
            rep = manager.fleet.find(engine)
            reason = fleet.problem(engine) or ""
            if not reason:
                manager._check_config(engine)      # a new replica's math, before any byte moves
            if reason:
                action = "fail"
            elif (version := manager.fleet.held(manager.version)) is None:   # nothing committed yet: its
                action = "pending" if rep.partial else "serve"   # launch weights, or part of a failed sync's
            elif manager.config.method == "disk":     # what the replicas in service loaded
                action = "load"
            else:
                action, version = ("send" if manager._inside else "pending"), manager.version
        except Exception as exc:  # noqa: BLE001 - its config, or the fleet's state: a refusal
            action, reason = "refuse", f"{type(exc).__name__}: {exc}"
    action, reason, version = manager._from_rank0((action, reason, version), compared=what)
    manager._refuse_placed(what, "bringing a replica back" if what == "recover" else "a new replica")
    if action in ("fail", "refuse"):
        raise SyncError(f"{what}: {rep.name if rep is not None else 'the replica'} " + (
            "cannot take updates" if action == "fail" else "is refused, before anything was sent")
            + f": {reason}")
    if what == "add_engine" and rep is not None:   # not before: a refused one is left as it was
        manager.fleet.quarantine(rep, "joining: waiting for the current weights")   # (serving)
    if action == "pending":
        if rep is not None:               # the next sync brings it in, whatever the failure mode
            rep.held, rep.rejoin = False, True
        return False
    reps, paused = [rep] if rep is not None else [], []
    if action in ("load", "send"):   # the weights the others serve, under their version
        paused = manager_pause.pause(manager, reps)   # as a sync pauses its targets (`pause_mode`)
        send(manager, reps, paused, version, what)
    if rep is not None:
        manager.fleet.reinstate(rep, version)
    if action in ("load", "send"):     # and one a failed sync (or add_engine) left paused
        manager_pause.release(manager, paused, reps, version)
    return True


def not_added(manager: Any, rep: Any, exc: BaseException) -> str | None:
    """``rep``, which a failed `add_engine` told it was joining, removed from the fleet: one
    holding partly new weights is let go (`manager_pause.let_go`); one that holds what it held
    before the call is told why it is out of service now (before: 503 "joining: waiting for the
    current weights" until restarted, though nothing would bring it in). Returns what is said to
    the caller (None: logged only, or nothing told)."""
    note = manager_pause.let_go(manager, rep, "add_engine")
    if note is not None or not rep.told_out:
        return note
    reason = (f"not added to the fleet: add_engine failed ({type(exc).__name__}: {str(exc):.200}); "
              f"it holds the weights it held before the call: add_engine it again once fixed")
    try:
        rep.engine.set_serving(False, reason)
    except Exception as told:  # noqa: BLE001 - the add's error is the one to raise
        log.warning("fsdp_sync: could not tell %s that it was not added (%s)", rep.name, told)
    return None


def send(manager: Any, reps: list, paused: list, version: str | None, what: str) -> None:
    """`bring_in`'s transfer to ``reps`` (trainer rank 0's replica, [] elsewhere), generation
    there paused (``paused``) under a ``pause_mode``: a request that starts between two update
    calls would run on partly new weights (a server a client reaches directly, a real SGLang
    server that cannot be told it is out of service). The base, then, ``lora="adapter"``, the
    adapter the others serve (`lora_stage.bring_adapter`). On any failure: a replica that kept
    part of the update, or the whole base but not the adapter (its old adapter, or none, on the
    new base: a pair no sync produced), stays paused (`manager_pause.stall`), the others are
    continued (what they hold is whole), and the error is raised."""
    based = []
    try:
        err, _ = manager._transport_sync(reps, version, manager.step - 1, reload=True)
        kept = manager_pause.kept_part(reps)
        if err is not None:       # (add_engine lets a replica it does not add go: `let_go`)
            manager_pause.stall(manager, kept, None if what == "add_engine" else err)
            raise err
        if manager.config.lora == "adapter":     # and the adapter the others serve (`lora_stage`)
            if manager.config.pause_mode is not None:     # (none: nothing paused, as before)
                based = reps      # the new base, whole: no generation on it with its old adapter
            manager._agree(lora_stage.bring_adapter(manager, reps[0] if reps else None, version), what=what)
    except BaseException as exc:
        try:     # an interrupt out of the transport too: no generation on partly new weights
            kept = manager_pause.kept_part(reps)
            manager_pause.stall(manager, kept, None)
            if based and not kept:        # (add_engine lets a replica it does not add go: `let_go`)
                manager_pause.stall(manager, based, None if what == "add_engine" else exc)
            manager_pause.resume(manager, paused)
        except Exception as cont:  # noqa: BLE001 - the transfer's error is the one to raise
            exc.add_note(f"and then: {cont}")
        raise
