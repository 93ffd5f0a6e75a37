"""`SGLangEngine`'s generation controls over HTTP against answers SGLang 0.5.23 gives (the fake):
``/health``'s 503 is a reason not to serve, any other error status is raised (not taken for
one); a pause or continue answered without ``status: ok`` is not taken as done."""

from __future__ import annotations

import json

import pytest

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError, SGLangHTTPError

pytestmark = pytest.mark.timeout(60)


def test_serving_state_reads_a_503_and_raises_any_other_error():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        assert a.serving_state is None
        srv.script["/health"] = [(503, json.dumps({"message": "out of service: draining"}))]
        assert a.serving_state == "out of service: draining"
        srv.script["/health"] = [(500, "Internal Server Error")]
        with pytest.raises(SGLangHTTPError) as err:
            a.serving_state
        assert err.value.status == 500
        assert a.serving_state is None


@pytest.mark.parametrize("call", ["pause_generation", "continue_generation"])
def test_a_pause_or_continue_answered_without_status_ok_raises(call):
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        srv.script[f"/{call}"] = [(200, json.dumps({"message": "Generation paused successfully.",
                                                     "status": "ok"})),
                                  (200, json.dumps({"message": "not SGLang"}))]
        getattr(a, call)()
        with pytest.raises(SGLangError, match="not status ok"):
            getattr(a, call)()
