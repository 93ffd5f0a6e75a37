"""Audit H62: the reference engine's abort round asks only the workers worth asking.

A worker that let a call time out (silent) or has died is not sent the abort that follows a
failed update: a silent one would cost another ``call_timeout_s`` (900 s by default) before the
failed call returns, a dead one nothing but an error. Checked on a bare engine object in this
process (its round stubbed); test_faults.py's stalled-worker test runs the real thing, where this
mutant survived (the second timeout there is 2 s, and the abort round's error is swallowed).
"""

from __future__ import annotations

import types

import pytest

from fsdp_sync.engines import EngineError, ReferenceEngine
from fsdp_sync.engines.reference import procs


@pytest.mark.timeout(30)
def test_the_abort_round_skips_silent_and_dead_workers_and_marks_the_transaction_aborted(monkeypatch):
    """Mutant: the abort round sent to every TP rank (the silent one included), killed."""
    e = ReferenceEngine.__new__(ReferenceEngine)
    e._w = procs.WorkerSet()
    e._w.procs = [types.SimpleNamespace(is_alive=lambda alive=alive: alive) for alive in (True, True, False, True)]
    e._w.silent = {1}
    e.tp_size, e._in_txn, e._txn_transactional, e._txn_aborted = 4, True, True, None
    asked = []

    def round_(cmd, args=None, *, ranks=None, what=None, **kw):
        asked.append((cmd, args, list(range(e.tp_size)) if ranks is None else list(ranks)))
        raise EngineError("TP ranks [3] did not answer")      # swallowed: the caller raises its own

    monkeypatch.setattr(e, "_round", round_)
    e._abort_all("update_weights_from_tensor()", "expected shape (4,) for 'x' on TP rank 0, got (3,)")
    assert asked == [("abort", {"reason": "expected shape (4,) for 'x' on TP rank 0, got (3,)"}, [0, 3])]
    assert e._txn_aborted == "expected shape (4,) for 'x' on TP rank 0, got (3,)"
