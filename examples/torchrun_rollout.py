"""Train a small Qwen2 with FSDP2 under torchrun; after every step, sync it into a TP-2 rollout
engine inside ``with manager:``, roll out, and check the engine against the trainer.

    torchrun --nproc_per_node 2 examples/torchrun_rollout.py --steps 3
    torchrun --standalone --nproc_per_node 2 examples/torchrun_rollout.py --method distributed

``--method tensor`` (default, colocated): runs on CPU (gloo) or GPUs (NCCL), with any even number
of ranks: the ranks form a ("dp", "infer_tp") mesh of world/2 x 2, and infer-TP rank 0 of each
group owns a `ReferenceEngine` (swap in `fsdp_sync.engines.sglang.SGLangEngine` for SGLang).

``--method distributed`` (disaggregated, the README's example under torchrun): trainer rank 0 alone
owns the engine and broadcasts each bucket to its workers over the weight-update group; every rank
sends its prompts to rank 0, which rolls them out. CPU only here (the engine's workers would take
the trainer ranks' GPUs; on GPUs give the engine devices of its own).

The engine starts its own worker processes; they do not inherit torchrun's rank environment.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
from fsdp_sync.weights import export
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import checksum_named_tensors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--method", choices=["tensor", "distributed"], default="tensor")
    args = ap.parse_args()
    distributed = args.method == "distributed"

    cuda = torch.cuda.is_available() and not distributed
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    torch.set_num_threads(1)

    # a tiny Qwen2, the same on every rank; FSDP2 over all ranks
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    if not distributed:     # colocated: one engine per infer-TP group, on its infer-TP rank 0
        mesh = make_mesh(dp=world // args.tp, infer_tp=args.tp, device_type=device)
        holder = mesh["infer_tp"].get_local_rank() == 0
        sync = SyncConfig(strategy="flattened", bucket_bytes=512 << 20)
    else:                   # disaggregated: the engine on trainer rank 0 only, no mesh
        mesh, holder = None, rank == 0
        sync = SyncConfig(method="distributed", bucket_bytes=512 << 20)
    engine = ReferenceEngine(model_config=config, tp_size=args.tp, device=device) if holder else None
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=sync)

    try:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=g).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            prompts = torch.randint(0, config.vocab_size, (2, 8), generator=g)
            with manager:                                   # resume weights -> sync -> resume kv_cache
                if not distributed:
                    batch = manager.preprocess_data({"input_ids": prompts})   # the TP group's prompts
                    out = [None]
                    if engine is not None:
                        out = [engine.generate(input_ids=batch["input_ids"].tolist(), max_new_tokens=8,
                                               ignore_eos=True)]
                    dist.broadcast_object_list(out, src=manager.topo.tp_src, group=manager.topo.tp_group)
                    batch["responses"] = torch.tensor(out[0])
                    batch = manager.postprocess_data(batch)      # this rank's prompts again
                else:               # trainer rank 0 rolls out every rank's prompts
                    every: list = [None] * world
                    dist.all_gather_object(every, prompts.tolist())
                    out = [None]
                    if engine is not None:
                        out = [engine.generate(input_ids=[p for ps in every for p in ps],
                                               max_new_tokens=8, ignore_eos=True)]
                    dist.broadcast_object_list(out, src=0)
                    batch = {"input_ids": prompts, "responses": torch.tensor(out[0][2 * rank:2 * rank + 2])}

                # check: the engine holds the trainer's weights bit for bit and computes its logits
                trainer_sum = checksum_named_tensors(export.iter_params(model))   # collective
                with torch.no_grad():
                    logits = model(input_ids=batch["input_ids"].to(device)).logits[:, -1].float().cpu()
                if engine is not None:
                    assert engine.weights_checksum() == trainer_sum, "engine weights differ"
                    diff = (engine.forward_logits(prompts.tolist()).float().cpu() - logits).abs().max()
                    assert diff <= 1e-4, f"engine logits differ from the trainer's by {diff}"
                assert batch["responses"].shape == (2, 8)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}  synced {manager.stats.bytes} bytes in "
                      f"{manager.stats.seconds * 1e3:.0f} ms  engine == trainer  "
                      f"responses {batch['responses'][0].tolist()}", flush=True)
    finally:
        manager.close()         # distributed: destroys the weight-update group
        if engine is not None:
            engine.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
