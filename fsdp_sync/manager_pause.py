"""Generation around a sync (`SyncConfig.pause_mode`): the manager's pause, its continue, and what
a failed sync leaves paused.

- `pause`: SGLang's ``pause_generation(mode)`` on every target replica; agreed over the trainer's
  ranks. When one rank's pause fails, every rank continues the replicas it paused before raising
  the agreed `SyncError`: no replica is left paused by a sync that never ran.
- `resume`: ``continue_generation`` on the replicas paused, except those holding partly new
  weights (`stall`).
- `kept_part`: the replicas that a failed sync left holding part of its update (an engine that
  applies each call as it arrives: SGLang, a reference engine with ``transactional_updates=False``;
  the transports say which by `fleet.note_partial`).
- `stall`: such replicas do not generate again on those weights: under a ``pause_mode`` their
  requests are ended (``pause_generation(mode="abort")``: they come back aborted, not finished on
  mixed weights under the old version) and generation stays paused there (``Replica.stalled``);
  in a fleet (``method="distributed"`` / ``"disk"``) they are taken out of service, whatever the
  mode, and rejoin at the next sync. The next sync that commits on one continues it (`release`).
- `let_go`: a replica holding partly new weights that leaves the fleet (`remove_engine`, a failed
  `add_engine`): no sync will continue it, so what it holds ends now as aborted, generation stays
  paused there and it is told it is out of service, for that reason.
- `release`: after a commit, continue generation (the paused replicas and the stalled ones the
  sync brought back); a failure there is agreed into one `SyncError` that says the version was
  committed (the manager's version is already the new one on every rank).

Not here: when a sync pauses (the manager's ``_sync_full``, `lora_stage`), the fleet's state
(`fleet`).
"""

from __future__ import annotations

import logging
from typing import Any

from . import fleet
from .topology import SyncError

__all__ = ["pause", "resume", "kept_part", "stall", "release", "let_go"]

log = logging.getLogger("fsdp_sync")

STAYS = "generation stays paused on it until a sync succeeds"


def pause(manager: Any, targets: list) -> list:
    """``pause_generation(mode=SyncConfig.pause_mode)`` on every target; returns the replicas
    paused. A failure on any rank raises the same `SyncError` on every rank, each rank having
    continued the ones it paused (a failure to continue is logged and noted, not raised over it)."""
    mode = manager.config.pause_mode
    if mode is None:
        return []
    paused, err = [], None
    for rep in targets:
        try:
            rep.engine.pause_generation(mode=mode)
            paused.append(rep)
        except Exception as exc:  # noqa: BLE001 - reported to every rank just below
            err = err or f"pause_generation(mode={mode!r}) on {rep.name}: {type(exc).__name__}: {exc}"
    try:
        manager._agree(err, what="pause_generation")
    except SyncError as exc:          # this rank's or another's: let go of what this rank paused
        try:
            resume(manager, paused)
        except Exception as cont:  # noqa: BLE001 - the pause's error is the one to raise
            exc.add_note(f"and then: {cont}")
        raise
    return paused


def resume(manager: Any, paused: list) -> None:
    """``continue_generation`` on ``paused``, except a replica holding partly new weights
    (``stalled``); one that cannot take updates any more (`fleet.problem`) is passed over. Raises
    `RuntimeError` naming the first other failure, after trying every replica."""
    err = None
    for rep in paused:
        if getattr(rep, "stalled", False):
            continue
        try:
            rep.engine.continue_generation()
        except Exception as exc:  # noqa: BLE001
            if fleet.problem(rep.engine) is None:
                err = err or f"continue_generation on {rep.name}: {type(exc).__name__}: {exc}"
    if err is not None:
        log.error("fsdp_sync: %s", err)
        raise RuntimeError(err)


def kept_part(targets: list) -> list:
    """The replicas among ``targets`` (the list the sync was given) that the transport said kept
    part of a failed update (`fleet.take_noted`: named as ``fleet.describe(engine, index)``)."""
    noted = set(fleet.take_noted())
    return [r for i, r in enumerate(targets) if fleet.describe(r.engine, i) in noted]


