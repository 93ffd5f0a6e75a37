"""What each trainer rank of the verl tier runs (importable by spawned processes)."""

from __future__ import annotations

import asyncio

import torch
import torch.distributed as dist


def verl_generator(module):
    """verl 0.9.1's ``FSDPEngine.get_per_tensor_param`` for an FSDP2 module without LoRA: the
    state dict's DTensors, each ``full_tensor()``-ed lazily as the consumer asks (every rank must
    iterate it: each step is an all-gather)."""
    from torch.distributed.tensor import DTensor

    params = module.state_dict()
    return ((name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in params.items())


def sync_ranks(rank: int, world: int, rollout_cfg: dict, strategies: list[str], batch_check: bool):
    """Build verl's rollout adapter as its worker does, sync an FSDP2 tiny Qwen2 into the served
    engine once per strategy (weights changed in between), and return per-sync stats and the
    checksum of the full weights each sync sent."""
    import verl  # noqa: F401  (loads the plug-in, as every verl worker does)
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.manual_seed(0)
    model = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    rollout_config: RolloutConfig = omega_conf_to_dataclass(OmegaConf.create(rollout_cfg))
    # verl's ActorRolloutRefWorker.init_model, step 3.1-3.2
    infer_tp = rollout_config.tensor_model_parallel_size * rollout_config.data_parallel_size
    infer_pp = rollout_config.pipeline_model_parallel_size
    dp = world // (infer_tp * infer_pp)
    mesh = init_device_mesh("cpu", mesh_shape=(dp, infer_tp, infer_pp),
                            mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    rollout_cls = get_rollout_class(rollout_config.name, rollout_config.mode)
    out = {"class": f"{rollout_cls.__module__}.{rollout_cls.__qualname__}", "syncs": []}
    for step, strategy in enumerate(strategies):
        cfg = dict(rollout_cfg)
        cfg["custom"] = {"fsdp_sync": dict(rollout_cfg["custom"]["fsdp_sync"], strategy=strategy)}
        rollout = rollout_cls(config=omega_conf_to_dataclass(OmegaConf.create(cfg)),
                              model_config=None, device_mesh=mesh)
        out["adapter"] = type(rollout).__name__
        with torch.no_grad():      # new weights every sync (same change on every rank)
            for p in model.parameters():
                p.mul_(1.0 + 0.25 * (step + 1))
        full = [(n, t.clone()) for n, t in verl_generator(model)]
        checksum = checksum_named_tensors(full) if rank == 0 else None

        async def one_sync():   # verl's update_weights(mode="naive") order
            await rollout.resume(tags=["weights"])
            metrics = await rollout.update_weights(verl_generator(model), global_steps=step,
                                                   peft_config=None, base_sync_done=True)
            await asyncio.to_thread(dist.barrier)
            await rollout.resume(tags=["kv_cache"])
            return metrics

        metrics = asyncio.run(one_sync())
        mismatched = version = None
        if rank == 0:   # read every weight back over HTTP (float32 survives JSON exactly)
            from fsdp_sync.engines.sglang import SGLangEngine

            fs = rollout_cfg["custom"]["fsdp_sync"]
            client = SGLangEngine(base_url=fs["base_url"], api_key=fs.get("api_key"), tp_size=2)
            mismatched = [n for n, t in full
                          if not client.get_weights_by_name(n).view(torch.int32).equal(
                              t.view(torch.int32))]
            version = client.get_weight_version()
        del full
        out["syncs"].append({"strategy": strategy, "checksum": checksum, "metrics": metrics,
                             "stats": rollout.last_stats, "mismatched": mismatched,
                             "version": version})
        dist.barrier()
    # a refused bucket (bf16 into a float32 engine) raises the same error on every rank
    cfg = dict(rollout_cfg)
    cfg["custom"] = {"fsdp_sync": dict(rollout_cfg["custom"]["fsdp_sync"], dtype="bfloat16")}
    rollout = rollout_cls(config=omega_conf_to_dataclass(OmegaConf.create(cfg)), model_config=None,
                          device_mesh=mesh)
    try:
        asyncio.run(rollout.update_weights(verl_generator(model), global_steps=99))
        out["refused"] = None
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks it
        out["refused"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    # an actor whose model config has other math than the served model's (rope theta): refused at
    # the first sync on every rank, before any byte moves
    from types import SimpleNamespace

    rollout = rollout_cls(config=omega_conf_to_dataclass(OmegaConf.create(rollout_cfg)),
                          model_config=SimpleNamespace(hf_config=load_config("tiny", rope_theta=1e6)),
                          device_mesh=mesh)
    out["config_refused"] = []
    for step in (100, 101):     # refused again on a retry: a refusal does not count as checked
        try:
            asyncio.run(rollout.update_weights(verl_generator(model), global_steps=step))
            out["config_refused"].append(None)
        except Exception as exc:  # noqa: BLE001 - returned to the test, which checks it
            out["config_refused"].append(f"{type(exc).__name__}: {exc}")
    dist.barrier()
    if batch_check:
        out["dataproto"] = dataproto_roundtrip(rank, mesh, rollout_cfg)
    return out


def dataproto_roundtrip(rank: int, rollout_mesh, rollout_cfg: dict) -> dict:
    """verl's DataProto through the manager's preprocess_data / postprocess_data on infer_tp."""
    from verl import DataProto

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import make_mesh

    mesh = make_mesh(1, dist.get_world_size())
    engine = (SGLangEngine(base_url=rollout_cfg["custom"]["fsdp_sync"]["base_url"], tp_size=2,
                           api_key=rollout_cfg["custom"]["fsdp_sync"].get("api_key"))
              if rank == 0 else None)
    mgr = FSDPShardingManager(torch.nn.Linear(2, 2), engine, mesh=mesh,
                              config=SyncConfig(memory_probe="off"))
    ids = torch.arange(6).reshape(3, 2) + 100 * rank
    batch = DataProto.from_dict(tensors={"input_ids": ids},
                                non_tensors={"uid": [f"r{rank}-{i}" for i in range(3)]},
                                meta_info={"step": 7})
    full = mgr.preprocess_data(batch)
    back = mgr.postprocess_data(full)
    return {"full_ids": full.batch["input_ids"].tolist(), "full_uid": list(full.non_tensor_batch["uid"]),
            "back_equal": bool(back.batch["input_ids"].equal(ids))
            and list(back.non_tensor_batch["uid"]) == [f"r{rank}-{i}" for i in range(3)],
            "meta": back.meta_info}


def sync_fp8(rank: int, world: int, rollout_cfg: dict):
    """verl's adapter with ``rollout.quantization=fp8``: an FSDP2 tiny-fp8 Qwen2 synced into an
    FP8 engine (verify full: the engine's digests of what it serves against what was sent);
    returns the adapter's stats and, on rank 0, the trainer's q_proj / down_proj weights quantized
    (the FP8 bytes as uint8, the scales) for the test to compare with what the engine serves."""
    import types

    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import fp8

    cfg = load_config("tiny-fp8")
    model = wrap_fsdp(build_model(cfg, seed=3), 2)
    rollout_config = omega_conf_to_dataclass(OmegaConf.create(rollout_cfg))
    mesh = init_device_mesh("cpu", mesh_shape=(1, world, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    rollout = get_rollout_class(rollout_config.name, rollout_config.mode)(
        config=rollout_config, model_config=types.SimpleNamespace(hf_config=cfg), device_mesh=mesh)
    full = [(n, t.clone()) for n, t in verl_generator(model)]
    asyncio.run(rollout.update_weights(verl_generator(model), global_steps=1))
    out = {"stats": {k: v for k, v in rollout.last_stats.items() if k != "digests"}}
    if rank == 0:    # what the engine must serve: the trainer's weights quantized (fp8 as its bytes)
        out["want"] = {}
        for n, t in full:
            if n.endswith(("q_proj.weight", "down_proj.weight")):
                q, s = fp8.quantize_block(n, t)
                out["want"][n] = (q.view(torch.uint8).clone(), s)
    dist.barrier()
    return out


def _adapter(rank: int, world: int, rollout_cfg: dict, model_config=None):
    """fsdp_sync's adapter, built as verl's worker builds it, on a (1, world, 1) mesh."""
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    config = omega_conf_to_dataclass(OmegaConf.create(rollout_cfg))
    mesh = init_device_mesh("cpu", mesh_shape=(1, world, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    return get_rollout_class(config.name, config.mode)(config=config, model_config=model_config,
                                                       device_mesh=mesh), mesh


def _tiny_stream(step: int):
    """The tiny Qwen2's weights scaled per step, each after a collective (verl's export does one)."""
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config("tiny"), seed=0)
    for name, t in model.state_dict().items():
        dist.all_reduce(torch.ones(1))
        yield name, (t * (1.0 + 0.125 * step)).contiguous()


def mixed_group(rank: int, world: int, rollout_cfg: dict, ours_at: int):
    """Infer-TP rank ``ours_at`` runs fsdp_sync's adapter; the other runs what verl's own SGLang
    adapter does with its first bucket: pull verl's export (a collective per tensor), then
    SGLang 0.5.x's ``weight_sync.utils.update_weights``: one ``gather_object`` of
    ``[(name, serialized handle)]`` to the group's first rank. Returns each rank's error text
    (None: no error) and the seconds it took."""
    import time

    t0 = time.monotonic()
    return _mixed_group(rank, world, rollout_cfg, ours_at), time.monotonic() - t0


def _mixed_group(rank: int, world: int, rollout_cfg: dict, ours_at: int):
    if rank == ours_at:
        adapter, _ = _adapter(rank, world, rollout_cfg)
        try:
            asyncio.run(adapter.update_weights(_tiny_stream(1), global_steps=1))
            return None
        except Exception as exc:  # noqa: BLE001 - returned to the test
            return f"{type(exc).__name__}: {exc}"
    import verl  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape=(1, world, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    tp = mesh["infer_tp"]
    try:
        named = [(name, f"<serialized ipc handle of {name}>") for name, _ in _tiny_stream(1)]
        gathered = [None] * world if tp.get_local_rank() == 0 else None
        dist.gather_object(obj=named, object_gather_list=gathered, dst=tp.mesh.tolist()[0],
                           group=tp.get_group())
        return None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return f"{type(exc).__name__}: {exc}"


def verify_on_sglang(rank: int, world: int, rollout_cfg: dict, modes: list[str]):
    """fsdp_sync's adapter into an SGLang server (the test's stand-in, /weights_checker hashing
    each TP rank's own parameters), one sync per verify mode; returns per sync the adapter's stats
    (digests left out) or the error text."""
    import types

    from fsdp_sync.models import load_config

    out = []
    for step, mode in enumerate(modes):
        cfg = dict(rollout_cfg)
        cfg["custom"] = {"fsdp_sync": dict(rollout_cfg["custom"]["fsdp_sync"], verify=mode)}
        adapter, _ = _adapter(rank, world, cfg,
                              model_config=types.SimpleNamespace(hf_config=load_config("tiny")))
        try:
            asyncio.run(adapter.update_weights(_tiny_stream(step), global_steps=step))
            out.append({k: v for k, v in adapter.last_stats.items() if k != "digests"})
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out.append(f"{type(exc).__name__}: {exc}")
        dist.barrier()
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft_stream(step: int, *, base: bool):
    """What verl 0.9.1's FSDP worker hands the rollout for a LoRA run (``lora.merge=false``):
    ``base``: the base weights with peft's ``.base_layer.`` on every targeted linear weight
    (``replace_lora_wrapper``); else the adapter, ``get_peft_model_state_dict``'s names, full
    tensors (B nonzero, new every step). Each item after a collective, as verl's export."""
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config("tiny"), seed=0)
    g = torch.Generator().manual_seed(100 + step)
    for name, t in model.state_dict().items():
        dist.all_reduce(torch.ones(1))
        parts = name.split(".")
        targeted = name.endswith(".weight") and len(parts) > 3 and parts[-2] in LORA_TARGETS
        if base:
            yield (name[:-len(".weight")] + ".base_layer.weight" if targeted else name), t
        elif targeted:
            stem = "base_model.model." + name[:-len(".weight")]
            yield f"{stem}.lora_A.weight", torch.randn(4, t.shape[1], generator=g) * 0.1
            yield f"{stem}.lora_B.weight", torch.randn(t.shape[0], 4, generator=g) * 0.1


# verl's peft config dict (``LoraConfig.to_dict()``): target_modules as peft resolves "all-linear",
# a set of module paths
PEFT_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
               "target_modules": {f"model.layers.{i}.{'mlp' if m in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{m}"
                                  for i in range(2) for m in LORA_TARGETS},
               "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
               "layers_pattern": None}


def lora_syncs(rank: int, world: int, rollout_cfg: dict):
    """verl's LoRA-as-adapter order through fsdp_sync's adapter: the base (``base_sync_done=False``),
    then the adapter at steps 0, 1, 2 (``base_sync_done=True``), with verl's peft config dict; then
    a sync without a ``peft_config`` (verl's checkpoint-engine modes). Returns per call the stats
    (digests left out) or the error text, and on rank 0 the adapter tensors of the last step."""
    import types

    from fsdp_sync.models import load_config

    model_config = types.SimpleNamespace(hf_config=load_config("tiny"), lora_rank=4, lora={},
                                         target_modules="all-linear")
    adapter, _ = _adapter(rank, world, rollout_cfg, model_config=model_config)
    out = {"sleep_level": adapter.sleep_level, "syncs": []}

    def run(stream, **kw):
        try:
            asyncio.run(adapter.update_weights(stream, **kw))
            out["syncs"].append({k: v for k, v in adapter.last_stats.items() if k != "digests"})
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out["syncs"].append(f"{type(exc).__name__}: {exc}")
        dist.barrier()

    run(_peft_stream(0, base=True), global_steps=0, peft_config=PEFT_CONFIG, base_sync_done=False)
    for step in (0, 1, 2):
        run(_peft_stream(step, base=False), global_steps=step, peft_config=PEFT_CONFIG,
            base_sync_done=True)
    run(_peft_stream(3, base=True), global_steps=3)
    last = dict(_peft_stream(2, base=False))      # every rank: the stream's collectives
    if rank == 0:
        out["adapter"] = last
    return out


def adapter_only_first(rank: int, world: int, rollout_cfg: dict, actor_overrides: dict):
    """verl's adapter-only sync (``base_sync_done=True``) as a new adapter's first call (no base
    sync checked the served model yet), the actor's HF config tiny's with ``actor_overrides``;
    then the same call again. Returns per call the stats (digests left out) or the error text."""
    import types

    from fsdp_sync.models import load_config

    hf = load_config("tiny")
    for k, v in actor_overrides.items():
        setattr(hf, k, v)
    model_config = types.SimpleNamespace(hf_config=hf, lora_rank=4, lora={}, target_modules="all-linear")
    adapter, _ = _adapter(rank, world, rollout_cfg, model_config=model_config)
    out = []
    for step in (0, 1):
        try:
            asyncio.run(adapter.update_weights(_peft_stream(step, base=False), global_steps=step,
                                               peft_config=PEFT_CONFIG, base_sync_done=True))
            out.append({k: v for k, v in adapter.last_stats.items() if k != "digests"})
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out.append(f"{type(exc).__name__}: {exc}")
        dist.barrier()
    return out


def refused_before_sending(rank: int, world: int, configs: list[dict]):
    """One sync per rollout config into an SGLang server (the test's stand-in), each of a tiny
    model whose ``model_type`` rides along: ``(rollout_cfg, model_type, config name[, update_weights
    keywords])``. Returns
    per sync the adapter's stats (digests left out) or the error text."""
    import types

    from fsdp_sync.models import build_model, load_config

    out = []
    for step, (rollout_cfg, model_type, name, *kw) in enumerate(configs):
        hf = load_config(name, model_type=model_type)
        weights = build_model(hf, seed=7).state_dict()
        adapter, _ = _adapter(rank, world, rollout_cfg, model_config=types.SimpleNamespace(hf_config=hf))
        try:
            asyncio.run(adapter.update_weights(iter(list(weights.items())), global_steps=step,
                                               **(kw[0] if kw else {})))
            out.append({k: v for k, v in adapter.last_stats.items() if k != "digests"})
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out.append(f"{type(exc).__name__}: {exc}")
        dist.barrier()
    return out


def sync_fp8_tiny(rank: int, world: int, rollout_cfg: dict, model_type: str, quantization_config):
    """verl's adapter (rollout.quantization=fp8) syncing a plain tiny-fp8 model of ``model_type``
    whose ``hf_config.quantization_config`` is ``quantization_config`` (None: none), with the
    environment the test gave (``SGLANG_FP8_IGNORED_LAYERS``); returns the adapter's stats."""
    import types

    from fsdp_sync.models import build_model, load_config

    hf = load_config("tiny-fp8", model_type=model_type)
    if quantization_config is not None:
        hf.quantization_config = quantization_config
    model = build_model(hf, seed=7)
    rollout, _ = _adapter(rank, world, rollout_cfg, types.SimpleNamespace(hf_config=hf))
    asyncio.run(rollout.update_weights(((n, t.detach().clone()) for n, t in model.state_dict().items()),
                                       global_steps=1))
    return {k: v for k, v in rollout.last_stats.items() if k != "digests"}


def sync_named(rank: int, world: int, rollout_cfg: dict, named: list, hf_config=None):
    """verl's adapter syncing ``named`` (a list of ``(name, tensor)``, as verl's stream hands it)
    once; returns the adapter's stats."""
    import types

    rollout, _ = _adapter(rank, world, rollout_cfg, types.SimpleNamespace(hf_config=hf_config))
    asyncio.run(rollout.update_weights(iter(named), global_steps=1))
    return {k: v for k, v in rollout.last_stats.items() if k != "digests"}


def replica_adapter(rank: int, world: int, cfg: dict, urls: list):
    """fsdp_sync's adapter of trainer rank ``rank`` as its own replica (a (dp=world, infer_tp=1)
    mesh, as verl builds it for rollout TP 1) on the server ``urls[rank]``; replica 0's engine
    refuses its second bucket (the one-replica-fails tests)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_sync.engines.sglang import SGLangEngine

    if rank == 0:
        calls = []
        original = SGLangEngine.update_weights_from_tensor

        def refusing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("replica 0's engine refused its second bucket")
            return original(self, *args, **kwargs)
        SGLangEngine.update_weights_from_tensor = refusing
    cfg = dict(cfg, custom={"fsdp_sync": dict(cfg["custom"]["fsdp_sync"], base_url=urls[rank])})
    adapter, _ = _adapter(rank, world, cfg)
    adapter.device_mesh = init_device_mesh("cpu", mesh_shape=(world, 1, 1),
                                           mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    return adapter
