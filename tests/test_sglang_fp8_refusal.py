"""Block FP8 of a Llama model into SGLang through SGLang's own ``load_weights`` is refused before
anything is written or sent.

SGLang 0.5.23's ``LlamaForCausalLM.load_weights`` renames every ``weight_scale_inv`` to
``weight_scale``, which block FP8 has no parameter for: every block scale was dropped without a
word (the sglang tier asserts the rename: ``tests/sglang_tier/test_sglang_fp8.py``). The disk
method, the distributed method and the tensor method's full tensors all go through that loader;
only the tensor method's per-rank buckets into fsdp_sync's custom loader load the scales. Every
one of those paths is refused here, naming the one that works; SGLang is `fake_sglang`'s (in
process and over HTTP), so this runs on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _module(model_type="llama"):
    from fsdp_sync.models import build_model, load_config

    return build_model(load_config("tiny-fp8", model_type=model_type), seed=7)


def _sglang(rank_bucket_loader=False):
    import fake_sglang as fake

    from fsdp_sync.engines import sglang as sg

    return sg.SGLangEngine(fake.FakeSGLangEngine(tp_size=1), rank_bucket_loader=rank_bucket_loader)


def _cfg(**kw):
    from fsdp_sync import SyncConfig

    if kw.get("method") == "disk":
        kw.setdefault("disk_dir", "/nonexistent")
    return SyncConfig(quantization="fp8", dtype=torch.float32, **kw)


REFUSED = [dict(method="disk", layout="full"), dict(method="disk", layout="auto"),
           dict(method="distributed"), dict(method="tensor", layout="full"),
           dict(method="tensor", layout="auto"),                          # no custom loader: full tensors
           dict(method="tensor", layout="auto", strategy="bucketed", loader=True)]    # full tensors too


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_every_path_through_sglangs_own_loader_is_refused(case):
    from fsdp_sync.config_check import check_engine

    case = dict(case)
    engine = _sglang(rank_bucket_loader=case.pop("loader", False))
    with pytest.raises(ValueError, match=r"weight_scale_inv.*layout='engine'.*--custom-weight-loader "
                                         r"fsdp_sync.engines.sglang.loader.load_rank_buckets"):
        check_engine(_module(), engine, _cfg(**case), None, where="trainer rank 0")


def test_what_loads_the_scales_is_not_refused(monkeypatch):
    from fsdp_sync.config_check import check_engine, load_refusal

    # per-rank buckets into fsdp_sync's loader (by engine name: no rename)
    for layout in ("engine", "auto"):
        check_engine(_module(), _sglang(rank_bucket_loader=True), _cfg(method="tensor", layout=layout),
                     None, where="")
    # another family (SGLang's Qwen2 loader keeps the name), or no quantization
    assert load_refusal(_module("qwen2"), _sglang(), _cfg(method="disk")) is None
    from fsdp_sync import SyncConfig
    assert load_refusal(_module(), _sglang(), SyncConfig(method="disk", disk_dir="/x")) is None
    # `fsdp-sync serve` behind SGLang's API (the reference engine) loads them
    engine = _sglang()
    monkeypatch.setattr(type(engine), "serves_tensor_checksums", lambda self: True)
    assert load_refusal(_module(), engine, _cfg(method="disk")) is None


def test_disk_fp8_llama_into_an_sglang_server_writes_and_sends_nothing(tmp_path):
    """The audit's case: the manager accepted it and SGLang dropped every scale. Now every rank
    fails the sync before a byte is written, and the server is sent nothing; the transport alone
    (no manager) refuses it as well, leaving nothing under disk_dir."""
    import fake_sglang as fake

    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    d = tmp_path / "ck"
    cfg = SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32, quantization="fp8",
                     layout="full", free_cache_engine=False)
    module = _module()
    with fake.FakeSGLangServer(tp_size=1) as srv:
        engine = sg.SGLangEngine(base_url=srv.url, tp_size=1, timeout_s=10)
        manager = FSDPShardingManager(module, [engine], config=cfg)
        try:
            with pytest.raises(SyncError, match="weight_scale_inv"):
                with manager:
                    pass
        finally:
            manager.close()
        assert not os.path.exists(d) or os.listdir(d) == []
        t = DiskTransport(cfg)
        try:
            with pytest.raises(SyncError, match="weight_scale_inv"):
                t.sync(SyncContext(module=module, config=cfg, topo=None, group=None,
                                   engines=[engine], step=0, stats=SyncStats()))
        finally:
            t.close()
        assert os.listdir(d) == []
        assert not any(p.startswith("/update_weights") for _, p, _ in srv.requests), srv.requests
