"""H64: `SGLangEngine`'s reads and cache flush, in process and over HTTP, against the fake of SGLang
0.5.23: ``get_weights_by_name`` with no ``truncate_size`` is the whole parameter (SGLang's own
default is 100 rows, which `verify` would read as a difference, or as agreement on a prefix), and
a flush SGLang refused (requests still running) raises with SGLang's message and the call's name.
Also: flattened-bucket payloads are one per TP rank, no more and no fewer, refused before sending."""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError

pytestmark = pytest.mark.timeout(60)


def check(a, eng):
    w = torch.arange(2 * 300, dtype=torch.float32).view(300, 2)
    eng.weights["w"] = w
    assert torch.equal(a.get_weights_by_name("w"), w)                  # all 300 rows
    assert torch.equal(a.get_weights_by_name("w", truncate_size=5), w[:5])
    eng.fail_next_flush = "Cache not flushed because there are pending requests."
    with pytest.raises(SGLangError) as err:
        a.flush_cache()
    assert "flush_cache" in str(err.value) and "pending requests" in str(err.value), err.value
    a.flush_cache()                                                    # then it flushes


def test_a_whole_parameter_is_read_and_a_refused_flush_raises_in_process_and_over_http():
    eng = fake.FakeSGLangEngine(tp_size=1)
    check(SGLangEngine(eng), eng)
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        check(SGLangEngine(base_url=srv.url, retry_backoff_s=0.01), srv.engine)


def test_flattened_bucket_payloads_other_than_one_per_tp_rank_are_refused_before_sending():
    eng = fake.FakeSGLangEngine(tp_size=2)
    a = SGLangEngine(eng, tp_size=2)
    for n in (1, 3):
        with pytest.raises(ValueError, match=f"expected 2 flattened-bucket payloads \\(one per TP rank\\), got {n}"):
            a.update_weights_from_tensor([b"x"] * n, load_format="flattened_bucket")
    assert not [c for c in eng.calls if c[0] == "update_weights_from_tensor"], eng.calls


def test_server_info_asks_the_newer_route_and_falls_back_to_the_old_one():
    """SGLang 0.5.23 deprecates /get_server_info for /server_info (a warning in its log at each
    call, and a sync asks every time): /server_info is asked, and a server without it (404) is
    still read through the old route (tp_size, release)."""
    import json

    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        assert a.tp_size == 1 and [p for _, p, _ in srv.requests] == ["/server_info"], srv.requests
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        srv.script["/server_info"] = [(404, json.dumps({"detail": "Not Found"}))] * 2
        srv.script["/get_server_info"] = [(200, json.dumps({"tp_size": 3, "version": "0.5.23"}))]
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        assert a.tp_size == 3 and a.sglang_version == "0.5.23"
        assert [p for _, p, _ in srv.requests] == ["/server_info", "/get_server_info"], srv.requests
