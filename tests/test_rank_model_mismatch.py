"""Trainer ranks that hold different models (a buffer registered on one rank only, a parameter
shaped otherwise, one layer more) are refused before the export's first collective: the same
`SyncError` on every rank within seconds, naming the rank and the tensor with both shapes
(`weights.export_checks`). Before: FSDP2 with layout="full" blocked in the bucket loop until
the process group's timeout and each rank raised a different raw gloo error; FSDP1 (layout
"auto") SIGABRTed rank 0 inside torch's state-dict all-gather (gloo "collective mismatch").

Also here: `export.param_metas`, which the digest is made of, runs no collective (FSDP2, FSDP1),
and `topology.agree` compares digests in its one all-reduce, with or without errors.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_sync.cli.launch import run_ranks, spawn_env

PG_TIMEOUT_S = 30
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "gather",
               "all_gather_object", "broadcast_object_list", "gather_object", "reduce_scatter_tensor",
               "barrier", "send", "recv", "isend", "irecv")


def _model(rank: int, what: str, fsdp: str):
    from fsdp_sync.models import build_model, load_config

    cfg = load_config("tiny", num_hidden_layers=3) if what == "layers" and rank == 1 else load_config("tiny")
    model = build_model(cfg, seed=0)
    if rank == 1:
        if what == "buffer":
            model.model.register_buffer("extra_buf", torch.zeros(4))
        elif what == "param":
            model.model.extra = torch.nn.Linear(8, 8, bias=False)
        elif what == "shape":
            model.model.norm.weight = torch.nn.Parameter(torch.ones(72))
    from fsdp_sync.cli.trainer import wrap_fsdp

    model = wrap_fsdp(model, int(fsdp))
    return model


def _collectives_in_param_metas(model) -> int:
    """How many torch.distributed collectives `export.param_metas` runs (memo cleared first)."""
    from fsdp_sync.weights import export

    calls = []
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    try:
        for n, f in saved.items():
            setattr(dist, n, lambda *a, _n=n, _f=f, **k: (calls.append(_n), _f(*a, **k))[1])
        export._METAS.pop(model, None)
        export.param_metas(model)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return len(calls)


def _mismatched_syncs(rank: int, world: int, fsdp: str, layout: str, cases: list[str]) -> dict:
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import load_config

    torch.set_num_threads(1)
    mesh = make_mesh(1, world)
    engine = ReferenceEngine(model_config=load_config("tiny"), tp_size=world, device="cpu") if rank == 0 else None
    out: dict = {}
    try:
        for what in cases:
            model = _model(rank, what, fsdp)
            out[f"{what}_param_metas_collectives"] = _collectives_in_param_metas(model)
            manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
                method="tensor", layout=layout, memory_probe="off"))
            t0 = time.monotonic()
            try:
                with manager:
                    pass
                out[what] = "synced"
            except SyncError as exc:
                out[what] = f"SyncError: {exc}"
            except Exception as exc:  # noqa: BLE001 - the test says which
                out[what] = f"{type(exc).__name__}: {exc}"
            finally:
                out[f"{what}_s"] = time.monotonic() - t0
                manager.close()
    finally:
        if engine is not None:
            engine.shutdown()
    return out


def _check(res: list[dict], cases: dict[str, tuple[str, ...]]) -> None:
    assert len(res) == 2
    for what, words in cases.items():
        a, b = res[0][what], res[1][what]
        assert a == b, (what, a, b)          # the same error on both ranks
        assert a.startswith("SyncError: weight sync failed: the trainer ranks hold different models"), a
        assert "rank 1" in a, a
        for w in words:
            assert w in a, (w, a)
        for r in res:
            assert r[f"{what}_s"] < 10, (what, r[f"{what}_s"])   # not the 30 s group timeout
            assert r[f"{what}_param_metas_collectives"] == 0, r


@pytest.mark.timeout(100)
def test_fsdp2_ranks_with_different_models_are_refused_naming_rank_and_tensor():
    """Before: blocked until the 30 s group timeout, then a raw gloo error, another on each rank."""
    res = run_ranks(_mismatched_syncs, 2, "2", "full", ["buffer", "shape", "layers"],
                    timeout_s=90, pg_timeout_s=PG_TIMEOUT_S, env=spawn_env())
    _check(res, {
        "buffer": ("'model.extra_buf' (float32 (4,)) is only on rank 1, not on rank 0",),
        "shape": ("'model.norm.weight' is float32 (72,) on rank 1, float32 (64,) on rank 0",),
        "layers": ("'model.layers.2.", "is only on rank 1"),
    })


@pytest.mark.timeout(100)
def test_fsdp1_ranks_with_different_models_are_refused_naming_rank_and_tensor():
    """Before: rank 0 SIGABRTed in torch's state-dict all-gather (gloo collective mismatch)."""
    res = run_ranks(_mismatched_syncs, 2, "1", "auto", ["param", "shape"],
                    timeout_s=90, pg_timeout_s=PG_TIMEOUT_S, env=spawn_env())
    _check(res, {
        "param": ("'model.extra.weight' (float32 (8, 8)) is only on rank 1, not on rank 0",),
        "shape": ("'model.norm.weight' is float32 (72,) on rank 1, float32 (64,) on rank 0",),
    })


def _agree_digests(rank: int, world: int) -> dict:
    from fsdp_sync.topology import RanksDiffer, SyncError, agree

    out = {}
    for case, err, digest in (("same", None, 7), ("same+error", "boom" if rank else None, 7),
                              ("differ", None, 7 + rank), ("differ+error", None if rank else "boom", 7 + rank),
                              ("top digest", None, (1 << 62) - 1 - rank),
                              # rank 0 failed entering the stage: its own agree (no digest) meets
                              # rank 1's digest agree (the same all-reduce, `manager._run`)
                              ("failed at entry", None if rank else "boom", rank or None)):
        try:
            agree(err, what=case, digest=digest)
            out[case] = "agreed"
        except RanksDiffer as exc:
            out[case] = f"RanksDiffer, error: {exc.error}"
        except SyncError as exc:
            out[case] = f"SyncError: {exc}"
    return out


@pytest.mark.timeout(60)
def test_agree_compares_digests_in_its_all_reduce_errors_or_not():
    zero, one = run_ranks(_agree_digests, 2, timeout_s=50, pg_timeout_s=PG_TIMEOUT_S, env=spawn_env())
    assert zero == one, (zero, one)
    assert zero == {
        "same": "agreed",
        "same+error": "SyncError: same+error failed on rank 1: boom",
        "differ": "RanksDiffer, error: None",
        "differ+error": "RanksDiffer, error: differ+error failed on rank 0: boom",
        "top digest": "RanksDiffer, error: None",
        "failed at entry": "SyncError: failed at entry failed on rank 0: boom",
    }, zero
