"""FSDP2 with ``CPUOffloadPolicy`` on an NCCL-only default group: the parameters' shards live on the
CPU while every group of the trainer runs CUDA tensors only (``init_process_group("nccl")`` under
torchrun or accelerate, with ``fully_shard(..., offload_policy=CPUOffloadPolicy())``, verl's
``fsdp_config.offload_policy``). Every gather of those shards, the sync's and verify's, ran a CPU
collective on the FSDP mesh's group and failed with ``No backend type associated with device type
cpu``: the tensor method without host-shared buffers (trainer ranks on several hosts, or
``share_host_memory=False``), the disk and distributed methods, and ``verify="full"``/``"sample"``
even where the sync itself went through host-shared memory. CPU shards now travel on the group's
gloo twin (`gather.data_group`, `topology.cpu_group`).

Emulated on a CPU machine as tests/test_nccl_only_group.py does: ``init_process_group("cuda:gloo")``
makes a group without a CPU backend, and the FSDP2 mesh is built on it with CPU-resident shards
(``CPUOffloadPolicy(pin_memory=False)``: pinning needs CUDA): 4 ranks, a 1-D mesh over all of
them (its shards gathered as pieces) and HSDP's 2 x 2 mesh (replicas x shards: ``full_tensor()``
on the same mesh over the groups' gloo twins, `gather.data_mesh`); tensor-method engines of TP 2
on ranks 0 and 2, the disk and distributed methods into rank 0's. Then LoRA (``lora="adapter"``, a
peft-shaped model on the 1-D mesh, offloaded too): the base and the adapter once, then the adapter
alone, each engine's adapter equal to the unsharded copy's. The emulated mesh cannot run FSDP2's
own forward (which on a GPU copies the shards to CUDA before its all-gather), so the weights are
changed in place, shard by shard, the same way on an unsharded copy; the engine must then hold
that copy's weights bit for bit. Not emulated: FSDP1 (its state dicts assert CUDA on a group whose
backend is CUDA's), and the distributed method's update group on a GPU (here gloo, as on any CPU).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates NCCL-only on a CPU machine")

LORA = "fsdp_sync_lora"

CASES = [   # FSDP2 mesh, method, layout, share_host_memory, verify
    ("1d", "tensor", "full", False, "full"),
    ("1d", "tensor", "engine", False, "sample"),
    ("1d", "tensor", "engine", True, "full"),
    ("1d", "disk", "full", False, "full"),
    ("hsdp", "tensor", "auto", False, "full"),
    ("hsdp", "tensor", "engine", True, "sample"),
    ("hsdp", "disk", "engine", False, "off"),
    ("1d", "distributed", "engine", False, "full"),
    ("hsdp", "distributed", "full", False, "sample"),
]


def _job(rank, world, disk_root):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, has_cpu_backend, make_mesh
    from fsdp_sync.lora_sync import peft_name
    from fsdp_sync.weights import export
    from fsdp_sync.weights.export import hf_name, is_lora

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    mesh = make_mesh(2, 2, "cpu")
    engine = ReferenceEngine(model_config=cfg, tp_size=2, max_lora_rank=4) \
        if SyncTopology.from_mesh(mesh).is_tp_src else None
    meshes = {"1d": DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("fsdp",)),
              "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    models = {}
    for kind, fsdp_mesh in [*meshes.items(), ("lora", meshes["1d"])]:
        model = build_model(cfg, seed=0)
        if kind == "lora":
            model = add_lora(model, 4, 8, seed=1)
        for layer in (model.base_model.model if kind == "lora" else model).model.layers:
            fully_shard(layer, mesh=fsdp_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=fsdp_mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        params = dict(model.named_parameters())
        assert not any(has_cpu_backend(fsdp_mesh.get_group(d)) for d in range(fsdp_mesh.ndim))
        assert all(p.to_local().device.type == "cpu" and p.to_local().numel() < p.numel()
                   for p in params.values())
        plain = add_lora(build_model(cfg, seed=0), 4, 8, seed=1) if kind == "lora" else build_model(cfg, seed=0)
        models[kind] = (model, params, plain)
    assert not has_cpu_backend()
    out, before = [], None
    try:
        for c, (kind, method, layout, shm, verify) in enumerate(CASES):
            model, params, plain = models[kind]
            with torch.no_grad():        # the same elementwise change on each shard and the copy
                for name, q in plain.named_parameters():
                    for t in (params[name].to_local(), q):
                        t.mul_(1.0 + 0.01 * (c + 1)).add_(0.001 * (c + 1))
            if method != "tensor":   # the engine is trainer rank 0's to load
                extra = {"disk_dir": os.path.join(disk_root, f"case{c}")} if method == "disk" else \
                    {"dist_timeout_s": 30.0, "dist_group_name": f"h96_{c}"}
                engines, mkw = ([engine] if rank == 0 else None), {}
            else:
                extra, engines, mkw = {}, engine, {"mesh": mesh}
            manager = FSDPShardingManager(model, engines, **mkw, config=SyncConfig(
                dtype=torch.float32, method=method, layout=layout, share_host_memory=shm, verify=verify,
                bucket_bytes=64 << 10, free_cache_engine=False, memory_probe="off", **extra))
            rec = {"case": c, "error": None}
            try:
                with manager:
                    pass
            except SyncError as exc:
                rec["error"] = str(exc)
            finally:
                manager.close()
            rec["unsharded"] = checksum_named_tensors(export.iter_params(plain, dtype=torch.float32))
            if engine is not None and (method == "tensor" or rank == 0):
                rec["engine"] = engine.weights_checksum()
                rec["changed"], before = rec["engine"] != before, rec["engine"]
            out.append(rec)
        model, params, plain = models["lora"]
        manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
            dtype=torch.float32, lora="adapter", verify="full", share_host_memory=False,
            free_cache_engine=False, memory_probe="off"))
        try:
            for step in range(2):
                with torch.no_grad():    # the adapter trained: the same change on the shards and the copy
                    for name, q in plain.named_parameters():
                        if ".lora_" in name:
                            for t in (params[name].to_local(), q):
                                t.mul_(1.5).add_(0.01 * (step + 1))
                rec = {"case": f"lora {step}", "error": None}
                try:
                    with manager:
                        pass
                except SyncError as exc:
                    rec["error"] = str(exc)
                if engine is not None:
                    got = engine.lora_tensors(LORA)
                    want = {peft_name(hf_name(n)).removeprefix("base_model.model."): q
                            for n, q in plain.named_parameters() if is_lora(n)}
                    rec["adapter_exact"] = sorted(got) == sorted(want) and \
                        all(torch.equal(got[k], want[k]) for k in want)
                    rec["base_bytes"] = manager.stats.extra.get("base_bytes", 0)
                out.append(rec)
        finally:
            manager.close()
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(180)
def test_cpu_offloaded_fsdp2_and_hsdp_sync_bit_exact_on_a_group_without_cpu_backend(tmp_path):
    results = run_ranks(_job, 4, str(tmp_path), backend="cuda:gloo", timeout_s=150, pg_timeout_s=30,
                        env=spawn_env())
    for rank, recs in enumerate(results):
        assert [r["case"] for r in recs] == [*range(len(CASES)), "lora 0", "lora 1"], recs
        for r in recs:
            assert r["error"] is None, (CASES[r["case"]], r["error"])
            if "adapter_exact" in r:     # the base went with the first sync only
                assert r["adapter_exact"] and (r["base_bytes"] > 0) == (r["case"] == "lora 0"), (rank, r)
            if "engine" in r:    # the engine holds the unsharded copy's weights, new every sync
                assert r["engine"] == r["unsharded"] and r["changed"], (rank, CASES[r["case"]], r)
    assert sum("adapter_exact" in r for r in results[0] + results[2]) == 4
    assert sum("engine" in r for r in results[0]) == len(CASES)
    assert sum("engine" in r for r in results[2]) == sum(c[1] == "tensor" for c in CASES)
