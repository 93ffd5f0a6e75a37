"""H57's audit of `transport.sessions.begin_all`: every engine opened before one fails is closed
again on every failure path: a Ctrl-C (KeyboardInterrupt) in a later engine's begin (mutant: the
cleanup on ``Exception`` only survived every test, leaving the first engine inside an update no sync
ends, which refuses ``release_memory_occupation`` among others), a close that itself fails (the
others are still closed, and the begin's error, not the close's, is raised), an engine without
``abort`` (closed plainly), an engine without sessions (left alone)."""

from __future__ import annotations

import pytest

from fsdp_sync.transport import sessions


class _Engine:
    def __init__(self, refusal=None, close_fails=False):
        self.refusal, self.close_fails, self.open, self.calls = refusal, close_fails, False, []

    def begin_weight_update(self):
        self.calls.append("begin")
        if self.refusal is not None:
            raise self.refusal
        self.open = True

    def end_weight_update(self, *, abort=False, weight_version=None):
        self.calls.append("abort" if abort else "commit")
        if self.close_fails:
            raise RuntimeError("connection reset while closing")
        self.open = False


class _NoAbort(_Engine):
    def end_weight_update(self):
        self.calls.append("end")
        self.open = False


class _NoSessions:
    calls: list = []


def test_a_ctrl_c_in_a_later_begin_closes_those_opened_already():
    a, b = _Engine(), _Engine(refusal=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        sessions.begin_all([a, b])
    assert a.calls == ["begin", "abort"] and not a.open


def test_a_failing_close_does_not_stop_the_others_nor_hide_the_begin_s_error(caplog):
    a, c, plain = _Engine(close_fails=True), _Engine(), _NoAbort()
    none, bad = _NoSessions(), _Engine(refusal=RuntimeError("out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        sessions.begin_all([a, none, plain, c, bad])
    assert a.calls == ["begin", "abort"]
    assert plain.calls == ["begin", "end"] and not plain.open
    assert c.calls == ["begin", "abort"] and not c.open
    assert bad.calls == ["begin"]
    assert "connection reset while closing" in caplog.text and "begin_weight_update failed" in caplog.text
