"""`transaction.end_failed` for a non-transactional update (H75; transaction T13/T14 left by
earlier passes: a fault in one worker's end costs ~25 s as a TP-2 engine, so judged here with a
stand-in engine that answers the drop round as the workers do).

Without a transaction every call was committed on every TP rank as it came, so an end that fails
on one worker leaves the engine serving the update's weights under its previous weight version
(measured on a TP-2 engine, ``worker:1:end:raise``: checksum of the new weights, version '1',
generate answering). Before, the error read only the worker's fault, nothing of what the engine
serves; now it says so, and to push a whole update again."""

from __future__ import annotations

import pytest

from fsdp_sync.engines import EngineError, ReferenceEngine
from fsdp_sync.engines.reference import transaction


class _Engine:
    tp_size = 2
    _txn_transactional = False
    _broken = None
    weight_version = "1"
    _raise_errors = ReferenceEngine._raise_errors

    def __init__(self):
        self.rounds = []

    def _round(self, cmd, args, ranks=None, what=None):
        self.rounds.append((cmd, args, ranks))
        return {r: ("ok", {"committed": False, "overwritten": None, "dropped": True}) for r in ranks}


def _replies():
    return {0: ("ok", {"committed": True}),
            1: ("err", "internal", "InjectedFault: injected fault: worker 1 at end", "(tb)", None)}


def test_a_failed_end_without_a_transaction_says_the_new_weights_serve_under_the_old_version():
    e = _Engine()
    with pytest.raises(EngineError, match="InjectedFault") as info:
        transaction.end_failed(e, _replies(), "2")
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "committed as they came (not transactional)" in notes, notes       # before: no note
    assert "weight version '1' (not '2')" in notes and "push a whole update again" in notes, notes
    assert e.rounds == [("end", {"abort": True}, [1])]       # the failed rank's transaction dropped
    assert e._broken is None


def test_a_failed_end_in_a_transaction_is_judged_as_before():
    e = _Engine()
    e._txn_transactional = True
    with pytest.raises(EngineError, match="inconsistent across TP ranks") as info:
        transaction.end_failed(e, {0: ("ok", {"committed": True, "staged": True}), **{1: _replies()[1]}}, "2")
    assert "TP ranks [0] committed the update (version '2') and TP ranks [1] did not" in str(info.value)
    assert "inconsistent across TP ranks" in (e._broken or "")