def stall(manager: Any, reps: list, err: BaseException | None) -> None:
    """``reps`` hold partly new weights. Under a ``pause_mode``: end their requests and keep
    generation paused there (``Replica.stalled``); in a fleet, whatever the mode: take them out
    of service, to rejoin at the next sync. ``err`` (the failed sync's error) is told so. (No
    pause_mode, one engine: the transport's note, "sync again before generating from it", is all.)"""
    for rep in reps:
        note, rep.partial = f"{rep.name} holds partly new weights", True
        if manager.config.pause_mode is not None:
            rep.stalled = True
            try:
                rep.engine.pause_generation(mode="abort")
            except Exception as exc:  # noqa: BLE001 - a dead engine generates nothing either
                log.warning("fsdp_sync: could not pause %s after a failed sync: %s", rep.name, exc)
            note += f": its requests were aborted and {STAYS}"
        if manager.config.method != "tensor":       # the manager's fleet mode
            if rep.serving:
                manager.fleet.quarantine(rep, "holds partly new weights from a failed sync")
            rep.rejoin = not rep.held       # taken out by hand: it waits for `recover`, as before
            note += ("; it is out of service until recover() brings it back" if rep.held else
                     "; it is out of service, and the next sync brings it back")
        elif manager.config.pause_mode is None:
            continue
        log.warning("fsdp_sync: %s", note)
        if err is not None:
            err.add_note(note)


def release(manager: Any, paused: list, targets: list, version: str | None, *, resume_now: bool = True) -> None:
    """After ``version`` was committed on ``targets`` (the manager's version already says so):
    continue generation on ``paused`` and on the stalled targets, which hold it now. A failure on
    any rank raises the same `SyncError` on every rank, naming the replica and the version.
    ``resume_now`` False (`lora_stage`'s base: it continues once the adapter is loaded): the
    stalled targets are only marked whole again, for the caller's continue."""
    back = [r for r in targets if getattr(r, "stalled", False)]
    for rep in back:
        rep.stalled = False
    for rep in targets:
        rep.partial = False          # a whole version now: it may serve again (`Replica.partial`)
    if not resume_now or manager.config.pause_mode is None:
        return      # no pause_mode (every rank's config): nothing was paused or stalled anywhere
    err = None
    try:
        resume(manager, list(paused) + [r for r in back if r not in paused])
    except RuntimeError as exc:
        err = (f"{exc}; version {version!r} was committed (manager.version and fleet_status() say "
               f"it), but generation there is still paused: call continue_generation on it, or "
               f"the next sync continues it")
    manager._agree(err, what="continue_generation")


def let_go(manager: Any, rep: Any, what: str) -> str | None:
    """``rep`` left the fleet (``what``: ``"remove_engine"``, a failed ``"add_engine"``) holding
    partly new weights (``Replica.partial``): no sync of this manager will bring it back whole or
    continue its generation. Under a ``pause_mode`` its requests, those waiting since the failed
    sync too, end now as aborted (``pause_generation(mode="abort")``) and generation stays paused
    there; in any mode it is told it is out of service with the reason (`fsdp-sync serve` then
    answers 503 naming it instead of holding a request). Returns what is said (logged), or None
    for a replica that holds a whole version (it is told nothing)."""
    if not getattr(rep, "partial", False):
        return None
    reason = (f"removed from the fleet ({what}) holding partly new weights from a failed sync: "
              f"load whole weights (add_engine it again) or restart it before generating from it")
    note = f"{rep.name} was {reason}"
    dead = fleet.problem(rep.engine, once=True)      # one probe, not a dead server's backoff per call
    if dead is not None:
        log.warning("fsdp_sync: %s; it cannot take calls (%s): it serves nothing", note, dead)
        return f"{note}; it cannot take calls ({dead})"
    if manager.config.pause_mode is not None:
        try:
            rep.engine.pause_generation(mode="abort")
            rep.stalled = True        # added again, the sync that commits continues it (`Fleet.add`)
            note += "; its requests were aborted and generation stays paused there"
        except Exception as exc:  # noqa: BLE001 - a dead engine generates nothing either
            note += f"; aborting its requests failed ({type(exc).__name__}: {exc})"
    fn = getattr(rep.engine, "set_serving", None)
    try:
        if not callable(fn):
            raise AttributeError("it has no set_serving")
        fn(False, reason)
    except Exception as exc:  # noqa: BLE001 - said: the caller must keep traffic away from it
        note += (f"; it cannot be taken out of service itself ({type(exc).__name__}: {exc}): take "
                 f"it out of the router's rotation, requests sent to it " + (
                     "wait until generation is continued" if manager.config.pause_mode is not None
                     else "are answered from those weights"))
    log.warning("fsdp_sync: %s", note)
    return note
