"""The transaction bookkeeping of a reference engine, from the client's side: what
``begin_weight_update()`` … ``end_weight_update()`` do with the engine's transaction state
(``_in_txn``, ``_txn_aborted``, ``_txn_transactional``, ``_txn_version``, ``_txn_heads``) and its
workers: opening a transaction on every worker and dropping it where some could not open it; the
commit or abort at the end, with the tied-head check before a commit; judging an end that failed on
some workers (the engine's weights kept, or the engine broken); and the words an aborted
transaction's error uses for what it left.

Each function takes the `ReferenceEngine` as its first argument and uses its update gate
(``_gate``), rounds (``_round``, ``_raise_errors``, ``_abort_all``) and broken state; the engine's
public ``begin_weight_update`` / ``end_weight_update`` call `begin` / `end`.

Not here: staging and committing each update call (`ReferenceEngine._two_phase`, the workers'
`staging`), the check of a sent tied ``lm_head`` (`tied_head`), what a transaction keeps aside on
the workers (`staging`).
"""

from __future__ import annotations

from typing import Any

from ..base import EngineError, EngineStateError, WeightUpdateError
from .scheduler import check_version

__all__ = ["RESTART", "begin", "drop_begun", "end", "end_failed", "kept_words", "tied_head_refusal"]

RESTART = "shut it down and start a new one, then push every tensor"
"""What a user does once the TP ranks may disagree on their weights."""


def begin(engine: Any, *, transactional: bool | None = None) -> None:
    """`ReferenceEngine.begin_weight_update`: open a transaction on every worker (see there)."""
    transactional = engine.transactional_updates if transactional is None else bool(transactional)
    with engine._gate("begin_weight_update"):
        engine._check_usable()
        if engine._in_txn:
            raise EngineStateError("begin_weight_update called twice without end_weight_update")
        replies = engine._round("begin", {"transactional": transactional})
        if any(rep[0] != "ok" for rep in replies.values()):
            drop_begun(engine, replies)
        engine._in_txn, engine._txn_aborted, engine._txn_transactional = True, None, transactional
        engine._txn_version, engine._txn_heads = None, False


def drop_begun(engine: Any, replies: dict[int, tuple]) -> None:
    """A `begin` round failed on some workers: every worker drops the transaction it holds (one
    left open would stage the next plain update aside while the others apply it: two versions
    served); one that cannot breaks the engine. Raises the begin's error."""
    try:
        ends = engine._round("end", {"abort": True}, ranks=engine._responsive(), what="begin_weight_update (drop)")
    except EngineError:
        ends = {}              # a worker died or went silent: the engine is broken already
    if kept := sorted(r for r, rep in ends.items() if rep[0] != "ok"):
        engine._broken = engine._broken or (f"begin_weight_update: TP ranks {kept} could not drop the "
                                            f"transaction they began, so the engine serves nothing more: {RESTART}")
    engine._raise_errors(replies, "begin_weight_update")


def end(engine: Any, *, abort: bool = False, weight_version: str | None = None) -> bool:
    """`ReferenceEngine.end_weight_update`: commit or drop the open transaction (see there); a
    commit that fails on some workers goes to `end_failed`."""
    check_version(weight_version, "end_weight_update")
    if abort and weight_version is not None:     # as SGLangEngine and `fsdp-sync serve` refuse it
        raise ValueError(f"end_weight_update: an abort commits no weights, so it takes no "
                         f"weight_version (got {weight_version!r}); pass weight_version or "
                         f"abort=True, not both (the update is still open)")
    with engine._gate("end_weight_update"):
        if not engine._in_txn:
            raise EngineStateError("end_weight_update without begin_weight_update")
        engine._in_txn = False
        aborted, engine._txn_aborted = engine._txn_aborted, None
        pending, engine._txn_version = engine._txn_version, None
        heads, engine._txn_heads = engine._txn_heads, False
        engine._check_usable()
        by_head = heads and not abort and aborted is None and tied_head_refusal(engine)
        aborted = by_head or aborted
        dropping = abort or aborted is not None
        try:
            replies = engine._round("end", {"abort": dropping})
        except BaseException as exc:
            if not dropping and not isinstance(exc, EngineError):
                # the workers may have committed, some or all: the weights served are not
                # known to be the old ones under the old version, nor the new under the new
                engine._broken = engine._broken or (
                    f"end_weight_update: interrupted while the TP ranks committed ({exc!r}); "
                    f"they may hold different weights, and the weight version was not "
                    f"changed, so the engine serves nothing more: {RESTART}")
            raise
        if any(rep[0] != "ok" for rep in replies.values()):
            end_failed(engine, replies, weight_version if weight_version is not None else pending)
        done = [rep[1] for rep in replies.values() if isinstance(rep[1], dict)]
        # what the transaction kept in host memory, its workers' GPUs having no room for it
        engine.staged_on_host_bytes = sum(int(d.get("staged_on_host_bytes", 0)) for d in done)
        lost = next((d["overwritten"] for d in done if d.get("overwritten")), None)
        kept = engine._txn_transactional and lost is None
        if aborted is not None and not abort:
            why = f"aborted ({aborted})" if by_head else f"aborted by an earlier failure ({aborted})"
            raise WeightUpdateError(f"end_weight_update: nothing was committed: this weight update was "
                                    f"{why}; {kept_words(engine, lost)}")
        version = weight_version if weight_version is not None else pending
        if version is not None and not abort:
            engine.weight_version = version
        return kept if abort else True


