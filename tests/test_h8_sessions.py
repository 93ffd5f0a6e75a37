"""`transport.sessions.begin` takes over only a session left open, by the engines' exact refusals
(`sessions.LEFT_OPEN`), as each engine really delivers them: SGLang's answer through
`SGLangEngine` (in process and over HTTP), the reference engine's own ``EngineStateError`` and
``fsdp-sync serve``'s 400. A refusal that merely says "already" or "twice" (another flush already
in progress, an adapter already loaded, a tensor twice in one update) is raised with nothing
aborted: before (audit H8), any refusal holding either word aborted the engine's session.

tests/sglang_tier/test_h8_session_texts_sglang.py checks SGLang's text against the installed
release's source."""

from __future__ import annotations

import contextlib

import pytest

from fsdp_sync.engines.base import EngineStateError
from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.transport import sessions

pytestmark = pytest.mark.timeout(60)

UNRELATED = [
    "Another flush_cache is already in progress.",
    "begin_weight_update: an adapter named 'a' is already loaded; unload_lora_adapter('a') first",
    "begin_weight_update: 'model.norm.weight' appears twice in one update",
    "a weight update is already open",          # no engine's words: not taken as one
    "begin_weight_update was called twice",
]


class _Engine:
    """Refuses its first ``begin_weight_update`` with ``first`` (an exception), then opens."""

    def __init__(self, first: BaseException | None):
        self.first, self.calls = first, []

    def begin_weight_update(self):
        self.calls.append("begin")
        if self.first is not None:
            first, self.first = self.first, None
            raise first

    def end_weight_update(self, *, abort=False, weight_version=None):
        self.calls.append("abort" if abort else "commit")
        return True


def _sglang_refusal(message: str) -> EngineStateError:
    """What `SGLangEngine` raises for SGLang's ``(False, message)`` answer (in process)."""
    from fsdp_sync.engines.sglang.client import check_answer
    from fsdp_sync.engines.sglang.session_calls import _state_error

    with pytest.raises(EngineStateError) as info:
        check_answer("begin_weight_update", (False, message), error=_state_error, where=" at x")
    return info.value


class _RefStub:
    """Just what `ReferenceEngine.begin_weight_update` reads, so its own refusal is raised."""

    transactional_updates = True
    tp_size = 1

    def __init__(self, in_txn: bool, refusal: str | None = None):
        self._in_txn, self.refusal, self.calls = in_txn, refusal, []

    def _gate(self, what, **kw):
        return contextlib.nullcontext()

    def _check_usable(self):
        pass

    def _round(self, *a, **kw):
        return {0: ("ok",)}

    def begin_weight_update(self, **kw):
        self.calls.append("begin")
        if self.refusal:
            raise EngineStateError(self.refusal)
        return ReferenceEngine.begin_weight_update(self, **kw)

    def end_weight_update(self, *, abort=False, weight_version=None):
        self.calls.append("abort" if abort else "commit")
        self._in_txn = False
        return True


def test_the_reference_engines_refusal_is_one_of_the_texts():
    with pytest.raises(EngineStateError) as info:
        ReferenceEngine.begin_weight_update(_RefStub(in_txn=True))
    assert str(info.value) in sessions.LEFT_OPEN and sessions.left_open(info.value)


@pytest.mark.parametrize("make", [
    lambda: _sglang_refusal(sessions.LEFT_OPEN[0]),
    # SGLang's data-parallel ranks' messages joined (one rank had it open)
    lambda: _sglang_refusal("Success | " + sessions.LEFT_OPEN[0]),
    lambda: EngineStateError(sessions.LEFT_OPEN[1]),
], ids=["sglang", "sglang-dp", "reference"])
def test_a_session_left_open_is_aborted_and_begun_again(make):
    e = _Engine(make())
    sessions.begin(e)
    assert e.calls == ["begin", "abort", "begin"]


@pytest.mark.parametrize("text", UNRELATED)
def test_an_unrelated_refusal_with_already_or_twice_is_raised_and_nothing_aborted(text):
    for exc in (EngineStateError(text), _sglang_refusal(text), RuntimeError(text)):
        e = _Engine(exc)
        with pytest.raises(type(exc)) as info:
            sessions.begin(e)
        assert info.value is exc and e.calls == ["begin"]


def test_through_fsdp_sync_serve_only_the_session_refusal_is_taken_over():
    """``fsdp-sync serve`` answers the reference engine's refusal as 400 and `SGLangEngine` raises
    it with its own wording around it: still taken over; an unrelated 400 is not."""
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.engines.reference.serve import EngineServer

    left = _RefStub(in_txn=True)
    with EngineServer(left) as srv:
        sessions.begin(sg.SGLangEngine(base_url=f"http://{srv.host}:{srv.port}"))
    assert left.calls == ["begin", "abort", "begin"] and left._in_txn

    other = _RefStub(in_txn=False, refusal=UNRELATED[1])
    with EngineServer(other) as srv:
        with pytest.raises(EngineStateError, match="already loaded"):
            sessions.begin(sg.SGLangEngine(base_url=f"http://{srv.host}:{srv.port}"))
    assert other.calls == ["begin"]
