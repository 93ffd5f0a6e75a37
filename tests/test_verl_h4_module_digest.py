"""The manager's model digest on the verl path: ranks holding different models are refused by name
before fsdp_sync's module export runs a collective (`integrations.module_stream.agreed`).

The manager agrees a digest of what each rank would export (names, rollout dtypes, full shapes:
`weights.export_checks.agree_on_model`) before its export's collectives, because ranks holding
different models block in mismatched all-gathers (or gloo aborts the process) instead of failing.
Under verl, where fsdp_sync's export replaces verl's generator (`module_stream.calls`), each rank
compared its module only with its own verl stream; the ranks then only agreed that none refused.
Two ranks whose models differ both passed and went into fsdp_sync's export with different bucket
plans. Now the digest travels in that same all-reduce and every rank raises the same `SyncError`
naming the first rank and tensor that differ; nothing is gathered and verl's stream is not pulled.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import RankError, run_ranks, spawn_env


def _verl_style(module, pulled: list):
    from torch.distributed.tensor import DTensor

    for name, p in module.state_dict().items():
        pulled.append(name)
        yield name, p.full_tensor() if isinstance(p, DTensor) else p


def _differing_models(rank, world, share):
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.weights import gather

    torch.set_num_threads(1)
    # rank 1's MLP is wider: the same names, other shapes (FSDP2 shards each rank's alone)
    cfg = load_config("tiny", **({"intermediate_size": 96} if rank == 1 else {}))
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    topo = SyncTopology.from_mesh(make_mesh(1, 2))
    pulled: list = []
    stream = module_stream.ModuleStream(_verl_style(module, pulled), module)
    gathers = 0
    real = gather.all_gather

    def counting(*a, **k):
        nonlocal gathers
        gathers += 1
        return real(*a, **k)

    gather.all_gather = counting
    sync = SyncConfig(dtype=torch.float32, bucket_bytes=96 << 10, share_host_memory=share,
                      dist_timeout_s=30)

    def prepare(name, t):
        return t.detach().contiguous()

    try:
        steps = module_stream.calls(stream, sync, topo, SyncStats(), {"export_s": 0.0}, prepare)
        sent = [] if steps is None else [c.what for c in steps]      # drives the export
        return {"refused": None, "sent": sent, "gathers": gathers, "pulled": len(pulled)}
    except SyncError as exc:
        return {"refused": str(exc), "gathers": gathers, "pulled": len(pulled)}
    finally:
        gather.all_gather = real


@pytest.mark.timeout(150)
@pytest.mark.parametrize("share", [False, True])
def test_ranks_holding_different_models_are_refused_by_name_before_any_gather(share):
    try:
        results = run_ranks(_differing_models, 2, share, timeout_s=90, pg_timeout_s=20,
                            env=spawn_env())
    except RankError as exc:      # before: mismatched collectives (a gloo error or the timeout)
        pytest.fail(f"ranks holding different models were not refused: {str(exc)[-600:]}")
    r0, r1 = results
    assert r0["refused"] is not None and r0["refused"] == r1["refused"], (r0, r1)
    assert "the trainer ranks hold different models" in r0["refused"], r0
    assert "rank 1 differs from rank 0: 'model.layers.0.mlp.gate_proj.weight' is float32 " \
           "(96, 64) on rank 1, float32 (128, 64) on rank 0" in r0["refused"], r0
    assert r0["gathers"] == r1["gathers"] == 0 and r0["pulled"] == r1["pulled"] == 0


def test_the_digest_is_the_export_metas_and_equal_models_agree():
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    a = export.param_metas(build_model(load_config("tiny"), seed=0), torch.float32)
    b = export.param_metas(build_model(load_config("tiny"), seed=1), torch.float32)
    c = export.param_metas(build_model(load_config("tiny", intermediate_size=96), seed=0),
                           torch.float32)
    d = export.param_metas(build_model(load_config("tiny"), seed=0), torch.bfloat16)
    assert module_stream.model_digest(a) == module_stream.model_digest(b) != 0
    assert len({module_stream.model_digest(x) for x in (a, c, d)}) == 3
    assert module_stream.model_digest(None) == 0
    assert 0 < module_stream.model_digest(a) < 1 << 62
