"""What an adapter-only sync keeps from one sync to the next (`weights.adapter_export`: the plan, the
host-shared buffer, where each shard comes from; the engine workers' spare shard and kept check) is
dropped whenever the module's adapter changes: after cached syncs, a replaced parameter, another
rank and other target modules each either sync bit-exact (the engine's adapter equals the module's
own full tensors, read independently of the export) or are refused by name with the old adapter
kept; the trainer holds one shared-memory segment at a time and none after ``close``.
"""

from __future__ import annotations

import os

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

NAME = "fsdp_sync_lora"


def _segments() -> int:
    """This process's torch shared-memory segments."""
    return sum(1 for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_"))


def _body(rank, world):
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.lora_sync import peft_name
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.weights.export import hf_name, is_lora

    torch.set_num_threads(1)
    mesh = make_mesh(1, 2)
    engine = ReferenceEngine(model_config=load_config("tiny"), tp_size=2, max_lora_rank=8) \
        if SyncTopology.from_mesh(mesh).is_tp_src else None
    module = wrap_fsdp(add_lora(build_model(load_config("tiny"), seed=0), 4, 8, seed=1), 2)
    fsdp_mesh = next(p for n, p in module.named_parameters() if is_lora(n)).device_mesh
    layers = module.base_model.model.model.layers
    g = torch.Generator().manual_seed(7)
    manager = FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(
        dtype=torch.float32, lora="adapter", verify="full", bucket_bytes=16 << 10))
    out: list[dict] = []
    last: dict = {}

    def new_weight(shape):
        full = torch.randn(shape, generator=g) * 0.1      # the same on both ranks (one seed)
        return nn.Parameter(distribute_tensor(full, fsdp_mesh, [Shard(0)]))

    def set_rank(r):
        for layer in layers:
            for mod in layer.modules():
                if hasattr(mod, "lora_A"):
                    a, b = mod.lora_A["default"], mod.lora_B["default"]
                    a.weight = new_weight((r, a.weight.shape[1]))
                    b.weight = new_weight((b.weight.shape[0], r))
        module.peft_config["default"]["r"] = r

    def sync(what):
        want = {peft_name(hf_name(n)).removeprefix("base_model.model."): p.full_tensor().clone()
                for n, p in module.named_parameters() if is_lora(n)}   # collective: both ranks
        rec = {"what": what, "error": None}
        try:
            with manager:
                pass
        except SyncError as exc:
            rec["error"] = str(exc)
        kept = manager.lora_export
        rec.update(hits=kept.hits, misses=kept.misses, segments=_segments())
        if engine is not None:
            got = engine.lora_tensors(NAME)
            rec["exact"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
            rec["kept"] = sorted(got) == sorted(last) and all(torch.equal(got[k], last[k]) for k in last)
            rec["modules"] = sorted({k.split(".")[-3] for k in got})
            last.clear()
            last.update(got)
        out.append(rec)

    try:
        sync("first")                                      # base + adapter: resolved
        for step in range(2):                              # trained in place: the kept sources
            lora = [p for n, p in module.named_parameters() if ".lora_" in n]
            module(input_ids=torch.tensor([[3 + step, 5, 7, 11]])).logits.pow(2).mean().backward()
            torch.optim.SGD(lora, lr=0.5).step()
            module.zero_grad(set_to_none=True)
            sync(f"trained {step}")
        layers[1].mlp.down_proj.lora_B["default"].weight = new_weight((64, 4))
        sync("one parameter replaced")                     # same plan and buffer, resolved again
        set_rank(8)
        sync("r 8")                                        # refused by name: the engine serves r=4
        if engine is not None:
            engine.unload_lora_adapter(NAME)
        sync("r 8 after unload")
        for layer in layers:                               # v_proj loses its adapter
            layer.self_attn.v_proj = layer.self_attn.v_proj.base_layer
        module.peft_config["default"]["target_modules"] = ["q_proj", "k_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]
        sync("no v_proj")                                  # refused by name: other targets
        if engine is not None:
            engine.unload_lora_adapter(NAME)
        sync("no v_proj after unload")
        sync("unchanged")                                  # kept again
        manager.close()
        import torch.distributed as dist
        dist.barrier()
        out.append({"what": "closed", "segments": _segments()})
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(400)
def test_kept_adapter_export_follows_every_change_of_the_adapter():
    results = run_ranks(_body, 2, timeout_s=380, env=spawn_env())
    for rank, steps in enumerate(results):
        by = {s["what"]: s for s in steps}
        # hits / misses of the kept sources (both ranks alike: one all-reduce decides)
        # (a refused sync's export is kept too: the sync after the unload takes it)
        assert [(s["hits"], s["misses"]) for s in steps[:-1]] == [
            (0, 1), (1, 1), (2, 1), (2, 2), (2, 3), (3, 3), (3, 4), (4, 4), (5, 4)], steps
        assert "r=8 but the engine serves it with r=4" in by["r 8"]["error"]
        assert "target_modules ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj'] " \
               "but the engine serves it on" in by["no v_proj"]["error"]
        for s in steps[:-1]:
            assert s["error"] is None or s["what"] in ("r 8", "no v_proj"), s
            # group rank 0 made the one host-shared buffer; the old one is gone once replaced
            assert s["segments"] == (1 if rank == 0 else 0), s
        assert by["closed"]["segments"] == 0
        if rank == 0:
            for s in steps[:-1]:
                if s["error"] is None:
                    assert s["exact"], s
                else:                                      # refused: the old adapter serves on
                    assert s["kept"] and not s["exact"], s
            assert "v_proj" in by["r 8 after unload"]["modules"]
            assert "v_proj" not in by["no v_proj after unload"]["modules"]
            assert len(by["no v_proj after unload"]["modules"]) == 6
