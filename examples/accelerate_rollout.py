"""Train a small Qwen2 with Hugging Face accelerate (FSDP), sync it into a TP-2 rollout engine
inside ``with manager:`` after every step, roll out, and check the engine against the trainer.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_rollout.py
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_rollout.py \
        --method distributed
    accelerate launch --config_file examples/accelerate_fsdp1.yaml examples/accelerate_rollout.py  # FSDP1

``--method tensor`` (default, colocated): infer-TP rank 0 of each ("dp", "infer_tp") group owns an
engine. ``--method distributed`` (disaggregated): the process accelerate makes rank 0 alone owns
the engine and broadcasts each bucket to its workers over the weight-update group (accelerate
launches through torchrun, whose agent store rank 0 must not wait for); CPU only here (on GPUs
give the engine devices of its own).

The model `accelerator.prepare` returns goes to `FSDPShardingManager` as it is (FSDP2, or the
FSDP1 root wrapper with ``fsdp_version: 1``); do not pass ``accelerator.unwrap_model(model)`` of
an FSDP1 model, it lacks the root's weights (export refuses it and says so). fsdp_sync's
("dp", "infer_tp") mesh lives beside accelerate's own device mesh over the same processes.

On GPUs accelerate applies FSDP itself. On a CPU machine it never does (each process would train
an unsharded copy), so this script stops and says so; the test suite runs it on CPU through a
test-only helper that makes accelerate shard (tests/accelerate_cpu_run.py).
"""

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
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

    accelerator = Accelerator()
    if accelerator.distributed_type != DistributedType.FSDP:
        raise SystemExit(f"accelerate did not apply FSDP here (distributed type "
                         f"{accelerator.distributed_type.value}): on a CPU machine it never does. "
                         f"Run on GPUs, or see tests/accelerate_cpu_run.py for the test-only way "
                         f"to make it shard on CPU")
    torch.set_num_threads(1)
    device = accelerator.device
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)

    rank, world = dist.get_rank(), dist.get_world_size()
    if not distributed:     # colocated: one engine per infer-TP group, on its infer-TP rank 0
        mesh = make_mesh(dp=world // args.tp, infer_tp=args.tp, device_type=device.type)
        holder, sync = mesh["infer_tp"].get_local_rank() == 0, SyncConfig()
    else:                   # disaggregated: the engine on rank 0 only, no mesh
        if device.type != "cpu":
            raise SystemExit("--method distributed runs on CPU here: on GPUs give the engine GPUs "
                             "of its own (ReferenceEngine(base_gpu_id=...))")
        mesh, holder, sync = None, rank == 0, SyncConfig(method="distributed")
    engine = ReferenceEngine(model_config=config, tp_size=args.tp, device=device.type) if holder else None
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=sync)

    try:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=g).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
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
                else:               # rank 0 rolls out every rank's prompts
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
            if accelerator.is_main_process:
                print(f"step {step}: loss {loss.item():.4f}  synced {manager.stats.bytes} bytes in "
                      f"{manager.stats.seconds * 1e3:.0f} ms  engine == trainer  "
                      f"({type(model).__name__})", flush=True)
    finally:
        manager.close()         # distributed: destroys the weight-update group
        if engine is not None:
            engine.shutdown()
    accelerator.end_training()


if __name__ == "__main__":
    main()
