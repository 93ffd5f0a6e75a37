"""An SGLang server restarted between syncs at the same URL with another ``--tp-size``.

`SGLangEngine.tp_size` is read once, when the adapter is made, and the manager checks it against the
mesh's infer-TP size before the first sync only. Before, the next sync sent one payload per old TP
rank: real SGLang's TP rank i opens ``payloads[i]`` without checking their count, so a larger TP
failed inside its workers (an IndexError that ends the server) and a smaller one was sent old-TP
payloads. Now ``begin_weight_update`` asks the server's TP size every sync (over HTTP) and refuses,
before anything is sent, naming both sizes and what to do."""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake


def _step(eng, tensors) -> None:
    """One sync's calls on infer-TP rank 0, as `TensorTransport` makes them: the bracket first."""
    eng.begin_weight_update()
    try:
        eng.update_weights_from_bucket(tensors)
    except BaseException:
        eng.end_weight_update(abort=True)
        raise
    eng.end_weight_update()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", [None, "0.5.12"])
def test_a_server_restarted_with_another_tp_size_is_refused_before_anything_is_sent(version):
    from fsdp_sync.engines import sglang as sg

    first = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
    second = [("w", torch.full((2, 3), 7.0))]
    with fake.FakeSGLangServer(tp_size=1, version=version) as srv:
        eng = sg.SGLangEngine(base_url=srv.url)
        try:
            _step(eng, first)
            assert torch.equal(srv.engine.weights["w"], first[0][1])
            updates = srv.hits["/update_weights_from_tensor"]
            begins = srv.hits.get("/begin_weight_update", 0)
            srv.engine.tp_size = 2            # restarted at the same URL with --tp-size 2
            with pytest.raises(sg.SGLangError) as info:
                _step(eng, second)
            msg = str(info.value)
            assert "now runs tp_size=2" in msg and "made for tp_size=1" in msg, msg
            assert "--tp-size 1" in msg and "infer_tp=2" in msg and "nothing was sent" in msg, msg
            assert srv.hits["/update_weights_from_tensor"] == updates      # not one byte
            assert srv.hits.get("/begin_weight_update", 0) == begins        # no session opened
            assert torch.equal(srv.engine.weights["w"], first[0][1])       # old weights whole
            srv.engine.tp_size = 1            # restarted again as it was: the sync goes through
            _step(eng, second)
            assert torch.equal(srv.engine.weights["w"], second[0][1])
        finally:
            eng.shutdown()


def test_a_given_tp_size_the_server_does_not_run_is_refused_at_the_first_begin():
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=2, version="0.5.12") as srv:     # no session routes
        eng = sg.SGLangEngine(base_url=srv.url, tp_size=1)
        with pytest.raises(sg.SGLangError, match=r"now runs tp_size=2, but this SGLangEngine was made "
                                                 r"for tp_size=1"):
            eng.begin_weight_update()
        eng.shutdown()


QUANT_CASES = [
    ("fp8", None, True),            # --quantization fp8, the sync sends unquantized weights
    ("awq", "fp8", True),           # another format than the sync's block FP8
    ("fp8", "fp8", False),
    (None, "fp8", False),           # None: also an FP8 checkpoint's own quantization_config
]


def test_a_server_launched_with_another_quantization_is_refused_before_the_first_sync():
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.config_check import check_engine
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=1) as srv:
        info = srv.engine.get_server_info
        for launched, want, refused in QUANT_CASES:
            srv.engine.get_server_info = lambda q=launched: {**info(), "quantization": q}
            eng = sg.SGLangEngine(base_url=srv.url)
            cfg = SyncConfig(method="tensor", quantization=want)
            try:
                if refused:
                    with pytest.raises(ValueError, match=rf"the engine serves quantization='{launched}' "
                                                         rf"but SyncConfig.quantization={want!r}"):
                        check_engine(torch.nn.Linear(2, 2), eng, cfg, None, where="trainer rank 0")
                else:
                    check_engine(torch.nn.Linear(2, 2), eng, cfg, None, where="trainer rank 0")
            finally:
                eng.shutdown()
        assert srv.hits.get("/update_weights_from_tensor", 0) == 0


