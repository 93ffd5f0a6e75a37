"""A small real trainer for the demo, the benchmarks and the tests: FSDP1/FSDP2 wrapping of a
decoder-only model, a fixed synthetic corpus, and an AdamW next-token-loss step.

It exists so that every sync the project measures follows real training (weights that really
change), not a toy update. It is not a training framework: no checkpointing, no schedules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["wrap_fsdp", "synthetic_batch", "train_step", "decoder_layer_cls", "greedy_generate"]


def decoder_layer_cls(model: torch.nn.Module) -> type:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no .model.layers to wrap per layer")
    return type(layers[0])


def wrap_fsdp(model: torch.nn.Module, version: int, *, device: str = "cpu") -> torch.nn.Module:
    """Shard ``model`` over the default process group: FSDP2 (``fully_shard`` per decoder layer and
    at the root) or FSDP1 (``FullyShardedDataParallel`` with one unit per decoder layer). A CPU
    trainer on a group without a CPU backend (``--backend cuda:gloo``) shards over its gloo twin
    (`topology.cpu_group`): that is where CPU tensors can travel."""
    from ..topology import cpu_group, has_cpu_backend

    world = dist.get_world_size()
    cpu_twin = cpu_group() if device == "cpu" and not has_cpu_backend() else None
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        model = model.to("cuda")
    if version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if cpu_twin is not None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(cpu_twin, "cpu", mesh_dim_names=("fsdp",))
        else:
            mesh = init_device_mesh(device, (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        return FSDP(model, device_id=dev, auto_wrap_policy=ModuleWrapPolicy({decoder_layer_cls(model)}),
                    use_orig_params=True, **({"process_group": cpu_twin} if cpu_twin is not None else {}))
    raise ValueError(f"fsdp version must be 1 or 2, got {version!r}")


def synthetic_batch(vocab_size: int, *, step: int, rank: int, batch: int = 4, seq_len: int = 32,
                    device: str = "cpu") -> torch.Tensor:
    """A fixed corpus: the same tokens for the same (step, rank) on every run."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(1, vocab_size, (batch, seq_len), generator=g).to(device)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor) -> float:
    """One next-token-loss step; returns the loss."""
    model.train()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(out.loss.detach())


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the trainer's own model, one prompt at a time (no padding subtleties).

    Under FSDP every rank must call it with the same prompts: each forward is a collective.
    """
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=next(model.parameters()).device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[0, -1]
            nxt = int(torch.argmax(logits))
            new.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        out.append(new)
    return out


@torch.no_grad()
def last_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every prompt's last position, ``[len(prompts), vocab]``, float32."""
    dev = next(model.parameters()).device
    rows = [model(input_ids=torch.tensor([p], device=dev)).logits[0, -1].float().cpu() for p in prompts]
    return torch.stack(rows)
