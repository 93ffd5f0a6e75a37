"""A real hybrid-sharded trainer with both dimensions > 1 (4 ranks: 2 replicas x 2 shards), as verl's
``fsdp_size`` makes it: FSDP1 ``HYBRID_SHARD`` over a ``device_mesh`` (state dict "sharded" and
"full"; "local" is refused with a mesh, `export_checks.state_dict_refusal`), FSDP1 ``HYBRID_SHARD``
over ``process_group=(shard_group, replicate_group)`` (the default "full", and "sharded"), and FSDP2
HSDP (``fully_shard`` on a 2-D ``("dp_replicate", "dp_shard")`` mesh); the tuple form and FSDP2 also
with shard groups {0, 2}, {1, 3} across the engines' TP groups {0, 1}, {2, 3}. Each syncs by the
tensor method (``layout`` "auto", "engine" and "full", the last with ``verify="sample"``; engines of
TP 2 on ranks 0 and 2 of a ``make_mesh(2, 2)``) and by the disk method (an engine of TP 2 on rank 0);
after each sync the engines hold the trainer's weights bit for bit (`weights_checksum` against the
export and against an unsharded copy of the model), the same answer on every rank.

``fsdp1_state_dict="local"`` over the tuple form is refused on every rank before anything is sent,
naming the setting and what to use (over the 2 x 2 device_mesh too, without its old advice to wrap
with ``process_group=`` instead). Before: torch's LOCAL state dict places each shard at its rank in
the shard group as if it were a global rank, so on the second replica's ranks the export failed
("Global rank 0 does not exist in input process group: [2, 3]") after the first replica's ranks
had begun pushing (the engine left half-updated), and with shard groups {0, 2}, {1, 3} it hung until
the process group's timeout; ``verify="sample"``, which reads its sample with "local" wherever
`state_dict_refusal` allows it, failed the same way after every sync of the tuple form, whatever
the sync's state dict (now it reads with "sharded"). One 4-rank job for every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

sys.path.insert(0, str(Path(__file__).parent))
from _hybrid import note_checksums, wrap_2x2  # noqa: E402

CASES = [   # (wrapping, SyncConfig.fsdp1_state_dict (None: the default), shard groups {0, 2}, {1, 3})
    ("fsdp1-mesh", "sharded", False), ("fsdp1-mesh", "full", False), ("fsdp1-groups", None, False),
    ("fsdp1-groups", "sharded", True), ("fsdp2", None, False), ("fsdp2", None, True),
    ("fsdp1-groups", "local", False), ("fsdp1-groups", "local", True), ("fsdp1-mesh", "local", False)]
SYNCS = [("tensor", "auto", {}), ("tensor", "engine", {}), ("tensor", "full", {"verify": "sample"}),
         ("disk", "auto", {})]


def _job(rank: int, world: int, tmp: str) -> list[dict]:
    from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    mesh = make_mesh(2, 2)            # engines of TP 2 on ranks 0 and 2 (tensor method)
    holder = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=2, device="cpu", dtype=torch.float32) \
        if holder else None
    out = []
    try:
        for c, (kind, state_dict, transposed) in enumerate(CASES):
            model, flats = wrap_2x2(kind, build_model(cfg, seed=40 + c), transposed)
            plain = build_model(cfg, seed=40 + c)
            for method, layout, more in SYNCS:
                with torch.no_grad():    # new weights for every sync, the same on both replicas
                    for t in flats + list(plain.parameters()):
                        t.mul_(1.5).add_(0.25)
                kw = dict(method=method, layout=layout, dtype=torch.float32, free_cache_engine=False,
                          memory_probe="off", **more)
                if state_dict is not None:
                    kw["fsdp1_state_dict"] = state_dict
                if method == "disk":
                    kw["disk_dir"] = f"{tmp}/case{c}"
                    engines, mkw = ([engine] if rank == 0 else None), {}
                else:
                    engines, mkw = engine, {"mesh": mesh}
                rec = {"case": f"{kind} {state_dict}" + " transposed" * transposed, "method": method,
                       "layout": layout}
                before = engine.weights_checksum() if engine is not None else None
                manager = FSDPShardingManager(model, engines, config=SyncConfig(**kw), **mkw)
                try:
                    with manager:
                        rec["used"] = manager.stats.extra.get("layout")
                        rec["path"] = manager.stats.extra.get("reshard_path")
                except SyncError as exc:
                    rec["error"] = str(exc)
                finally:
                    manager.close()
                note_checksums(rec, model, plain, engine if method == "tensor" or rank == 0 else None, before)
                out.append(rec)
            del model, plain, flats
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(90)
def test_hybrid_shard_2x2_fsdp1_and_fsdp2_sync_bit_exact_by_tensor_and_disk(tmp_path):
    per_rank = run_ranks(_job, 4, str(tmp_path), timeout_s=80, pg_timeout_s=30, env=spawn_env())
    assert all(len(recs) == len(CASES) * len(SYNCS) for recs in per_rank), per_rank
    for i, rec in enumerate(per_rank[0]):
        # the export of the 2 x 2 trainer is its unsharded model's weights
        assert rec["trainer"] == rec["unsharded"], rec
        refused = " local" in rec["case"]
        if refused and "mesh" in rec["case"]:
            assert rec["error"].startswith("weight sync failed on rank 0 (ranks [1, 2, 3] failed too): "
                                           "SyncConfig.fsdp1_state_dict='local' cannot export this "
                                           "FSDP1 model: its units were made with a device_mesh "
                                           "(HYBRID_SHARD over a mesh of shape (2, 2)"), rec
            # not "wrap with process_group= instead": that is refused too where replicas > 1
            assert "or 'full' (the whole model on every rank)" in rec["error"], rec
            assert "process_group=" not in rec["error"], rec
        elif refused:
            assert rec["error"].startswith("weight sync failed on rank 0 (ranks [1, 2, 3] failed too): "
                                           "SyncConfig.fsdp1_state_dict='local' cannot export this "
                                           "FSDP1 model: on rank 0 its units shard over a process "
                                           "group of 2 of the default group's 4 ranks (HYBRID_SHARD, "
                                           "shard group "), rec
            assert "set SyncConfig.fsdp1_state_dict='sharded'" in rec["error"], rec
            assert "or 'full'" in rec["error"], rec
        else:
            assert "error" not in rec, rec
            # per-rank buckets where the layout allows them (cut over each shard group)
            assert rec["used"] == ("full" if rec["layout"] == "full" else "engine"), rec
        holders = (0, 2) if rec["method"] == "tensor" else (0,)
        for r in range(4):
            other = per_rank[r][i]
            same = {k: v for k, v in other.items() if k not in ("engine", "changed")}
            assert same == {k: v for k, v in rec.items() if k not in ("engine", "changed")}, (r, other, rec)
            if refused:       # refused before anything was sent: the engines keep their weights
                assert r not in holders or not other["changed"], (r, other)
            elif r in holders:      # the engine holds the trainer's weights, bit for bit
                assert other["engine"] == rec["trainer"] and other["changed"], (r, other)
