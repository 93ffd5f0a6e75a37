"""`SyncConfig(lora="adapter")` on a hybrid-sharded trainer with both dimensions > 1 (4 ranks: 2
replicas x 2 shards, as verl's ``fsdp_size`` makes it): a peft-shaped LoRA model
(`fsdp_sync.cli.lora_model.add_lora`, float32, r 4) wrapped by `_hybrid.wrap_2x2` (its decoder
layers under ``base_model.model``): FSDP2 HSDP
(``fully_shard`` on each decoder layer and the root over a 2 x 2 ``("dp_replicate", "dp_shard")``
mesh), FSDP1 ``HYBRID_SHARD`` over ``process_group=(shard_group, replicate_group)`` (state dict
"sharded" and the default "full") and over a 2 x 2 ``device_mesh`` ("sharded"); FSDP2 and the tuple
form also with shard groups {0, 2}, {1, 3} across the engines' TP groups {0, 1}, {2, 3}. Each syncs
by the tensor method into reference engines of TP 2 on ranks 0 and 2 (``make_mesh(2, 2)``): the
base once, then only the adapter (lora_A and lora_B of 7 modules x 2 layers), three syncs with the
adapter changed identically on both replicas between them. After each sync both engines serve the
trainer's adapter bit for bit (`lora_tensors` against the export and against an unsharded copy
changed the same way) over the trainer's base (`weights_checksum`), the same records on every rank.
("local" with LoRA is refused as without it: test_h93_hybrid_2x2.py.) One 4-rank job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

sys.path.insert(0, str(Path(__file__).parent))
from _hybrid import wrap_2x2  # noqa: E402

CASES = [   # (wrapping, SyncConfig.fsdp1_state_dict (None: the default), shard groups {0, 2}, {1, 3})
    ("fsdp2", None, False), ("fsdp2", None, True), ("fsdp1-groups", "sharded", False),
    ("fsdp1-groups", None, False), ("fsdp1-groups", "sharded", True), ("fsdp1-mesh", "sharded", False)]
SYNCS = 3


def _lora(cfg, seed):
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.models import build_model

    return add_lora(build_model(cfg, seed=seed), r=4, alpha=8, seed=seed + 1)


def _local_lora(model):
    """This rank's pieces of the LoRA parameters (FSDP2: the local shard; FSDP1: the views)."""
    return [getattr(p, "to_local", lambda: p)() for n, p in model.named_parameters() if ".lora_" in n]


def _job(rank: int, world: int) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, make_mesh
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.models import load_config
    from fsdp_sync.topology import SyncTopology
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    mesh = make_mesh(2, 2)
    holder = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32,
                             max_lora_rank=8) if holder else None

    def adapter_sum(named):     # the export's peft names hold the adapter's ".default", the engine's not
        named = ((n.removeprefix("base_model.model.").replace(".default.", "."), t) for n, t in named)
        return checksum_named_tensors(sorted(named, key=lambda kv: kv[0]))

    out = []
    try:
        for c, (kind, state_dict, transposed) in enumerate(CASES):
            peft_like = _lora(cfg, 60 + c)
            model, _ = wrap_2x2(kind, peft_like, transposed, layers=peft_like.base_model.model.model.layers)
            plain = _lora(cfg, 60 + c)
            kw = dict(method="tensor", dtype=torch.float32, lora="adapter", lora_name="L",
                      free_cache_engine=False, memory_probe="off")
            if state_dict is not None:
                kw["fsdp1_state_dict"] = state_dict
            manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(**kw))
            try:
                for s in range(SYNCS):
                    if s:        # a new adapter, the same on both replicas (and on the unsharded copy)
                        with torch.no_grad():
                            for t in _local_lora(model) + _local_lora(plain):
                                t.mul_(1.5).add_(0.25)
                    rec = {"case": f"{kind} {state_dict}" + " transposed" * transposed, "sync": s}
                    try:
                        with manager:
                            rec["base_bytes"] = manager.stats.extra.get("base_bytes")
                            rec["tensors"] = manager.stats.tensors
                    except SyncError as exc:
                        rec["error"] = str(exc)
                    rec["adapter"] = adapter_sum(export.iter_params(model, dtype=torch.float32, lora=True))
                    rec["plain_adapter"] = adapter_sum(export.iter_params(plain, dtype=torch.float32,
                                                                         lora=True))
                    rec["base"] = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))
                    rec["plain_base"] = checksum_named_tensors(export.iter_params(plain, dtype=torch.float32))
                    if engine is not None:
                        rec["engine_adapter"] = adapter_sum(engine.lora_tensors("L").items())
                        rec["engine_base"] = engine.weights_checksum()
                    out.append(rec)
            finally:
                manager.close()
            if engine is not None:
                engine.unload_lora_adapter("L")
            del model, plain, manager
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(90)
def test_hybrid_shard_2x2_lora_adapter_syncs_bit_exact_fsdp2_and_fsdp1():
    per_rank = run_ranks(_job, 4, timeout_s=80, pg_timeout_s=30, env=spawn_env())
    assert all(len(recs) == len(CASES) * SYNCS for recs in per_rank), per_rank
    adapters = set()
    for i, rec in enumerate(per_rank[0]):
        assert "error" not in rec, rec
        # the 2 x 2 trainer's export is its unsharded copy's, base and adapter
        assert rec["adapter"] == rec["plain_adapter"] and rec["base"] == rec["plain_base"], rec
        # the base goes with the first sync only; every sync sends lora_A and lora_B of 7 modules x 2 layers
        assert (rec["base_bytes"] or 0) > 0 if rec["sync"] == 0 else rec["base_bytes"] is None, rec
        assert rec["tensors"] == 2 * 7 * 2, rec
        adapters.add(rec["adapter"])
        for r in range(4):
            other = per_rank[r][i]
            same = {k: v for k, v in other.items() if not k.startswith("engine")}
            assert same == {k: v for k, v in rec.items() if not k.startswith("engine")}, (r, other, rec)
            if r in (0, 2):     # both engines serve the trainer's adapter over its base, bit for bit
                assert other["engine_adapter"] == rec["adapter"], (r, other)
                assert other["engine_base"] == rec["base"], (r, other)
    assert len(adapters) == len(CASES) * SYNCS      # each sync served a new adapter
