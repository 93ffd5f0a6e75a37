"""Rank body of the accelerate tests (run by `fsdp_sync.cli.launch.run_ranks` on 2 or 4 CPU ranks).

One launch prepares several models with accelerate (made to shard on CPU by the test-only
`accelerate_cpu` helper), trains each a step, and checks on every rank that export and a full
sync into a TP-2 `ReferenceEngine` are bit-exact against torch's own full state dict
(``get_model_state_dict(full_state_dict=True, cpu_offload=False)``), and that the modules a user
may hand over by mistake are refused with an error naming what to pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import accelerate_cpu
from _util import digest
from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
from fsdp_sync.weights import bucket, export
from fsdp_sync.models import build_model, load_config

RECIPE = "tiny-tied"     # tied embeddings in every case
BUCKET = 24 << 10


def _reference(model) -> dict[str, list]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {export.hf_name(k): digest(v) for k, v in sd.items()}


def _compare(named, ref: dict, label: str) -> list[str]:
    got = {n: digest(t) for n, t in named}
    problems = []
    if len(got) != len(named):
        problems.append(f"{label}: a name exported twice")
    missing = set(ref) - set(got) - {"lm_head.weight"}      # tied: exported once, as the embedding
    extra = set(got) - set(ref)
    if missing or extra:
        problems.append(f"{label}: missing {sorted(missing)} extra {sorted(extra)}")
    bad = [n for n in got if n in ref and got[n] != ref[n]]
    if bad:
        problems.append(f"{label}: not bit-identical {bad[:4]}")
    return problems


def _refused(fn, must: str) -> str | None:
    """None when ``fn()`` raised an error whose text contains ``must``, else what happened."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return None if must in str(exc) else f"wrong error: {exc}"
    return "not refused"


def _prepare(case: dict):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerate_cpu.reset()
    kw = dict(fsdp_version=case["version"], auto_wrap_policy="transformer_based_wrap",
              transformer_cls_names_to_wrap=["Qwen2DecoderLayer"], cpu_ram_efficient_loading=False,
              state_dict_type="SHARDED_STATE_DICT", activation_checkpointing=case.get("ac", False))
    if case["version"] == 1:
        kw.update(sync_module_states=False, use_orig_params=case.get("orig", True))
    plugin = FullyShardedDataParallelPlugin(**kw)
    pc = None
    if case.get("hsdp"):
        from accelerate.parallelism_config import ParallelismConfig

        pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)   # 4 ranks
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=case.get("mp", "no"))
    accelerate_cpu.force_fsdp(acc, plugin, pc)
    model = build_model(load_config(RECIPE), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, rank: int) -> float:
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(rank))
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)
    opt.step()
    opt.zero_grad()
    return float(out.loss.detach())


def accelerate_ranks(rank: int, world: int, cases: list[dict]) -> dict:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

    from fsdp_sync.engines import ReferenceEngine

    sync = any(not c.get("refusals_only") and not c.get("export_only") for c in cases)
    mesh = make_mesh(dp=world // 2, infer_tp=2) if sync else None
    engine = (ReferenceEngine(model_config=RECIPE, tp_size=2)
              if sync and mesh["infer_tp"].get_local_rank() == 0 else None)
    out: dict[str, dict] = {}
    try:
        for case in cases:
            acc, model, opt = _prepare(case)
            res: dict = {"problems": [], "kind": type(model).__name__}
            p = res["problems"]
            inner = acc.unwrap_model(model)
            res["checkpoint_wrapped"] = any("_checkpoint_wrapped_module" in n
                                            for n, _ in model.named_modules())
            if case["version"] == 1:
                res["units"] = len(FSDP.fsdp_modules(model))
                mp = model.mixed_precision
                res["param_dtype"] = str(mp.param_dtype) if mp is not None else None
                # before the first forward: found by FSDP's own marks on the flattened parameters
                try:
                    export.param_metas(inner)
                    p.append("unwrap_model before a step: not refused")
                except ValueError as exc:
                    res["unwrap_error"] = str(exc)
            else:
                w = model.model.embed_tokens.weight
                res["placements"] = str(w.placements)
                res["param_dtype"] = str(model._get_fsdp_state()._mp_policy.param_dtype)
            if case.get("refusals_only"):
                out[case["name"]] = res
                continue
            res["loss"] = _step(acc, model, opt, rank)
            ref = _reference(model)
            if case["version"] == 1:
                for kind in ("full", "local"):
                    p += _compare(list(export.iter_params(model, fsdp1_state_dict=kind)), ref,
                                  f"iter_params {kind}")
            else:
                res["unwrap_is_model"] = inner is model
                p += _compare(list(export.iter_params(model)), ref, "iter_params")
            bucketed = []       # (name, a copy): the shared-memory buffers go at once
            for b, flat in export.iter_buckets(model, BUCKET, fsdp1_state_dict="local"):
                bucketed += [(n, t.clone()) for n, t in bucket.unflatten(flat, b.entries)]
                del flat
            p += _compare(bucketed, ref, "iter_buckets")
            if not case.get("export_only"):
                # the full sync: manager -> engine, then the engine's tensors against torch's
                manager = FSDPShardingManager(model, engine, mesh=mesh,
                                              config=SyncConfig(bucket_bytes=BUCKET))
                with manager:
                    if engine is not None:
                        p += _compare(list(engine.named_full_tensors()), ref, "engine after sync")
                del manager
            res["loss_after"] = _step(acc, model, opt, rank)   # training goes on
            # what a user may hand over by mistake
            if case["version"] == 1:
                err = _refused(lambda: list(export.iter_params(inner)), "accelerator.prepare")
                if err:
                    p.append(f"unwrap_model after a step: {err}")
                unit = next(m for m in model.modules() if isinstance(m, FSDP) and m is not model)
            else:
                unit = next(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)
            err = _refused(lambda: list(export.iter_params(unit)), "pass the root")
            if err:
                p.append(f"inner unit {type(unit).__name__}: {err}")
            out[case["name"]] = res
            del model, opt, acc
    finally:
        if engine is not None:
            engine.shutdown()
    dist.barrier()
    return out
