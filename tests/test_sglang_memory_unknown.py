"""A memory call whose outcome is unknown (it may have been applied: a timeout, a 5xx, an
interrupt) leaves SGLang's released tags unknown. Sending the next call as if it had failed
cleanly resumed a tag SGLang held (its scheduler's ``set.remove`` raises: a real server quits)
or skipped resuming weights SGLang had released; every later memory call of that engine is
refused now, naming the call. A call SGLang certainly did not run (a 4xx) changes nothing."""

from __future__ import annotations

import os
import sys

import pytest

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang.client import SGLangHTTPError
from fsdp_sync.engines.sglang.memory_calls import _unapplied

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang  # noqa: E402


def _engine(**kw):
    eng = fake_sglang.FakeSGLangEngine(tp_size=1)
    return eng, sg.SGLangEngine(eng, tp_size=1, **kw)


def _applied_then(eng, call: str, exc: BaseException):
    """Make the fake's ``call`` apply its tags, then raise ``exc`` (the answer lost); returns the
    real method, to put back."""
    real = getattr(eng, call)

    def applied(tags=None):
        real(tags)
        raise exc

    setattr(eng, call, applied)
    return real


def test_a_resume_applied_without_an_answer_refuses_the_next_memory_call():
    eng, a = _engine()
    a.release_memory_occupation(["kv_cache", "weights"])
    real = _applied_then(eng, "resume_memory_occupation", TimeoutError("timed out"))
    with pytest.raises(Exception, match="timed out"):
        a.resume_memory_occupation(["weights"])
    eng.resume_memory_occupation = real
    with pytest.raises(sg.SGLangError, match=r"resume_memory_occupation.* refused: an earlier "
                                             r"resume_memory_occupation\(tags=\['weights'\]\) failed without "
                                             r"saying it changed nothing .*restart the SGLang server"):
        a.resume_memory_occupation(["weights", "kv_cache"])
    assert eng.offload_tags == {"kv_cache"}     # nothing more sent: SGLang holds its weights


def test_a_release_applied_without_an_answer_refuses_the_next_memory_call():
    eng, a = _engine()
    _applied_then(eng, "release_memory_occupation", ConnectionResetError("reset by peer"))
    with pytest.raises(Exception, match="reset by peer"):
        a.release_memory_occupation(["weights"])
    with pytest.raises(sg.SGLangError, match=r"an earlier release_memory_occupation\(tags=\['weights'\]\)"):
        a.resume_memory_occupation(["weights"])
    assert eng.offload_tags == {"weights"}


def test_what_sglang_certainly_did_not_run_leaves_the_engine_usable():
    refused = SGLangHTTPError("POST /release_memory_occupation: HTTP 422", call="release_memory_occupation",
                              status=422)
    assert _unapplied(refused)
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as e:
            raise SGLangHTTPError("no answer", call="resume_memory_occupation") from e
    except SGLangHTTPError as exc:
        assert _unapplied(exc)
    assert not _unapplied(SGLangHTTPError("HTTP 500", call="resume_memory_occupation", status=500))
    assert not _unapplied(TimeoutError("timed out")) and not _unapplied(KeyboardInterrupt())

    eng, a = _engine()
    real = eng.release_memory_occupation

    def refuses(tags=None):
        raise refused

    eng.release_memory_occupation = refuses
    with pytest.raises(SGLangHTTPError):
        a.release_memory_occupation(["kv_cache"])
    eng.release_memory_occupation = real
    a.release_memory_occupation(["kv_cache"])
    a.resume_memory_occupation(["kv_cache"])
    assert eng.offload_tags == set()


def test_without_track_memory_nothing_is_refused():
    """Another client also releases and resumes that SGLang (verl's replicas): its tags are not
    ours to keep, and the calls go as given."""
    eng, a = _engine(track_memory=False)
    _applied_then(eng, "release_memory_occupation", TimeoutError("timed out"))
    with pytest.raises(Exception, match="timed out"):
        a.release_memory_occupation(["weights"])
    a.resume_memory_occupation(["weights"])
    assert eng.offload_tags == set()