def test_rank_bucket_loader_is_believed_only_where_the_server_registered_it(caplog):
    """``rank_bucket_loader=True`` against a server launched without ``--custom-weight-loader
    fsdp_sync...load_rank_buckets``: SGLang meets the first per-rank bucket with
    NotImplementedError('Unknown load_format') in its scheduler. Its launch arguments say so, so
    the adapter takes no per-rank bucket (layout 'auto' sends full tensors), warning by name."""
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.engines.sglang.loader import LOADER
    from fsdp_sync.weights.bucket import Bucket, BucketEntry

    with fake.FakeSGLangServer(tp_size=1) as srv:
        info = srv.engine.get_server_info
        for loaders in ([], ["other.module.loader"], None, "registered"):
            launched = [LOADER] if loaders == "registered" else loaders
            srv.engine.get_server_info = lambda v=launched: {**info(), "custom_weight_loader": v}
            caplog.clear()
            eng = sg.SGLangEngine(base_url=srv.url, rank_bucket_loader=True)
            try:
                believed = loaders is None or loaders == "registered"
                assert eng.accepts_rank_buckets is believed, loaders
                if not believed:
                    assert "--custom-weight-loader" in caplog.text and LOADER in caplog.text
                    bucket = Bucket((BucketEntry("w", torch.float32, (2,), 0, 8),), 8)
                    with pytest.raises(sg.SGLangError, match="--custom-weight-loader"):
                        eng.load_rank_bucket(bucket, [b"x"])
                    assert srv.hits.get("/update_weights_from_tensor", 0) == 0
            finally:
                eng.shutdown()


DTYPE_CASES = [("float16", torch.bfloat16, True), ("half", torch.bfloat16, True),
               ("bfloat16", torch.float32, True), ("bfloat16", torch.bfloat16, False),
               ("auto", torch.float16, False), ("float16", None, False)]


def test_a_sync_dtype_other_than_the_servers_dtype_is_refused_naming_both():
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=1) as srv:
        info = srv.engine.get_server_info
        for launched, sent, refused in DTYPE_CASES:
            srv.engine.get_server_info = lambda d=launched: {**info(), "dtype": d}
            eng = sg.SGLangEngine(base_url=srv.url)
            try:
                why = eng.sync_refusal(dtype=sent)
                if refused:
                    assert f"--dtype {launched}" in why and f"SyncConfig.dtype={sent}" in why, why
                    assert srv.url in why, why
                else:
                    assert why is None, (launched, sent, why)
            finally:
                eng.shutdown()


def test_a_server_restarted_with_another_release_is_refused_before_anything_is_sent():
    """Made against 0.5.12 (no session: none is begun), the server restarted as 0.5.23 (updates
    refused outside a session): the wrapper's release facts are stale, so the next begin refuses."""
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=1, version="0.5.12") as srv:
        eng = sg.SGLangEngine(base_url=srv.url)
        try:
            _step(eng, [("w", torch.ones(2))])
            srv.engine.VERSION = "0.5.23"
            updates = srv.hits["/update_weights_from_tensor"]
            with pytest.raises(sg.SGLangError, match=r"now reports release 0\.5\.23, but this "
                                                     r"SGLangEngine was made against 0\.5\.12"):
                _step(eng, [("w", torch.zeros(2))])
            assert srv.hits["/update_weights_from_tensor"] == updates
        finally:
            eng.shutdown()


def test_the_per_sync_tp_check_of_a_dead_server_is_one_attempt():
    """A server gone (a dead replica) fails begin at once, as its begin POST did before the check:
    the check's GET is not retried with the client's backoff at every sync."""
    from fsdp_sync.engines import sglang as sg

    srv = fake.FakeSGLangServer(tp_size=1).__enter__()
    eng = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
    srv.close()
    before = eng.http_attempts["/server_info"]
    with pytest.raises(sg.SGLangError, match="no answer"):
        eng.begin_weight_update()
    assert eng.http_attempts["/server_info"] == before + 1
    eng.shutdown()


@pytest.mark.parametrize("saver", [True, False])
def test_an_update_into_weights_sglangs_memory_saver_released_is_refused(saver):
    from fsdp_sync.engines import sglang as sg

    with fake.FakeSGLangServer(tp_size=1) as srv:
        info = srv.engine.get_server_info
        srv.engine.get_server_info = lambda: {**info(), "enable_memory_saver": saver}
        eng = sg.SGLangEngine(base_url=srv.url)
        try:
            eng.release_memory_occupation(["kv_cache", "weights"])
            if saver:
                with pytest.raises(sg.SGLangError, match=r"released its weights.*resume_memory_occupation"):
                    _step(eng, [("w", torch.ones(2))])
                assert srv.hits.get("/update_weights_from_tensor", 0) == 0
                assert srv.hits.get("/begin_weight_update", 0) == 0
            else:     # no memory saver: nothing was paused, the update lands
                _step(eng, [("w", torch.ones(2))])
            eng.resume_memory_occupation(["weights"])
            _step(eng, [("w", torch.full((2,), 3.0))])
            assert torch.equal(srv.engine.weights["w"], torch.full((2,), 3.0))
        finally:
            eng.shutdown()
