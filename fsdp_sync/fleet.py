"""A fleet of rollout replicas: which engines serve, the version the fleet serves, and the
fleet-wide commit of a weight update.

With several engines (``method="distributed"`` or ``"disk"``: one per rollout replica, held by
trainer rank 0), a weight version is published (``manager.version``) only when every serving
replica has committed it. The update is two-phase across the fleet, as it is inside each
reference engine across its TP workers: every replica stages (``begin_weight_update``, then the
transport's calls), and only when every replica has staged does any of them commit
(`end_all`: ``end_weight_update``, the version set in the same step where the engine can,
``update_weight_version`` right after it otherwise); if any replica fails to stage, every replica
aborts and keeps the version it had.

What a failed replica does to the others is `SyncConfig.on_replica_failure`'s: ``"abort"`` raises
on every trainer rank; ``"quarantine"`` marks it out of service (`Fleet.quarantine`: the engine's
``set_serving(False, reason)``, so its ``/health`` answers 503 and a router stops sending to it)
and the manager runs the sync again for the healthy replicas. A replica that fails while
committing (after every replica staged) cannot be undone on the ones that committed already:
it is quarantined in both modes, and the error names who holds which version.

`problem` tells a replica that cannot take an update (dead or broken workers, a server that does
not answer) from one that only refused a call: only the first kind is quarantined; a refusal
(a wrong dtype, say) is the sync's error and fails it on every replica alike. But not one that
may be a replica's out of service rejoining the sync (it answered `problem`'s probe; it may still
refuse the update: restarted with other settings, a session of its own left open): a failed sync
with such replicas in it keeps them out until ``recover`` (`Fleet.keep_out`) and runs again for
the replicas in service, so one replica out of service cannot fail every sync of the fleet.

Not here: moving the bytes (the transports), the ``with`` block and when a sync runs (the manager).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from .engines.base import VersionNotNamed

__all__ = ["Replica", "Fleet", "CommitError", "VersionNotNamed", "end_all", "problem", "describe", "note_partial", "take_noted",
           "forget_noted"]

log = logging.getLogger("fsdp_sync")


def describe(engine: Any, index: int) -> str:
    """``replica 1 (http://127.0.0.1:30001)``: the index in the fleet and where it is."""
    where = getattr(engine, "base_url", None) or getattr(engine, "url", None)
    return f"replica {index}" + (f" ({where})" if isinstance(where, str) else "")


def problem(engine: Any, *, once: bool = False) -> str | None:
    """Why ``engine`` cannot take a weight update now, or None when it can.

    A reference engine says so itself (``dead_reason``: a dead or silent worker, a broken
    engine); an HTTP engine is asked for its weight version (every route of `fsdp-sync serve`
    answers 503 once its engine is dead; an unreachable server raises). Out of service (quarantined)
    is not a problem here: such a replica can be brought back. ``once``: one attempt, no retries
    (the probe of a replica already out of service, made every sync: a dead one must not cost
    each sync the client's whole backoff)."""
    fn = getattr(engine, "dead_reason", None)
    if callable(fn):
        try:
            reason = fn()
        except Exception as exc:  # noqa: BLE001 - the probe's own failure is the answer
            return f"{type(exc).__name__}: {exc}"
        if reason:
            return str(reason)
        return None
    for name in ("get_weight_version", "server_info"):
        fn = getattr(engine, name, None)
        if callable(fn):
            try:
                fn(**({"retries": 0} if once and "retries" in inspect.signature(fn).parameters else {}))
            except Exception as exc:  # noqa: BLE001
                return f"{type(exc).__name__}: {exc}"
            return None
    return None


class CommitError(RuntimeError):
    """Some replicas failed while committing, after every replica had staged. ``committed``:
    the indices (in the list given to `end_all`) that hold the new version; ``failed``: index ->
    the error."""

    def __init__(self, committed: list[int], failed: dict[int, BaseException], version: Any) -> None:
        first = min(failed)
        unnamed = sorted(i for i, e in failed.items() if isinstance(e, VersionNotNamed))
        refused = sorted(i for i in failed if i not in unnamed)
        said = f"engines {committed} committed it"
        if refused:
            said += f", engines {refused} did not"
        if unnamed:
            said += (f", engines {unnamed} committed its weights but still name them by their "
                     f"old version (their version call failed)")
        super().__init__(f"engine {first} failed while committing version {version!r} "
                         f"({type(failed[first]).__name__}: {failed[first]}); {said}")
        self.committed, self.failed, self.version = committed, failed, version


def _commit(engine: Any, version: str | None) -> None:
    if version is None or getattr(engine, "takes_weight_version", True) is False:
        engine.end_weight_update()      # an engine that cannot name its weights: committed unnamed
    elif "weight_version" in inspect.signature(engine.end_weight_update).parameters:
        # the reference engine (and `fsdp-sync serve`) set it in the commit's own step: no token
        # between the two; `SGLangEngine` falls back to update_weight_version where SGLang cannot
        engine.end_weight_update(weight_version=version)
    else:
        engine.end_weight_update()
        try:
            set_version(engine, version)
        except Exception as exc:  # noqa: BLE001 - said as what it is: weights in, name not
            raise VersionNotNamed(f"its new weights are committed, but naming them {version!r} "
                                  f"failed ({type(exc).__name__}: {exc})") from exc


def set_version(engine: Any, version: str) -> None:
    """SGLang's ``update_weight_version`` (running requests are not aborted), where the engine has it."""
    fn = getattr(engine, "update_weight_version", None)
    if callable(fn):
        if "abort_all_requests" in inspect.signature(fn).parameters:
            fn(version, abort_all_requests=False)
        else:
            fn(version)


def end_all(engines: list, *, commit: bool, version: str | None = None, skip: Iterable[int] = ()) -> list[str]:
    """Close the open update on every engine: commit (with ``version``) when ``commit``, else
    abort it where the engine can. ``skip``: indices of engines not to call (a request of theirs
    still runs: `transport.distributed`); every engine keeps its index in ``engines`` in what is
    said and raised. Called only after every engine staged (``commit``) or after any
    failed (not): this is the fleet's second phase. Commit failures raise `CommitError` once
    every engine was asked; abort failures are logged (the sync's own error is the one to report).
    Returns, after an abort, the engines that could not drop what they had taken (an engine that
    applies each call as it arrives: SGLang, a non-transactional reference engine) or whose abort
    failed (what it took may stay): they hold partly new weights, which is logged and said in the
    sync's error (`partial_note`)."""
    committed: list[int] = []
    partial: list[str] = []
    failed: dict[int, BaseException] = {}
    skip = set(skip)
    for i, e in enumerate(engines):
        if i in skip:
            continue
        end = getattr(e, "end_weight_update", None)
        try:
            if commit:
                if end is None:
                    if version is not None:
                        set_version(e, version)
                else:
                    _commit(e, version)
                committed.append(i)
            elif end is None or "abort" not in inspect.signature(end).parameters:
                if end is not None:
                    end()
                partial.append(describe(e, i))
            elif end(abort=True) is False:       # closed, but what it had applied stays
                partial.append(describe(e, i))
        except Exception as exc:  # noqa: BLE001 - every engine is asked; reported below
            if commit:
                failed[i] = exc
            else:     # whether it dropped what it took is unknown (SGLang applied it as it came)
                log.warning("fsdp_sync: closing %s's update after a failed sync: %s", describe(e, i), exc)
                partial.append(describe(e, i))
    if failed:
        # what a failed commit leaves is no version anyone agreed on (SGLang: every call applied,
        # its post-processing or the version's naming failed): noted as a replica that kept part
        # of a failed update (`take_noted`), so the manager holds it (`manager_pause.stall`): the
        # tensor method's engine too, whose transport has no fleet's blame (`Fleet.blame`)
        _note([describe(engines[i], i) for i in sorted(failed)])
        raise CommitError(committed, failed, version)
    if partial:
        log.warning("fsdp_sync: %s", partial_note(partial))
    return partial


def partial_note(partial: list[str]) -> str:
    """What to tell the user of engines that kept part of a failed update (`end_all`)."""
    return (f"{', '.join(partial)} could not drop any calls it took before the failure (it applied "
            f"them as they arrived, or wrote them over its weights in place): it now holds partly "
            f"new weights; sync again before generating from it")


def note_partial(partial: list[str], *, torn: list[str] | None = None) -> None:
    """Add `partial_note` to the exception being raised (a failed sync's own error), if any, and
    keep the names for the manager (`take_noted`: it keeps generation paused on them): those of
    ``torn`` where given (the replicas whose weights may mix two versions), else all."""
    keep = partial if torn is None else torn
    if keep:
        _note(keep)
    failure = sys.exc_info()[1]
    if partial and failure is not None:
        failure.add_note(partial_note(partial))


def take_noted() -> list[str]:
    """The replicas `note_partial` named for this thread's sync since the last call
    (``describe(engine, index)``, the index in the sync's engine list), and forget them."""
    with _noted_lock:
        return _noted.pop(_sync_thread(), [])


def forget_noted() -> None:
    """A sync starts on this thread: what an earlier sync noted and nobody took goes (its own
    error said it already, `note_partial`). A caller that takes no notes (verl's adapter calls
    `TensorTransport.send` thousands of times in one process, with no manager to keep generation
    paused) would otherwise keep one name per failed sync for the thread's life; a manager takes
    the notes of its sync before the next begins (`manager_pause.kept_part`)."""
    with _noted_lock:
        _noted.pop(_sync_thread(), None)


def _note(names: list[str]) -> None:
    with _noted_lock:
        _noted.setdefault(_sync_thread(), []).extend(names)


def _sync_thread() -> threading.Thread:
    """The thread whose sync this is: the current one, or the one it works for (``works_for``:
    `topology.agree_after_rank0` / ``agree_after_each`` run an engine's commit or load in a thread
    of their own where the group has peers; what it notes is the caller's, or the manager would
    continue a replica whose commit failed)."""
    t = threading.current_thread()
    return getattr(t, "works_for", None) or t


# per sync thread (two syncs in one process, e.g. ranks as threads, keep theirs apart); a thread's
# entry goes with it
_noted: "weakref.WeakKeyDictionary[threading.Thread, list[str]]" = weakref.WeakKeyDictionary()
_noted_lock = threading.Lock()


def restate(err: BaseException, message: str) -> BaseException:
    """``err`` said again as ``message`` (a failed sync's error with the replicas blamed), keeping
    what it carries: its notes (`partial_note`: the replicas that kept part of the update) and
    attributes (`SyncError.failures`)."""
    new = type(err)(message)
    new.__dict__.update({k: list(v) if k == "__notes__" else v for k, v in vars(err).items()})
    return new


@dataclass(eq=False)      # one replica is one engine: compared by identity
class Replica:
    """One engine of the fleet: whether it serves, why not, and the version it committed last."""

    engine: Any
    name: str
    serving: bool = True
    reason: str | None = None
    version: str | None = None
    quarantined_at: float | None = None     # time.monotonic() when it was taken out of service
    held: bool = False                      # taken out by hand: only `recover` brings it back
    rejoin: bool = False                    # `recover` / `add_engine` outside a sync: the next one brings it in
    stalled: bool = False                   # holds part of a failed update: generation paused until a sync commits
    partial: bool = False                   # holds part of a failed update (whatever the pause): no service until a commit
    told_out: bool = False                  # its engine was told it is out of service (`quarantine`)
    untold: str | None = None               # in service, but telling its engine so failed: told at each sync


class Fleet:
    """The manager's engines on the rank that holds them (see the module docstring)."""

    def __init__(self, engines: Iterable[Any]) -> None:
        self.replicas: list[Replica] = []
        self._count = 0
        # replicas removed while holding part of a failed update (`remove`): one added again is
        # that still, until a sync commits (its launch weights are gone; `add`)
        self._let_go: list[Replica] = []
        for e in engines:
            self.add(e)

    def add(self, engine: Any, *, serving: bool = True) -> Replica:
        if any(r.engine is engine for r in self.replicas):
            raise ValueError(f"{self.find(engine).name} is in the fleet already")
        rep = Replica(engine, describe(engine, self._count), serving=serving)
        self._count += 1
        gone = next((r for r in self._let_go if r.engine is engine), None)
        if gone is not None:         # still holds part of the failed update it was let go with
            self._let_go.remove(gone)
            rep.partial, rep.stalled = gone.partial, gone.stalled
        self.replicas.append(rep)
        return rep

    def remove(self, engine: Any) -> Replica:
        rep = self.find(engine)
        self.replicas.remove(rep)
        if rep.partial:
            self._let_go.append(rep)
        return rep

    def find(self, engine: Any) -> Replica:
        for r in self.replicas:
            if r.engine is engine:
                return r
        raise ValueError(f"{engine!r:.80} is not one of this manager's engines "
                         f"({[r.name for r in self.replicas]})")

    @property
    def engines(self) -> list:
        return [r.engine for r in self.replicas]

    @property
    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving]

    @property
    def out_of_service(self) -> list[Replica]:
        return [r for r in self.replicas if not r.serving]

    def quarantine(self, rep: Replica, reason: str) -> str | None:
        """Take ``rep`` out of service: it is not synced until it is brought back, and the engine
        is told (``set_serving(False, reason)``: `fsdp-sync serve` then answers 503 on /health and
        /generate). A dead engine cannot be told; it answers nothing anyway. Returns why the
        engine could not be told (a real SGLang server has no such switch: a router still sends
        it requests), or None."""
        rep.serving, rep.reason, rep.quarantined_at = False, reason, time.monotonic()
        fn, untold = getattr(rep.engine, "set_serving", None), None
        if callable(fn):
            try:
                fn(False, reason)
                rep.told_out = True
            except Exception as exc:  # noqa: BLE001 - a dead replica: it serves nothing either
                untold = f"{type(exc).__name__}: {exc}"
                log.warning("fsdp_sync: could not mark %s out of service (%s); it is out of the "
                            "fleet's syncs all the same", rep.name, exc)
        else:
            untold = "it has no set_serving"
        log.warning("fsdp_sync: %s quarantined: %s", rep.name, reason)
        return untold

    def blame(self, targets: list[Replica], commit_failed: CommitError | None, version: str) -> dict:
        """Trainer rank 0's word on a failed sync to ``targets`` (the manager follows it on every
        rank). ``failed``: {index in ``targets``: why} of those that failed committing, else of
        those that cannot take updates (`problem`); ``committed``: the indices that committed (a
        commit failure), else None; ``refused``: where neither names a replica, the ones that
        were out of service at the sync's start and rejoined it (one of them may be what
        refused: `keep_out`), unless they are all the sync had."""
        if commit_failed is not None:
            return {"failed": {i: f"failed while committing version {version!r}: {type(e).__name__}: {e}"
                               for i, e in commit_failed.failed.items()},
                    "committed": list(commit_failed.committed), "refused": []}
        failed = {i: p for i, r in enumerate(targets) if (p := problem(r.engine))}
        rejoined = [] if failed else [i for i, r in enumerate(targets) if not r.serving]
        return {"failed": failed, "committed": None,
                "refused": rejoined if len(rejoined) < len(targets) else []}

    def keep_out(self, targets: list[Replica], refused: list[int], err: BaseException,
                 version: str) -> list[Replica]:
        """The sync of ``version`` failed with ``err`` while ``targets[i]`` for i in ``refused``
        rejoined it: they stay out of service, held (only ``recover`` brings them back: one that
        refuses every update would otherwise fail one try of every sync), with the failure as
        the reason. Returns the targets left to sync again: the replicas in service."""
        for i in refused:
            rep, since = targets[i], targets[i].quarantined_at
            self.quarantine(rep, f"rejoining at version {version!r} failed ({type(err).__name__}: "
                                 f"{err}); recover() it once it can take updates")
            rep.quarantined_at, rep.held, rep.rejoin = since or rep.quarantined_at, True, False
        left = [r for i, r in enumerate(targets) if i not in refused]
        log.warning("fsdp_sync: version %s failed with %s rejoining; syncing it again without them "
                    "(replicas in service: %d)", version, ", ".join(targets[i].name for i in refused), len(left))
        return left

    def no_target(self, version: str) -> str:
        """Why a sync of ``version`` has no replica to go to: every one out of service, or none left."""
        out = [f"{r.name}: {r.reason}" for r in self.out_of_service]
        return (f"no replica can take version {version!r}: "
                + (f"every one is out of service ({'; '.join(out)}); recover() or add_engine() one"
                   if out else "the fleet is empty (remove_engine() took out every replica); "
                   "add_engine() one") + ", then sync again")

    def held(self, published: str | None) -> str | None:
        """The version the replicas in service hold, which a replica brought in is given:
        ``published`` (``manager.version``) but after a commit that failed on some replicas under
        ``"abort"``, where the ones that committed serve the new version and the manager's stays
        (the failed ones are out of service). Replicas in service on different versions are
        refused: no one version to bring another to."""
        versions = sorted({r.version for r in self.serving if r.version is not None})
        if len(versions) > 1:
            raise RuntimeError(f"the replicas in service hold different versions "
                               f"{[(r.name, r.version) for r in self.serving]}: sync the fleet "
                               f"before bringing a replica in")
        return versions[0] if versions else published

    def reinstate(self, rep: Replica, version: str | None) -> None:
        """``rep`` holds ``version`` now: back in service (its /health answers 200 again). An
        engine that cannot be told is logged, not raised (the sync that brought it back
        committed; raising here left every replica paused): a real SGLang server has no such
        switch (it was never out of service for a router); one that was told it is out of service
        (`fsdp-sync serve`) and now could not be told it serves (a connection reset) still answers
        503 with the old reason: it is told again at each sync that commits there until it takes
        it (``Replica.untold``, which ``fleet_status()`` gives as its reason meanwhile)."""
        fn = getattr(rep.engine, "set_serving", None)
        rep.untold = None
        if callable(fn):
            try:
                fn(True, "")
                rep.told_out = False
            except Exception as exc:  # noqa: BLE001 - said; raising here left every replica paused
                if rep.told_out:
                    rep.untold = (f"in service at version {version!r}, but telling its engine so "
                                  f"failed ({type(exc).__name__}: {exc}): it may still refuse requests "
                                  f"(503, out of service); the next sync tells it again")
                log.warning("fsdp_sync: could not mark %s in service again (%s); it is in the "
                            "fleet's syncs; %s", rep.name, exc,
                            "the next sync tells it again" if rep.told_out else
                            "put it back in the router's rotation if it was taken out")
        rep.serving, rep.reason, rep.version, rep.held, rep.rejoin = True, None, version, False, False
        rep.partial = False            # brought to a whole version (`manager_fleet.bring_in` refuses otherwise)
        rep.quarantined_at = None      # in service: no quarantine time in `summary`

    def summary(self) -> dict:
        """What ``manager.fleet_status()`` returns: per replica its name, state and version, and
        ``generation_paused`` (its generation held after a failed sync left it partly new weights,
        `manager_pause.stall`; the next sync that commits there continues it)."""
        return {"replicas": [{"name": r.name, "serving": r.serving, "reason": r.reason or r.untold,
                              "version": r.version, "quarantined_at": r.quarantined_at,
                              "generation_paused": bool(getattr(r, "stalled", False))}
                             for r in self.replicas]}
