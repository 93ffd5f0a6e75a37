"""Plan a LoRA adapter's syncs (`SyncConfig(lora="adapter")`) beside a base sync's plan row:
what the first sync adds to the base's bytes, and what every sync after it sends alone.

- The adapter: ``lora_A`` (r x in) and ``lora_B`` (out x r) of every ``nn.Linear`` of the decoder
  layers whose attribute name is one of the targets (`lora_linears`: the modules
  `cli.lora_model.add_lora` wraps, and those peft's ``target_modules`` names reach in a
  decoder), in the rollout dtype, on the meta device (no memory).
- An adapter sync: ONE flattened bucket, planned as `weights.adapter_export` plans it (its byte
  figure is its buffer, kept on every trainer rank from one sync to the next: in one host's
  shared memory for the ranks of a CPU host, else on each rank's device), and one engine call per
  engine (`lora_sync.sync_adapter`'s ``engine_calls``). The first sync of a run sends the base
  (the row's ``bytes``) and then the adapter.
- ``adapter_seconds``: an estimate as the row's, from the same cluster figures: the gather of the
  other ranks' shards over the trainer's link (a host-shared buffer: its two barriers), the
  ranks' agreements, per engine one call and the adapter's bytes copied in, and each tensor's host
  work (``tensor_s``, where the cluster was measured); ``adapter_phases`` say which.

Bytes and tensors are exact against the bench's LoRA rows (``fsdp-sync bench --lora-r``,
tests/test_plan_lora.py); the seconds are a model.

Not here: the base sync's row (`fsdp_sync.plan`), the CLI (`fsdp_sync.cli.plan`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["ALL_LINEAR", "lora_linears", "adapter_metas", "adapter_fields"]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""peft's ``all-linear`` of a Qwen2 / Llama decoder layer: attention and MLP projections."""


def lora_linears(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(qualified name, parent, attribute, linear)`` of every ``nn.Linear`` in the decoder layers
    (``model.model.layers``) held under an attribute named in ``targets``, in module order."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for pname, parent in layer.named_modules():
            for name, child in parent.named_children():
                if name in targets and isinstance(child, nn.Linear):
                    where = f"model.layers.{i}." + (f"{pname}." if pname else "") + name
                    out.append((where, parent, name, child))
    return out


def adapter_metas(model: nn.Module, r: int, targets: Sequence[str], dtype: torch.dtype) -> list:
    """The adapter's `TensorMeta`s as the sync sends them (peft's saved names, state-dict order:
    each module's ``lora_A`` then ``lora_B``). ValueError where ``targets`` name no linear layer."""
    from .weights.bucket import TensorMeta

    if r < 1:
        raise ValueError(f"the LoRA rank r must be >= 1, got {r}")
    found = lora_linears(model, targets)
    missing = [t for t in targets if not any(attr == t for _, _, attr, _ in found)]
    if missing:
        have = sorted({n for layer in model.model.layers for m in layer.modules()
                       for n, c in m.named_children() if isinstance(c, nn.Linear)})
        raise ValueError(f"LoRA targets {missing} name no linear layer of the model's decoder layers "
                         f"(its linear layers: {', '.join(have)})")
    metas = []
    for where, _, _, lin in found:
        metas.append(TensorMeta(f"base_model.model.{where}.lora_A.weight", dtype, (r, lin.in_features)))
        metas.append(TensorMeta(f"base_model.model.{where}.lora_B.weight", dtype, (lin.out_features, r)))
    return metas


def adapter_fields(job: Any, cluster: Any, row: dict, r: int, targets: Sequence[str]) -> dict:
    """The fields an adapter sync adds to ``row`` (the base sync's `plan.plan_row` of ``job``)."""
    from .plan import GB, meta_model
    from .weights.bucket import plan_one

    _, module = meta_model(job.model)
    metas = adapter_metas(module, r, targets, getattr(torch, job.dtype))
    nbytes = sum(m.nbytes for m in metas)
    buffer = plan_one(metas).nbytes        # the export's one bucket (`AdapterExport._resolve`)
    world, engines = job.ranks, job.engines
    # CPU shards of one group on one host: a host-shared buffer (`gather.shared_group`), whatever
    # share_host_memory says of the base's buckets
    shared = cluster.device == "cpu" and 1 < world <= cluster.gpus_per_node
    d2d = cluster.d2d_gbps * GB
    link = (cluster.collective_gbps or (cluster.intra_gbps if world <= cluster.gpus_per_node
                                        else cluster.inter_gbps)) * GB
    phases = [("copy my shards into the buffer", nbytes / world / d2d, "d2d")]
    if shared:
        phases.append(("barriers around the shared buffer", 2 * cluster.collective_s, "host"))
    elif world > 1:
        phases.append(("gather the other ranks' shards",
                       nbytes * (world - 1) / world / link + cluster.collective_s, "intra"))
    if world > 1:      # the export's all-reduce, then the sync's three agreements
        phases.append(("agreements between the trainer ranks", 4 * cluster.collective_s, "host"))
    # per engine: one call (`bucket_s`, as a base sync's bucket: handles made, opened, loaded,
    # acknowledged) and the adapter copied into its shards; each tensor's host work on top
    phases.append(("engine calls (load the adapter)",
                   engines * ((cluster.bucket_s or cluster.call_s + 2 * cluster.collective_s) + nbytes / d2d),
                   "call"))
    if cluster.tensor_s:
        phases.append(("per-tensor host work", len(metas) * cluster.tensor_s, "host"))
    first = row["bytes"] + nbytes
    return {"lora_r": r, "lora_targets": list(targets), "adapter_bytes": nbytes,
            "adapter_tensors": len(metas), "adapter_buckets": 1, "adapter_buffer_bytes": buffer,
            "adapter_engine_calls": engines, "first_sync_bytes": first,
            "adapter_bytes_ratio": nbytes / first if first else 0.0,
            "adapter_seconds": math.fsum(s for _, s, _ in phases),
            "adapter_phases": [{"what": w, "seconds": s, "link": k} for w, s, k in phases]}
