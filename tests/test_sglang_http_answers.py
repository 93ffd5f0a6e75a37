"""How the SGLang adapter reads an HTTP answer to a weight update: what says SGLang certainly
opened none of the payloads (their shared-memory references are then given back), and what is
not SGLang's answer at all. Against `fake_sglang.FakeSGLangServer` with scripted answers.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

from fsdp_sync.engines import sglang as sg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang as fake  # noqa: E402

mixed_tensors = fake.mixed_tensors


def http_engine(server, **kw) -> sg.SGLangEngine:
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("timeout_s", 10)
    return sg.SGLangEngine(base_url=server.url, **kw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [404, 405, 422])
def test_http_update_refused_before_any_handler_gives_the_segments_back(status):
    """An update answered 404 (a URL without the route: sglang_router's, say), 405 or 422 (the
    request model's validation, before the handler) opened nothing. Before: only 401/403/411/413
    and the no-session message said so; a 404 left ``opened`` None, the payloads' references were
    kept, and the bucket's /dev/shm segment outlived the process (4 MiB a bucket, audit
    ``shm_404``). Now ``opened`` is False and both paths give them back: the flattened bucket
    (`BucketPayloads`) and named tensors (`lease_answered`)."""
    mine = f"torch_{os.getpid()}_"
    body = {404: "Not Found", 405: '{"detail": "Method Not Allowed"}',
            422: '{"detail": [{"type": "missing", "loc": ["body", "serialized_named_tensors"]}]}'}[status]
    with fake.FakeSGLangServer(tp_size=2) as srv:
        a = http_engine(srv)
        a.begin_weight_update()
        before = {x for x in os.listdir("/dev/shm") if x.startswith(mine)}
        srv.script["/update_weights_from_tensor"] = [(status, body)] * 2
        with pytest.raises(sg.SGLangUpdateError, match=f"HTTP {status}") as bucket:
            a.update_weights_from_bucket(mixed_tensors())
        with pytest.raises(sg.SGLangUpdateError, match=f"HTTP {status}") as named:
            a.update_weights_from_tensor(mixed_tensors())
        gc.collect()
        left = {x for x in os.listdir("/dev/shm") if x.startswith(mine)} - before
        assert srv.hits["/update_weights_from_tensor"] == 2 and srv.engine.opened_payloads == 0
    assert bucket.value.opened is False and named.value.opened is False
    assert bucket.value.status == status and not left, left


@pytest.mark.timeout(30)
def test_http_update_answered_without_success_is_not_taken_as_loaded(tmp_path):
    """Before: a 2xx answer without ``success`` (another server at the URL: ``{"ok": true}``, an
    empty body) passed an update as loaded. SGLang (0.5.12 to 0.5.23) and ``fsdp-sync serve``
    always answer ``{success, message}``: now the tensor, disk and distributed updates over HTTP
    raise, saying whether anything was loaded is unknown."""
    with fake.FakeSGLangServer(tp_size=1) as srv:
        a = http_engine(srv, tp_size=1)
        a.begin_weight_update()
        srv.script["/update_weights_from_tensor"] = [(200, '{"ok": true}'), (200, "")]
        for _ in range(2):
            payloads = sg.flattened_bucket_payloads(mixed_tensors()[:1], 1, output_str=True)
            with pytest.raises(sg.SGLangUpdateError, match="not SGLang's {success, message}") as ei:
                a.update_weights_from_tensor(payloads, load_format="flattened_bucket")
            assert ei.value.opened is None            # unknown to the adapter
            payloads.release(unopened=True)           # here we know: the answer was scripted
        srv.script["/update_weights_from_disk"] = [(200, '"done"')]
        with pytest.raises(sg.SGLangUpdateError, match="not SGLang's"):
            a.update_weights_from_disk(str(tmp_path))
        srv.script["/update_weights_from_distributed"] = [(200, "{}")]
        with pytest.raises(sg.SGLangUpdateError, match="not SGLang's"):
            a.update_weights_from_distributed(["w"], ["float32"], [[1]], "g")
        a.update_weights_from_bucket(mixed_tensors()[:1])        # SGLang's own answer: loaded
