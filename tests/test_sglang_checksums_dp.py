"""SGLang's ``/weights_checker`` with data parallelism: one entry per (DP rank, TP rank), each DP
replica a full copy of the model. Every replica's hashes are compared, so a parameter wrong on
DP replica 1 only is named (the trainer's `Checker` and a streaming sender's `SentToSGLang`)."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.engines.sglang import checksums
from fsdp_sync.models import build_model, load_config
from fsdp_sync.verify import SentToSGLang
from fsdp_sync.weights import export
from fsdp_sync.weights.layout import layout_for

pytestmark = pytest.mark.timeout(60)

TP, DP = 2, 2
QKV = "model.layers.1.self_attn.qkv_proj.weight"


def _answer(full, layout):
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": TP, "dp_rank": d}}
             for d in range(DP) for r in range(TP)]
    for name, per_rank in checksums.expected_checksums(layout, full):
        for d in range(DP):
            for r, h in enumerate(per_rank):
                ranks[d * TP + r]["checksums"][name] = h
    return {"ranks": ranks}


def test_a_parameter_wrong_on_dp_replica_1_only_is_named():
    module = build_model(load_config("tiny"), seed=0)
    layout = layout_for(module.config, TP)
    full = list(export.iter_params(module))
    answer = _answer(full, layout)
    assert [len(v) for v in checksums.rank_reports(answer, TP).values()] == [DP] * TP

    def problems():
        c = checksums.Checker(layout, answer, algorithm="cpu")
        return [p for n, t in full for p in c.feed(n, t)] + c.finish()

    server = types.SimpleNamespace(server_info=lambda: {"device": "cpu"},
                                   weights_checker=lambda action: answer)

    def sent_check():
        sent = SentToSGLang(server, "full", 0, hf_config=module.config, tp_size=TP)
        for n, t in full:
            sent.add(n, t)
        return sent.check(server)[0]

    assert problems() == [] and sent_check() is None
    entry = next(e for e in answer["ranks"]
                 if e["parallelism_info"] == {"tp_rank": 1, "tp_size": TP, "dp_rank": 1})
    entry["checksums"][QKV] = "0" * 64                          # DP replica 1, TP rank 1
    said = f"{QKV!r} on TP rank 1 of DP replica 1: SGLang hashes {'0' * 64}"     # (it named no replica)
    got = problems()
    assert len(got) == 1 and got[0].startswith(said), got
    err = sent_check()
    assert err is not None and said in err and "more)" not in err, err
