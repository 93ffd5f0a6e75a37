"""The SGLang adapter against the release it talks to: 0.5.12 (verl 0.9.1's pin) beside 0.5.23.

The adapter reads the release from ``get_server_info``'s ``version`` and, from
`fsdp_sync.engines.sglang.versions`, skips the weight-update session 0.5.12 does not have (no
probe) and refuses by name what 0.5.12 would drop without a word (``skip_tensor_list`` on its
``/weights_checker``). The fakes answer as each release does (`fake_sglang`; `make test-sglang`
checks the table and the fakes' fields against the installed 0.5.12 and 0.5.23).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import versions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang as fake  # noqa: E402

mixed_tensors = fake.mixed_tensors


def test_feature_table_by_release():
    old, v20, v21, new = (versions.features(v) for v in ("0.5.12", "0.5.20", "0.5.21", "0.5.23"))
    assert (old.weight_update_session, v20.weight_update_session,
            v21.weight_update_session, new.weight_update_session) == (False, False, True, True)
    assert old.weights_checker_fields == ("action",)
    assert v20.weights_checker_fields == ("action", "allow_quant_error")
    assert "skip_tensor_list" in v21.weights_checker_fields == new.weights_checker_fields
    assert (old.lora_tensors_field, old.lora_tensors_per_rank) == ("serialized_tensors", False)
    assert (new.lora_tensors_field, new.lora_tensors_per_rank) == ("serialized_named_tensors", True)
    between = versions.features("0.5.15")             # not read: not guessed
    assert between.lora_tensors_field is None and between.lora_tensors_per_rank is None
    assert (old.distributed_bucket_prechecked, new.distributed_bucket_prechecked) == (False, True)
    # a flush fails on the requests a retract pause re-queued, and the scheduler dies of it: < 0.5.21
    assert [f.retract_kills_flush for f in (old, v20, v21, new)] == [True, True, False, False]
    assert not versions.features(None).retract_kills_flush
    assert "upgrade SGLang to >=0.5.21" in old.refuse_pause_mode("retract")
    assert old.refuse_pause_mode("abort") is None and old.refuse_pause_mode(None) is None
    assert new.refuse_pause_mode("retract") is None
    # /weights_checker at TP > 1: 0.5.12 answers TP rank 0 only; 0.5.20 on gather every rank
    assert [f.checker_every_tp_rank for f in (old, between, v20, new)] == [False, None, True, True]
    assert "upgrade SGLang to >=0.5.20" in old.refuse_verify("full", 2)
    assert old.refuse_verify("full", 1) is None and old.refuse_verify("off", 2) is None
    assert between.refuse_verify("sample", 4) is None and new.refuse_verify("full", 8) is None
    assert versions.parse("0.5.12.post1") == (0, 5, 12) and versions.parse("0.5.23rc0") == (0, 5, 23)
    assert versions.parse("dev") is None and versions.features(None).weight_update_session
    assert versions.reported({"version": "0.5.12"}) == "0.5.12"
    assert versions.reported({"tp_size": 2}) is None and versions.reported(None) is None


@pytest.mark.timeout(60)
def test_http_0512_has_no_session_and_takes_every_update_without_one():
    """Told 0.5.12 by its server info, the adapter sends no begin/end (not even a 404 probe); the
    tensor, bucket and distributed updates all land, as 0.5.12 takes them without a session."""
    named = mixed_tensors()
    with fake.FakeSGLangServer(tp_size=2, version="0.5.12") as srv:
        a = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        assert a.sglang_version == "0.5.12" and not a.features.weight_update_session
        for _ in range(2):
            a.begin_weight_update()
            a.update_weights_from_bucket(named[:3], flush_cache=False)
            a.update_weights_from_tensor(named[3:], load_format=None)
            a.init_weights_update_group("127.0.0.1", 29999, 1, 3, "g", "gloo")
            a.update_weights_from_distributed([named[0][0]], ["bfloat16"], [[3]], "g",
                                              flush_cache=False, load_format="flattened_bucket")
            a.destroy_weights_update_group("g")
            a.end_weight_update()
        hits = dict(srv.hits)
        weights = dict(srv.engine.weights)
    assert "/begin_weight_update" not in hits and "/end_weight_update" not in hits
    # once for tp_size, then once per sync's begin (its TP check: `check_tp_size`)
    assert hits["/server_info"] == 3 and hits["/update_weights_from_tensor"] == 4
    assert hits["/update_weights_from_distributed"] == 2
    assert a.session_api is False
    for name, t in named:
        assert torch.equal(weights[name], t), name


@pytest.mark.timeout(60)
def test_in_process_0512_engine_is_known_and_never_probed():
    eng = fake.Fake0512Engine(tp_size=1)
    a = sg.SGLangEngine(eng)                     # tp_size asked: the version comes with it
    a.begin_weight_update()
    a.update_weights_from_bucket(mixed_tensors()[:2])
    a.end_weight_update()
    assert a.sglang_version == "0.5.12" and a.session_api is False
    assert eng.names() == ["get_server_info", "update_weights_from_tensor"]


@pytest.mark.timeout(60)
def test_0523_server_still_gets_its_session():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        a = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        a.begin_weight_update()
        a.update_weights_from_bucket(mixed_tensors()[:2])
        a.end_weight_update()
        hits = dict(srv.hits)
    assert a.sglang_version == "0.5.23" and a.session_api is True
    assert hits["/begin_weight_update"] == 1 and hits["/end_weight_update"] == 1


@pytest.mark.timeout(60)
def test_0512_weights_checker_skip_list_refused_by_name_and_checksum_read():
    """0.5.12's checker drops ``skip_tensor_list`` silently: refused before sending, naming the
    release, the field and the upgrade. Its plain checksum answer (no per_engine_checksum, no
    role) reads like 0.5.23's, SGLang's hash of the tensors a rank holds, but for TP rank 0 only
    (the fake answered every rank before; the real 0.5.12 does not): read as such, the other
    rank is missing (`SyncConfig.verify` refuses this up front:
    `test_verify_against_0512_at_tp2_is_refused_before_anything_is_sent`)."""
    from fsdp_sync.engines.sglang.checksums import hex_hash, rank_reports

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with fake.FakeSGLangServer(tp_size=2, version="0.5.12") as srv:
        srv.engine.weights = {"model.norm.weight": w}
        a = sg.SGLangEngine(base_url=srv.url, tp_size=2, retry_backoff_s=0.01, timeout_s=10)
        with pytest.raises(sg.SGLangError, match=r"SGLang 0\.5\.12's /weights_checker takes only "
                                                 r"\['action'\] and drops \['skip_tensor_list'\].*"
                                                 r"upgrade SGLang to >=0\.5\.21"):
            a.weights_checker("checksum", skip_tensor_list=["rotary_emb"])
        assert "/weights_checker" not in srv.hits
        answer = a.weights_checker("checksum")
        sums = a.weight_checksums()
    assert "per_engine_checksum" not in answer
    assert [r["parallelism_info"]["tp_rank"] for r in answer["ranks"]] == [0]
    assert answer["ranks"][0]["checksums"]["model.norm.weight"] == hex_hash(w)
    with pytest.raises(ValueError, match=r"no checksums reported for TP ranks \[1\]"):
        rank_reports(answer, 2)
    assert sums["answer"] == answer and sums["algorithm"] == "cpu"


@pytest.mark.timeout(60)
def test_0523_weights_checker_takes_skip_list():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        srv.engine.weights = {"model.norm.weight": torch.ones(4)}
        a = sg.SGLangEngine(base_url=srv.url, tp_size=1, retry_backoff_s=0.01, timeout_s=10)
        a.weights_checker("checksum", skip_tensor_list=["rotary_emb"])
        assert srv.requests[-1][1:] == ("/weights_checker", {"action": "checksum",
                                                             "skip_tensor_list": ["rotary_emb"]})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("verify", ["full", "off"])
def test_verify_against_0512_at_tp2_is_refused_before_anything_is_sent(verify, tmp_path):
    """Before: SyncConfig.verify against SGLang 0.5.12 at TP 2 loaded every weight, then failed
    ("no checksums reported for TP ranks [1]"): 0.5.12's /weights_checker answers TP rank 0 only
    (and this fake answered every rank, so no test saw it). Now refused at the first sync before
    anything is written or sent, naming the release, the TP size, verify='off' and >=0.5.20;
    verify='off' syncs as before."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights.layout import layout_for

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    err = None
    with fake.FakeSGLangServer(tp_size=2, layout=layout_for(cfg, 2), version="0.5.12") as srv:
        manager = FSDPShardingManager(module, sg.SGLangEngine(base_url=srv.url, timeout_s=10),
                                      config=SyncConfig(method="disk", disk_dir=str(tmp_path),
                                                        verify=verify, memory_probe="off"))
        try:
            with manager:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            err = f"{type(exc).__name__}: {exc}"
        finally:
            manager.close()
        hits = dict(srv.hits)
    if verify == "off":
        assert err is None and manager.version == "0" and hits["/update_weights_from_disk"] == 1
        return
    assert err and "verify='full' against SGLang 0.5.12 with tp_size=2" in err, err
    assert "TP rank 0's checksums only" in err and "set SyncConfig.verify='off'" in err, err
    assert "upgrade SGLang to >=0.5.20" in err and f"SGLang at {srv.url}" in err, err
    assert "/update_weights_from_disk" not in hits and "/weights_checker" not in hits, hits
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("step_")], list(tmp_path.iterdir())
