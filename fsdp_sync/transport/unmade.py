"""A call one trainer rank could not make, and the stand-in it sends instead (`tensor.TensorTransport`).

A rank can fail to make its part of a call after the bucket's own collectives ran on every rank:
sharing its handles (a full /dev/shm), a copy into a buffer of the sync (a CUDA out-of-memory), a
caller's generator (verl's adapter). Before, that rank left the send loop for its stage's closing
agree while the others waited for it in the call's gather: two collectives that do not match,
every rank blocked until the process group's timeout, then raw gloo errors (or a gloo abort). Now
the rank sends a stand-in (`made`) to the call's gather and its error to the call's agree;
infer-TP rank 0 hands nothing of the call to the engine (`refusal`), the payloads the other ranks
made are released unopened, and every rank raises the same `SyncError` naming the rank and its
error at that agree (the update is then aborted, as after an engine's refusal).

Not covered: a rank failing inside a collective of the export itself (FSDP's all-gather, the
reshard's all-to-all): the others wait in it until the group's timeout. Not here: the send loop.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

__all__ = ["made", "refusal"]

log = logging.getLogger("fsdp_sync")

_TAG = "fsdp_sync: call not made"


def _stand_in(wire: Any) -> str | None:
    """The error a stand-in's wire carries, or None for a real payload."""
    if isinstance(wire, tuple) and len(wire) == 2 and wire[0] == _TAG:
        return wire[1]
    return None


def made(calls: Iterable, topo: Any, make_call: Callable[..., Any]) -> Iterator:
    """``calls``, then, where making the next one raises on this rank, one stand-in
    (``make_call(sets, wire, to_named, load_format, last, what)``, as `tensor.Call`) whose wire
    carries the error, and nothing after it (its agree raises on every rank)."""
    it = iter(calls)
    last = None
    while True:
        try:
            call = next(it)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, at this call's agree
            what = f"the call after {last}" if last is not None else "the first call"
            text = f"making {what} on {topo.describe()}: {type(exc).__name__}: {exc}"
            log.warning("fsdp_sync: %s", text, exc_info=True)
            break
        last = call.what
        yield call
    yield make_call([], (_TAG, text), None, None, False, what)


def refusal(call: Any, gathered: list | None, topo: Any) -> str | None:
    """This rank's error for ``call`` where a rank of its infer-TP group sent a stand-in: on
    infer-TP rank 0 from the ``gathered`` wires (then it calls no engine), elsewhere from its own;
    None where every payload was made."""
    if not topo.is_tp_src:
        return _stand_in(call.wire)
    bad = {r: t for r, w in enumerate(gathered or ()) if (t := _stand_in(w)) is not None}
    if not bad:
        return None
    return (f"{call.what}: infer-TP rank(s) {sorted(bad)} of {topo.describe()} could not make "
            f"their payload, so nothing of it was handed to the engine: {bad[min(bad)]}")

