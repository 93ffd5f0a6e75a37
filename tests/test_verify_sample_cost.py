"""verify="sample" under FSDP1 with ``fsdp1_state_dict="full"`` (the default) gathers only the
chosen tensors, from the flat shards, not the whole model through the full state dict (before:
as many bytes as verify="full"), and still catches a corrupted tensor among them."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.verify import select, verify_engines

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 1)
    engine = ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) if rank == 0 else None
    count = [0]
    names = ("all_gather_into_tensor", "all_gather", "_all_gather_base")
    real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(f):
        def g(*a, **k):
            t = a[0]
            count[0] += sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
            return f(*a, **k)
        return g

    out: dict = {}
    try:
        from fsdp_sync.weights import export
        full = dict(export.iter_params(module, dtype=torch.float32))       # collective
        if engine is not None:
            engine.update_weights_from_tensor(list(full.items()))
        for mode in ("full", "sample"):
            for n, f in real.items():
                setattr(dist, n, counting(f))
                setattr(c10d, n, counting(f))
            count[0] = 0
            try:
                err, _ = verify_engines(module, SyncConfig(verify=mode, dtype=torch.float32),
                                        [engine] if engine is not None else [], 0)
            finally:
                for n, f in real.items():
                    setattr(dist, n, f)
                    setattr(c10d, n, f)
            out[mode] = (err, count[0])
        wrong = select(list(full), "sample", 0)[0]
        if engine is not None:
            bad = full[wrong].clone()
            bad.view(-1)[0] += 1.0
            engine.update_weights_from_tensor([(wrong, bad)])
        err, _ = verify_engines(module, SyncConfig(verify="sample", dtype=torch.float32),
                                [engine] if engine is not None else [], 0)
        out["bad"] = (err, wrong)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(120)
def test_fsdp1_sample_gathers_only_the_chosen_tensors():
    results = run_ranks(_job, 2, timeout_s=110, env=spawn_env())
    for res in results:
        assert res["full"][0] is None and res["sample"][0] is None, res
        full_bytes, sample_bytes = res["full"][1], res["sample"][1]
        assert sample_bytes < full_bytes / 2, (sample_bytes, full_bytes)
    err, wrong = results[0]["bad"]      # the engine's rank (the manager agrees it over the ranks)
    assert err is not None and wrong in err, err
