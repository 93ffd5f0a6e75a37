"""A model wrapped 2 x 2 (4 ranks: 2 replicas x 2 shards), as verl's ``fsdp_size`` makes it, for
test_h93_hybrid_2x2.py and test_h94_hybrid_distributed.py."""

from __future__ import annotations

import torch


def wrap_2x2(kind: str, model, transposed: bool, layers=None):
    """``model`` (its decoder ``layers``: ``model.model.layers`` unless given) wrapped 2 x 2
    ("fsdp2": HSDP; "fsdp1-mesh", "fsdp1-groups": FSDP1 HYBRID_SHARD over a device_mesh or
    ``process_group=(shard, replicate)``), with its flat pieces on this rank, and a check (on this rank) that it is sharded 2-way and replicated
    2-way: local elements are half the full ones, and the shard and replicate groups have 2 ranks
    each: shards {0, 1} and {2, 3} (the engines' TP groups), or, ``transposed``, {0, 2} and {1, 3}
    (each engine's TP group then spans both shard groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import Replicate, Shard

    layers = model.model.layers if layers is None else layers
    full = sum(p.numel() for p in model.parameters())
    rank = dist.get_rank()
    shards, replicas = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    if transposed:
        shards, replicas = replicas, shards
    if kind == "fsdp2":
        names = ("dp_replicate", "dp_shard")
        mesh = DeviceMesh("cpu", torch.tensor(replicas).T, mesh_dim_names=names) if transposed \
            else init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
        groups = (mesh.get_group("dp_shard"), mesh.get_group("dp_replicate"))
        assert all(p.placements == (Replicate(), Shard(0)) for p in model.parameters()), \
            [p.placements for p in model.parameters()]
        flats = [p.to_local() for p in model.parameters()]
    else:
        policy = ModuleWrapPolicy({type(layers[0])})
        kw = dict(auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True,
                  sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        if kind == "fsdp1-mesh":
            kw["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:   # the tuple form: every rank makes every group, in the same order
            shard = [g for r, g in ((r, dist.new_group(r)) for r in shards) if rank in r][0]
            replicate = [g for r, g in ((r, dist.new_group(r)) for r in replicas) if rank in r][0]
            kw["process_group"] = (shard, replicate)
        model = FSDP(model, **kw)
        units = [u for u in FSDP.fsdp_modules(model) if u._handle is not None]
        assert len(units) == 1 + len(layers), len(units)
        assert all(u.sharding_strategy == ShardingStrategy.HYBRID_SHARD for u in units)
        flats = [u._handle.flat_param for u in units]
        local = sum(f.numel() for f in flats)     # a shard of each unit's padded flat parameter
        groups = (units[0].process_group, units[0]._inter_node_pg)
    got = [sorted(dist.get_process_group_ranks(g)) for g in groups]
    assert got == [[r for r in shards if rank in r][0], [r for r in replicas if rank in r][0]], (rank, got)
    assert 2 * local >= full and 2 * local <= full + 64 * len(flats), (kind, rank, local, full)
    return model, flats


def note_checksums(rec: dict, model, plain, engine, before) -> None:
    """Into ``rec``: the checksums of the 2 x 2 ``model``'s export and of its unsharded copy
    ``plain``, and, where this rank holds an ``engine`` the sync went to, the engine's and whether it
    changed from ``before``."""
    from fsdp_sync.engines import checksum_named_tensors
    from fsdp_sync.weights import export

    rec["trainer"] = checksum_named_tensors(export.iter_params(model, dtype=torch.float32))
    rec["unsharded"] = checksum_named_tensors(export.iter_params(plain, dtype=torch.float32))
    if engine is not None:
        rec["engine"] = engine.weights_checksum()
        rec["changed"] = rec["engine"] != before