def end_failed(engine: Any, replies: dict[int, tuple], version: str | None) -> None:
    """An `end` round that failed on some workers (holding the lock); raises. A worker that
    failed before its end's body (an injected fault) still holds its transaction: each failed
    worker drops it now. The weights are as one update made them only where every failed worker
    dropped an untouched transaction and none applied staged copies; otherwise shards disagree
    and the engine is broken, as after a failed `_two_phase` commit."""
    errs = sorted(r for r, rep in replies.items() if rep[0] != "ok")
    _, _, msg, tb, name = replies[errs[0]]
    text = f"end_weight_update: TP rank {errs[0]} failed: {msg}" + (f" (also TP ranks {errs[1:]})"
                                                                     if len(errs) > 1 else "")
    try:
        closed = engine._round("end", {"abort": True}, ranks=errs,
                             what="end_weight_update (dropping the failed ranks' transactions)")
    except EngineError:
        closed = {}           # broken already; the weights are judged as not dropped below
    if not engine._txn_transactional:      # every call was committed on every rank as it came
        try:
            engine._raise_errors(replies, "end_weight_update")
        except EngineError as exc:     # said: the new weights serve under the old name
            v = "" if version is None else f" (not {version!r})"
            exc.add_note(f"{kept_words(engine, None)}, and are served under weight version "
                         f"{engine.weight_version!r}{v}: push a whole update again before generating from it")
            raise
    ends = [{**replies, **closed}.get(r) for r in range(engine.tp_size)]   # each rank's last end reply
    done = [rep[1] if rep and rep[0] == "ok" and isinstance(rep[1], dict) else {} for rep in ends]
    applied = [r for r in range(engine.tp_size) if r not in errs and done[r].get("staged")]
    unknown = [r for r in errs if not done[r].get("dropped")]   # its end may have written weights
    if not applied and not unknown:
        lost = next((d["overwritten"] for d in done if d.get("overwritten")), None)
        raise WeightUpdateError(f"{text}; nothing was committed: the update was dropped on every TP "
                                f"rank; {kept_words(engine, lost)}", rank=errs[0], name=name)
    v = "" if version is None else f" (version {version!r})"
    part = f"TP ranks {unknown} may have written part of the update{v}"
    why = (f"TP ranks {applied} committed the update{v} and TP ranks {errs} did not"
           + (f" ({part})" if unknown else "") if applied else part)
    earlier = f" (and: {engine._broken})" if engine._broken else ""     # a worker died dropping it
    engine._broken = (f"{text}; {why}: the weights are inconsistent across TP ranks, so the engine "
                    f"serves nothing more: {RESTART}{earlier}")
    raise EngineError(f"{engine._broken}\n(worker traceback)\n{tb}")


def kept_words(engine: Any, lost: str | None) -> str:
    """What an aborted transaction left, for its error (``lost``: a worker's word on what it
    could not give back)."""
    if not engine._txn_transactional:
        return "its calls were committed as they came (not transactional): the weights are partly new"
    if lost is None:
        return f"the engine keeps its previous weights (version {engine.weight_version!r})"
    return (f"its calls before the failure were written in place (the engine held no weights worth "
            f"a copy: its random start-up weights, or weights released without a backup): {lost}; "
            f"the engine serves nothing until then")


def tied_head_refusal(engine: Any) -> str | None:
    """Before a commit: every worker compares the tied ``lm_head.weight`` the transaction sent
    with no embedding after it against the loaded embedding (`tied_head`); where one differs,
    the transaction is aborted on every worker and the refusal returned."""
    replies = engine._round("check_heads", what="end_weight_update (tied lm_head)")
    errs = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
    if not errs:
        return None
    reason = str(errs[min(errs)][2])
    engine._abort_all("end_weight_update", reason)
    return reason
