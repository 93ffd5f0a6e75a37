"""Parameters SGLang keeps in float32 (`weights.float32_params`: ``e_score_correction_bias``,
``A_log``, ...) leave the export in float32 under a bfloat16 rollout dtype, bit for bit, in
`param_metas`, `iter_params` and `iter_buckets`, plain and FSDP2 (2 ranks); every other floating
tensor is cast as before (verl3 audit, item 2: they were cast to the rollout dtype, 8 distinct
correction-bias values became 2 and the top-k routing order changed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.weights import bucket, export

pytestmark = pytest.mark.timeout(120)

BF16 = torch.bfloat16
KEPT = ("model.layers.0.mlp.gate.e_score_correction_bias", "model.layers.0.linear_attn.A_log")


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        # GLM's correction bias: an offset with a spread of a few bf16 steps
        self.e_score_correction_bias = nn.Parameter(30.0 + torch.rand(8) * 0.2)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = _Gate()
        self.linear_attn = nn.Module()
        self.linear_attn.A_log = nn.Parameter(torch.randn(16))
        self.proj = nn.Linear(16, 16)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer()])


def _check(named: dict, ref: dict) -> None:
    for name, t in ref.items():
        got = named[name]
        if name in KEPT:
            assert got.dtype == torch.float32 and torch.equal(got, t), name
        else:
            assert got.dtype == BF16 and torch.equal(got, t.to(BF16)), name


def test_sglangs_float32_parameters_leave_a_plain_modules_export_in_float32():
    m = _Model()
    ref = {n: t.detach().clone() for n, t in m.state_dict().items()}
    metas = {x.name: x.dtype for x in export.param_metas(m, BF16)}
    assert {n for n, d in metas.items() if d == torch.float32} == set(KEPT), metas
    _check(dict(export.iter_params(m, dtype=BF16)), ref)
    named = {}
    for bkt, flat in export.iter_buckets(m, 1 << 20, dtype=BF16):
        named.update((n, t.clone()) for n, t in bucket.unflatten(flat, bkt.entries))
    _check(named, ref)
    # the rule by itself: float32 only, by the name's last part
    from fsdp_sync.weights import float32_params

    assert float32_params.out_dtype("x.A_log", torch.float32, BF16) == torch.float32
    assert float32_params.out_dtype("x.A_log", torch.float16, BF16) == BF16
    assert float32_params.out_dtype("x.A_log_other", torch.float32, BF16) == BF16
    assert float32_params.out_dtype("x.weight", torch.float32, None) == torch.float32


def fsdp2_rank(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    m = _Model()
    ref = {n: t.detach().clone() for n, t in m.state_dict().items()}
    fully_shard(m)
    metas = {x.name: str(x.dtype) for x in export.param_metas(m, BF16)}
    params = {n: t.clone() for n, t in export.iter_params(m, dtype=BF16)}
    buckets = {}
    for bkt, flat in export.iter_buckets(m, 1 << 20, dtype=BF16):
        buckets.update((n, t.clone()) for n, t in bucket.unflatten(flat, bkt.entries))
    return {"ref": ref, "metas": metas, "params": params, "buckets": buckets}


@pytest.fixture(scope="module")
def fsdp2():
    return run_ranks(fsdp2_rank, 2, env=spawn_env(), timeout_s=100)


def test_sglangs_float32_parameters_leave_an_fsdp2_export_in_float32(fsdp2):
    for out in fsdp2:
        assert {n for n, d in out["metas"].items() if d == "torch.float32"} == set(KEPT), out["metas"]
        _check(out["params"], out["ref"])


def test_an_fsdp2_bucket_mixing_float32_and_bf16_gathers_exactly_over_gloo(fsdp2):
    """A bucket's entries of several dtypes go in one coalesced all-gather, as bytes: gathered in
    their own dtypes, gloo interleaved zeros into the bf16 entry beside the float32 one."""
    for out in fsdp2:
        _check(out["buckets"], out["ref"])
