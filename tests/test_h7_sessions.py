"""`transport.sessions` (mutation pass, H7): only a session left open ("already open", "twice") is
taken over; any other refusal of ``begin_weight_update`` is raised with nothing aborted; and when one
engine of a fleet refuses, those opened already are aborted again."""

from __future__ import annotations

import pytest


class _Engine:
    def __init__(self, refusal=None, stale=False):
        self.refusal, self.open, self.calls = refusal, stale, []

    def begin_weight_update(self):
        self.calls.append("begin")
        if self.refusal:
            raise RuntimeError(self.refusal)
        if self.open:
            raise RuntimeError("a weight-update session is already open; call end_weight_update() first")
        self.open = True

    def end_weight_update(self, *, abort=False, weight_version=None):
        self.calls.append("abort" if abort else "commit")
        self.open = False
        return True


def test_a_refusal_other_than_an_open_session_is_raised_and_nothing_aborted():
    from fsdp_sync.transport import sessions

    e = _Engine(refusal="engine is shutting down")
    with pytest.raises(RuntimeError, match="shutting down"):
        sessions.begin(e)
    assert e.calls == ["begin"]


def test_a_session_left_open_is_aborted_and_begun_again():
    from fsdp_sync.transport import sessions

    e = _Engine(stale=True)
    sessions.begin(e)
    assert e.calls == ["begin", "abort", "begin"] and e.open


def test_begin_all_aborts_those_opened_when_a_later_one_refuses():
    from fsdp_sync.transport import sessions

    a, b = _Engine(), _Engine(refusal="out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        sessions.begin_all([a, b])
    assert a.calls == ["begin", "abort"] and not a.open
