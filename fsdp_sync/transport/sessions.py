"""The engines' weight-update sessions as the transports open them: ``begin_weight_update`` that
takes over a session a dead trainer left open (`begin`, `begin_all`), and whether a disk load goes
inside one at all (`stages_disk_loads`).

A trainer that died between ``begin_weight_update`` and ``end_weight_update`` leaves the engine
(SGLang 0.5.21+, ``fsdp-sync serve``, the reference engine) with its session open, and every later
``begin_weight_update`` is refused (`LEFT_OPEN`): without `begin` no sync of a fresh trainer
could ever run. The trainer that calls `begin` owns the engine now, so the old session is aborted
(`end_weight_update(abort=True)`: dropped where the engine stages, only closed on SGLang, which
applied what arrived) and a new one begun, with a warning. Only those exact refusals are taken
over: any other, even one that says "already" (another flush already in progress, an adapter
already loaded), is raised with nothing aborted.

A disk load goes inside a session only on an engine that stages it (`stages_disk_loads`): SGLang
0.5.23 applies ``update_weights_from_disk`` at once and post-processes the weights itself
(``restore_weights_before_loading`` -> ``load_weights`` -> ``process_weights_after_loading``), and
its session does not count a disk load as a load (``loaded_weights`` stays False), so its
``end_weight_update`` post-processes the weights a second time: ``process_weights_after_loading``
twice, which scrambles every layer whose method repacks in place (online FP8 transposes, MoE
shuffles), without an error.

Not here: the calls of one update (the transports), committing a fleet (`fleet.end_all`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from .. import fleet

__all__ = ["begin", "begin_all", "stages_disk_loads", "LEFT_OPEN", "left_open"]

log = logging.getLogger("fsdp_sync")

LEFT_OPEN = (
    # SGLang 0.5.21+ (0.5.23: managers/scheduler_components/weight_updater.py, answered as
    # {"success": false, "message": ...}, HTTP 400; data-parallel ranks' messages joined by " | ")
    "a weight-update session is already open; call end_weight_update() first",
    # fsdp_sync's reference engine (engines/reference/engine.py), in process and through
    # ``fsdp-sync serve`` (its 400 answer's message)
    "begin_weight_update called twice without end_weight_update",
)
"""The texts with which the engines refuse ``begin_weight_update`` because a session is open
(SGLang 0.5.12 to 0.5.20 have no session at all: `SGLangEngine` skips its calls there). An engine
error carries one inside its own wording (``SGLang refused begin_weight_update at <url>: ...``)."""


def left_open(exc: BaseException) -> bool:
    """Whether ``exc`` is an engine's refusal of ``begin_weight_update`` for a session left open."""
    text = str(exc)
    return any(t in text for t in LEFT_OPEN)


def begin(engine: Any) -> None:
    """Open the engine's update. One left open by a trainer that died inside it (this transport
    owns the engine now) is aborted first, so a fresh trainer can take over; any other refusal
    is raised."""
    try:
        engine.begin_weight_update()
    except Exception as exc:  # noqa: BLE001 - only a session left open is handled
        if not left_open(exc):
            raise
        log.warning("fsdp_sync: %s had a weight update open (a previous trainer died in it?): "
                    "aborting it and starting ours (%s)", engine, exc)
        engine.end_weight_update(abort=True)
        engine.begin_weight_update()


def begin_all(engines: list) -> None:
    """`begin` on every engine that has ``begin_weight_update``; when one fails, those opened
    already are closed again (aborted: nothing was sent), so none is left inside an update that
    no sync will end (which refuses, among others, ``release_memory_occupation``), and the error
    is raised."""
    opened = []
    try:
        for e in engines:
            if hasattr(e, "begin_weight_update"):
                begin(e)
                opened.append(e)
    except BaseException:
        for e in opened:
            try:
                if "abort" in inspect.signature(e.end_weight_update).parameters:
                    e.end_weight_update(abort=True)
                else:
                    e.end_weight_update()
            except Exception as exc:  # noqa: BLE001 - the begin's failure is the error to raise
                log.warning("fsdp_sync: closing %s's update after another's begin_weight_update "
                            "failed: %s", fleet.describe(e, engines.index(e)), exc)
        raise


def stages_disk_loads(engine: Any) -> bool:
    """Whether the disk method loads into ``engine`` inside ``begin_weight_update`` /
    ``end_weight_update``: an engine that says (``stages_disk_loads``: `SGLangEngine` says False
    for SGLang, True for ``fsdp-sync serve``), else one that has ``begin_weight_update`` (the
    reference engine, whose session stages a disk load until its commit)."""
    if not hasattr(engine, "begin_weight_update"):
        return False
    says = getattr(engine, "stages_disk_loads", None)
    return True if says is None else bool(says)
