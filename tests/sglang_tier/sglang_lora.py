"""SGLang's own LoRA code against fsdp_sync's adapter (``SyncConfig.lora="adapter"``) and the
reference engine's per-rank shard of it, on CPU. Run in the SGLang tier venv; prints JSON. A case
is ``[recipe, overrides, tp, r, lora_alpha, control, targets]`` (``control``: None, or a deliberate
fault in what SGLang is given, see `CONTROLS`, so the comparison is shown to fail; ``targets``:
the adapter's target modules, optional, default all seven linear layers).

Our side, as fsdp_sync sends an adapter to an engine: a tiny model with a LoRA adapter on all
seven linear layers (`cli.lora_model.add_lora`), its tensors from the real export
(`weights.adapter_export.AdapterExport` renamed by `lora_sync.peft_name`, what `lora_sync.sync_adapter`
hands to ``load_lora_adapter_from_tensors``) and its config dict (`lora_sync.adapter_config`);
the reference engine's `LoRAConfig.from_dict`, `check_adapter` and, per TP rank of the engine's
layout (`weights.layout.layout_for`), `shard_adapter`.

SGLang's side, with its own code (0.5.23, or 0.5.12 in `make test-sglang`'s second run):

1. ``LoRAConfig(config_dict=...)`` and ``LoRAAdapter(...).initialize_weights_from_tensors`` (its
   name parsing by ``get_layer_id``, ``normalize_qkv_proj`` / ``normalize_gate_up_proj`` stacking,
   ``scaling = lora_alpha / r``); ``get_normalized_target_modules`` of our config's
   ``target_modules`` and ``get_target_module_name`` of every weight the adapter holds (what the
   memory pool's pre-validation runs: a weight that matches no target is skipped there);
2. per TP rank, SGLang's model class built for that rank (`sglang_models.build`; 0.5.12 has no
   runtime context, so its parallel-state globals are set instead, `build_old`), its modules
   picked and wrapped as ``LoRAManager.init_lora_modules`` does (last name part in the normalized
   targets, inside a decoder layer; ``get_lora_layer``: QKVParallelLinearWithLoRA,
   MergedColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA; ``replace_submodule``), its
   ``LoRAMemoryPool`` with ``load_lora_weight_to_buffer`` of the adapter (which calls the layers'
   ``slice_lora_a_weights`` / ``slice_lora_b_weights`` and asserts its buffers' shapes), each
   layer's slices (equal to the pool's buffers) and output offsets (``set_lora_info``);
3. SGLang's delta of that module for a random input, its own torch kernels
   (``torch_ops.lora_ops.sgemm_lora_a_fwd`` / ``sgemm_lora_b_fwd``: scaling in the A product, one
   r-column block of A's output per output slice).

The comparison (`compare`) lists every difference: a tensor we send that is not in SGLang's adapter
weights (or one there we did not send), targets that differ, a scaling that differs from our
`LoRAConfig.scale`, per rank and module SGLang's sliced A / B blocks against our stacked A /
block-diagonal B (bit for bit, B's off-block entries zero) and the two deltas (float32,
``allclose(rtol=1e-6, atol=1e-6)``).

Stand-ins: the GPU-only imports `sglang_models` stubs; for 0.5.12 also ``sglang.srt.configs.qwen3_asr``
(it registers a config name the tier's transformers already has) and ``sglang.srt.function_call``
(its server args import it for parser choices; it needs ``openai``, not installed); and while the
LoRA layers and the pool are built and loaded, ``pin_memory`` (they ask for pinned host memory,
which a CPU-only torch has no allocator for; values unchanged).
Not run: the forward through ``forward_with_base`` and the GPU backends' kernels (triton, csgmv),
the scheduler and the HTTP route (the io_struct field is `test_real_sglang`'s).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import sglang_models  # the GPU-only imports' stand-ins, first (see its docstring)

_SGLANG = os.path.dirname(importlib.util.find_spec("sglang").origin)   # not imported yet
OLD = not os.path.exists(os.path.join(_SGLANG, "srt", "runtime_context.py"))
if OLD:
    # 0.5.12's sglang.srt.configs imports its own qwen3_asr config, whose registration the tier's
    # transformers refuses ("already used by a Transformers config"), and its server args import
    # the function-call parsers (openai, not installed) for their choices; nothing here uses them
    sglang_models.STUBS = sglang_models.STUBS + ("sglang.srt.configs.qwen3_asr", "sglang.srt.function_call")

import torch  # noqa: E402

# adapter tensor module -> (SGLang's stacked module, its slice): normalize_qkv_proj concatenates
# q, k, v and normalize_gate_up_proj gate, up (the block comparison checks the order bit for bit)
SLICE = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", 0)}
CONTROLS = ("alpha", "swap_kv", "dropped", "transposed")


@contextlib.contextmanager
def no_pinning():
    """``pin_memory`` as a no-op while SGLang's LoRA layers are built: their offset tensors ask
    for pinned host memory, which a CPU-only torch has no allocator for (values unchanged)."""
    real_tensor, real_pin = torch.tensor, torch.Tensor.pin_memory

    def tensor(*a, **k):
        k.pop("pin_memory", None)
        return real_tensor(*a, **k)

    torch.tensor, torch.Tensor.pin_memory = tensor, lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.pin_memory = real_tensor, real_pin


def build_old(cls, cfg, model_dir: str, tp: int, rank: int):
    """SGLang 0.5.12's model class for TP rank ``rank``: no runtime context there, its layers read
    the parallel state's group globals and dp_attention's attention-TP globals (stand-ins, as
    `sglang_models.build` publishes for 0.5.23) and the global server args."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path=model_dir, device="cpu", tp_size=tp,
                                                    skip_tokenizer_init=True, load_format="dummy"))
    for name in ("_TP", "_ATTN_TP", "_MOE_TP"):
        if hasattr(ps, name):
            setattr(ps, name, sglang_models._Group(tp, rank))
    for name in ("_PP", "_ATTN_CP", "_MOE_EP", "_MOE_DP"):
        if hasattr(ps, name):
            setattr(ps, name, sglang_models._Group(1, 0))
    for name, value in (("_ATTN_TP_RANK", rank), ("_ATTN_TP_SIZE", tp), ("_ATTN_DP_RANK", 0),
                        ("_ATTN_DP_SIZE", 1), ("_LOCAL_ATTN_DP_RANK", 0), ("_LOCAL_ATTN_DP_SIZE", 1),
                        ("_ENABLE_DP_ATTENTION_FLAG", False)):
        if hasattr(dpa, name):
            setattr(dpa, name, value)
    return cls(cfg)


def build(cfg, model_dir: str, tp: int, rank: int):
    cls = sglang_models.model_class(cfg.model_type)
    if OLD:
        return build_old(cls, cfg, model_dir, tp, rank)
    return sglang_models.build(cls, cfg, model_dir, tp, rank)


def our_adapter(recipe: str, ov: dict, r: int, alpha: float, targets: list | None = None):
    """The base config, the adapter's tensors and config dict exactly as `lora_sync.sync_adapter`
    hands them to an engine's ``load_lora_adapter_from_tensors``."""
    from fsdp_sync.cli.lora_model import ALL_LINEAR, add_lora
    from fsdp_sync.lora_sync import adapter_config, peft_name
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights.adapter_export import AdapterExport
    from fsdp_sync.weights.bucket import TensorMeta

    cfg = load_config(recipe, **ov)
    model = add_lora(build_model(cfg, seed=7).eval(), r, alpha, targets or ALL_LINEAR, seed=3)
    export = AdapterExport(peft_name)
    try:
        tensors = export.tensors(model, torch.float32)
        metas = [TensorMeta(e.name, e.dtype, e.shape) for e in export.bucket.entries]
        cfg_dict = adapter_config(model, None, metas=metas)
        tensors = {n: t.clone() for n, t in tensors.items()}
    finally:
        export.close()
    return cfg, tensors, cfg_dict


def mutate(control: str | None, tensors: dict, cfg_dict: dict) -> tuple[dict, dict]:
    """What SGLang is given under a negative control (ours is untouched)."""
    tensors, cfg_dict = dict(tensors), copy.deepcopy(cfg_dict)
    p = "base_model.model.model.layers.1."
    if control == "alpha":          # e.g. a config sent with rsLoRA's alpha / sqrt(r) folded in
        cfg_dict["lora_alpha"] = cfg_dict["lora_alpha"] * 2
    elif control == "swap_kv":      # k and v tensors under each other's names (GQA: same shapes)
        for ab in ("A", "B"):
            k, v = f"{p}self_attn.k_proj.lora_{ab}.weight", f"{p}self_attn.v_proj.lora_{ab}.weight"
            tensors[k], tensors[v] = tensors[v], tensors[k]
    elif control == "dropped":      # a name SGLang cannot place in a layer (it skips it silently)
        t = tensors.pop(f"{p}mlp.down_proj.lora_A.weight")
        tensors["base_model.model.model.down_proj.lora_A.weight"] = t
    elif control == "transposed":   # o_proj's B sent as [r, out] viewed back to [out, r]
        n = f"{p}self_attn.o_proj.lora_B.weight"
        tensors[n] = tensors[n].t().contiguous().view(tensors[n].shape)
    elif control == "rslora":       # peft's rsLoRA flag, which SGLang reads nowhere (we refuse it)
        cfg_dict["use_rslora"] = True
    elif control is not None:
        raise ValueError(f"control must be one of {CONTROLS} or None, got {control!r}")
    return tensors, cfg_dict


def expected_stacks(tensors: dict) -> dict:
    """What SGLang's adapter should hold of ``tensors``: per layer and lora_A / lora_B, q, k, v and
    gate, up concatenated in that order (an untargeted k or up as zeros of v's / gate's shape, as
    its normalize_* fill them), o and down as sent; a stack without its q / gate is left as sent
    (SGLang stacks only from q_proj / gate_proj)."""
    groups: dict = {}
    for name, t in tensors.items():
        _, module, _ = ref_lora().hf_weight_of(name)
        stacked = SLICE[module][0]
        groups.setdefault(name.replace(f".{module}.", f".{stacked}."), {})[module] = (name, t)
    out = {}
    for stacked_name, parts in groups.items():
        order = sorted((m for m in SLICE if f".{SLICE[m][0]}." in stacked_name), key=lambda m: SLICE[m][1])
        head, partner = order[0], {"k_proj": "v_proj", "up_proj": "gate_proj"}
        if head not in parts:
            out.update({n: t for n, t in parts.values()})
            continue
        out[stacked_name] = torch.cat([parts[m][1] if m in parts else torch.zeros_like(parts[partner[m]][1])
                                       for m in order], 0)
    return out


def ref_lora():
    from fsdp_sync.engines.reference import lora

    return lora


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def wrap_and_load(model, rank: int, tp: int, cfg, adapter, normalized: set, r: int, stats: dict,
                  problems: list) -> tuple[dict, object]:
    """SGLang's LoRA layers on ``model`` as ``LoRAManager.init_lora_modules`` sets them (modules
    whose last name part is a normalized target, inside a decoder layer: ``get_lora_layer``,
    ``replace_submodule``), then its ``LoRAMemoryPool`` (one slot, ``max_lora_rank`` r) and
    ``load_lora_weight_to_buffer`` of ``adapter`` into slot 0 (which slices each weight with the
    layer's slice methods and asserts the buffers' shapes). ``({name: (base, lora layer)}, pool)``;
    pool None (and the problem named) where SGLang's pool raised."""
    from sglang.srt.layers.utils import get_layer_id
    from sglang.srt.lora.layers import get_lora_layer
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.utils.common import replace_submodule

    wrapped, per_layer = {}, [{} for _ in range(cfg.num_hidden_layers)]
    with no_pinning():
        for name, module in list(model.named_modules()):
            layer_id = get_layer_id(name)
            if name.split(".")[-1] in normalized and layer_id is not None:
                lm = get_lora_layer(module, None)
                replace_submodule(model, name, lm)
                wrapped[name], per_layer[layer_id][name] = (module, lm), lm
        args = {"base_hf_config": cfg, "max_loras_per_batch": 1, "dtype": torch.float32, "tp_size": tp,
                "tp_rank": rank, "max_lora_rank": r, "target_modules": set(normalized), "base_model": model,
                "eviction_policy": "lru", "lora_added_tokens_size": 0}
        params = inspect.signature(LoRAMemoryPool.__init__).parameters
        try:
            pool = LoRAMemoryPool(**{k: v for k, v in args.items() if k in params})
            pool.load_lora_weight_to_buffer("fsdp_sync", 0, adapter, per_layer, None, None)
        except Exception as exc:  # noqa: BLE001 - SGLang's own refusal, reported
            stats.setdefault("pool_raised", []).append(f"{type(exc).__name__}: {exc}")
            problems.append(f"rank {rank}: SGLang's memory pool raised {type(exc).__name__}: {exc}")
            pool = None
    return wrapped, pool


def layer_rank(module) -> tuple:
    """A built layer's own (TP rank, TP size): 0.5.23 reads them from its group (None: unsharded),
    0.5.12 keeps them as attributes."""
    if hasattr(module, "tp_group"):
        g = module.tp_group
        return (0, 1) if g is None else (g.rank_in_group, g.world_size)
    return module.tp_rank, module.tp_size


def _call(method, tensor, rank):
    """0.5.12's slice methods take the TP rank; 0.5.23's read it from the layer's group."""
    if "tp_rank" in inspect.signature(method).parameters:
        return method(tensor, rank)
    return method(tensor)


def compare(recipe: str, ov: dict, tp: int, r: int, alpha: float, control: str | None,
            targets: list | None = None) -> dict:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.layers.utils import get_layer_id
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig as SGLoRAConfig
    from sglang.srt.lora.torch_ops.lora_ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd
    from sglang.srt.lora.utils import get_normalized_target_modules, get_stacked_multiply, get_target_module_name

    from fsdp_sync.engines.reference import lora as ref
    from fsdp_sync.weights.layout import layout_for

    cfg, tensors, cfg_dict = our_adapter(recipe, ov, r, alpha, targets)
    theirs_in, their_cfg = mutate(control, tensors, cfg_dict)
    problems: list[str] = []
    stats: dict = {"sent": sorted(tensors), "config": cfg_dict}

    # ours: the reference engine's config and check (a config it refuses: SGLang's side only)
    try:
        ours_cfg = ref.LoRAConfig.from_dict(copy.deepcopy(cfg_dict))
    except ValueError as exc:
        ours_cfg, stats["ours_refused"] = None, str(exc)
    layout = layout_for(cfg, tp)
    pairs = ref.check_adapter(layout, ours_cfg, tensors.items()) if ours_cfg is not None else None

    # SGLang: its config and adapter (base_model: the rank-0 model, as its manager passes it)
    model_dir = tempfile.mkdtemp(prefix="fsdp_sync_sgl_lora_")
    cfg.architectures = [sglang_models.CLASSES[cfg.model_type][1]]
    cfg.save_pretrained(model_dir)
    models = [build(cfg, model_dir, tp, rank) for rank in range(tp)]
    s_cfg = SGLoRAConfig(config_dict=their_cfg)
    kw = {"base_model": models[0]} if "base_model" in inspect.signature(LoRAAdapter.__init__).parameters else {}
    adapter = LoRAAdapter("fsdp_sync", s_cfg, cfg, LoadConfig(), None, **kw)
    try:
        adapter.initialize_weights_from_tensors(dict(theirs_in))
    except Exception as exc:  # noqa: BLE001 - SGLang's own refusal of the adapter, reported
        stats["sglang_raised"] = f"{type(exc).__name__}: {exc}"
        problems.append(f"SGLang's initialize_weights_from_tensors raised {stats['sglang_raised']}")
        return {"problems": problems, "stats": stats}
    held = {n: t for layer in adapter.layers for n, t in layer.weights.items()}
    stats["sglang_weights"] = {n: list(t.shape) for n, t in sorted(held.items())}
    stats["sglang_other"] = sorted(adapter.embedding_layers) + sorted(adapter.added_tokens_embeddings)

    # names: every tensor we send is, bit for bit, where SGLang's stacking puts it, nothing else is
    want = expected_stacks(tensors)
    for n in sorted(set(want) - set(held)):
        problems.append(f"names: SGLang's adapter holds no {n!r}")
    for n in sorted(set(held) - set(want)):
        problems.append(f"names: SGLang's adapter holds {n!r}, which is not one of ours stacked")
    for n in sorted(set(want) & set(held)):
        if not _same(held[n], want[n]):
            problems.append(f"names: SGLang's {n!r} {list(held[n].shape)} is not our tensors stacked "
                            f"{list(want[n].shape)}")
    if stats["sglang_other"]:
        problems.append(f"names: SGLang put {stats['sglang_other']} outside the decoder layers")

    # targets: SGLang's normalized targets of our config, and where its memory pool puts each weight
    normalized = get_normalized_target_modules(s_cfg.target_modules)
    stats["normalized_targets"] = sorted(normalized)
    ours_targets = sorted({SLICE[m][0] for m in ours_cfg.target_modules}) if ours_cfg else sorted(normalized)
    if sorted(normalized) != ours_targets:
        problems.append(f"targets: SGLang normalizes {s_cfg.target_modules} to {sorted(normalized)}, "
                        f"our engine's modules are {ours_targets}")
    matched, stats["sglang_unplaced"] = set(), []
    for n in sorted(held):
        try:
            matched.add(get_target_module_name(n, normalized))
        except ValueError:      # its memory pool warns (or raises) and then raises loading it
            stats["sglang_unplaced"].append(n)
    if stats["sglang_unplaced"]:
        problems.append(f"targets: SGLang's memory pool cannot place {stats['sglang_unplaced'][:2]}... "
                        f"in {sorted(normalized)}")
    if matched != normalized:
        problems.append(f"targets: SGLang's weights match {sorted(matched)} of {sorted(normalized)}")
    if ours_cfg is None:
        return {"problems": problems, "stats": stats}

    # scaling
    stats["scaling"] = [adapter.scaling, ours_cfg.scale]
    if adapter.scaling != ours_cfg.scale:
        problems.append(f"scaling: SGLang's lora_alpha / r = {adapter.scaling!r}, our engine's "
                        f"LoRAConfig.scale = {ours_cfg.scale!r}")

    # per TP rank: SGLang's slices of its layers against our shard, and the two deltas
    g = torch.Generator().manual_seed(11)
    modules_checked, classes, worst, ranks_seen, pool_same = 0, set(), 0.0, set(), 0
    for rank, model in enumerate(models):
        shard = ref.shard_adapter(layout, rank, "fsdp_sync", ours_cfg, pairs, torch.float32)
        seen_engine = set()
        wrapped, pool = wrap_and_load(model, rank, tp, cfg, adapter, normalized, r, stats, problems)
        for module_name, (module, lm) in wrapped.items():
            layer_id = get_layer_id(module_name)
            classes.add(f"{type(lm).__name__}({type(module).__name__})")
            ranks_seen.add((rank, *layer_rank(module)))
            target = get_target_module_name(module_name, normalized)
            ws = {("A" if "lora_A" in n else "B"): t for n, t in adapter.layers[layer_id].weights.items()
                  if n not in stats["sglang_unplaced"] and get_target_module_name(n, normalized) == target}
            engine = f"{module_name}.weight"
            where = f"rank {rank} {module_name}"
            if engine not in shard.mats:
                problems.append(f"{where}: our shard has no {engine!r} (has {sorted(shard.mats)[:3]}...)")
                continue
            seen_engine.add(engine)
            if set(ws) != {"A", "B"}:
                problems.append(f"{where}: SGLang's adapter has {sorted(ws)} of lora_A / lora_B")
                continue
            a_s = _call(lm.slice_lora_a_weights, ws["A"], rank)
            b_s = _call(lm.slice_lora_b_weights, ws["B"], rank)
            if pool is not None:     # what its memory pool copied into its buffers: these slices
                c = get_stacked_multiply(target)
                a_p, b_p = pool.A_buffer[target][layer_id][0, :c * r], pool.B_buffer[target][layer_id][0, :, :r]
                pool_same += 1
                if not (_same(a_p, a_s.to(a_p.dtype)) and _same(b_p, b_s.to(b_p.dtype))):
                    problems.append(f"{where}: SGLang's memory pool buffers differ from its layer's slices")
            with no_pinning():
                lm.set_lora_info(a_s[None].contiguous(), b_s[None].contiguous())
                offsets = [int(v) for v in lm.output_offset_cpu.tolist()]
            a_o, b_o = shard.mats[engine]
            c, k = get_stacked_multiply(target), len(shard.pieces[engine])
            if tuple(a_s.shape) != (c * r, a_o.shape[1]) or tuple(b_s.shape) != (b_o.shape[0], r) \
                    or len(offsets) != c + 1 or offsets[-1] != b_o.shape[0] or a_o.shape[0] != k * r:
                problems.append(f"{where}: shapes: SGLang A {list(a_s.shape)} B {list(b_s.shape)} offsets "
                                f"{offsets} (c={c}), ours A {list(a_o.shape)} B {list(b_o.shape)} ({k} blocks)")
                continue
            diag = torch.zeros_like(b_o, dtype=torch.bool)
            untargeted = set(range(c))
            for weight, j, _src, dst in shard.pieces[engine]:
                mod = weight.split(".")[-2]
                s = SLICE[mod][1]
                rows = dst[0].indices(b_o.shape[0])[:2]
                if rows != (offsets[s], offsets[s + 1]):
                    problems.append(f"{where} {mod}: our output rows {rows}, SGLang's slice {s} "
                                    f"{(offsets[s], offsets[s + 1])}")
                    continue
                if not _same(a_s[s * r:(s + 1) * r], a_o[j * r:(j + 1) * r]):
                    problems.append(f"{where} {mod}: lora_A block differs (SGLang slice {s}, ours block {j})")
                if not _same(b_s[offsets[s]:offsets[s + 1]], b_o[rows[0]:rows[1], j * r:(j + 1) * r]):
                    problems.append(f"{where} {mod}: lora_B block differs (SGLang rows {offsets[s]}:"
                                    f"{offsets[s + 1]}, ours block {j})")
                diag[rows[0]:rows[1], j * r:(j + 1) * r] = True
                untargeted.discard(s)
            # a slice the adapter does not target (k of q/v only): SGLang stacks zeros there (its
            # normalize_* zeros_like), our shard has no block for it
            for s in sorted(untargeted):
                if a_s[s * r:(s + 1) * r].any() or b_s[offsets[s]:offsets[s + 1]].any():
                    problems.append(f"{where}: SGLang's slice {s}, which the adapter does not target, is not zero")
            if b_o[~diag].any():
                problems.append(f"{where}: our B_fused has nonzero entries off its diagonal blocks")
            # the delta: SGLang's kernels (per slice) against our LoRAShard.apply
            x = torch.randn(5, a_o.shape[1], generator=g)
            one, n = torch.tensor([0]), torch.tensor([x.shape[0]])
            scal = torch.tensor([adapter.scaling], dtype=torch.float)
            a_out = sgemm_lora_a_fwd(x, a_s[None].contiguous(), one, n, torch.tensor([r]), scal, num_slices=c)
            d_s = sgemm_lora_b_fwd(a_out, b_s[None].contiguous(), one, n, torch.tensor([r]),
                                   torch.tensor(offsets, dtype=torch.int32))
            d_o = shard.apply(engine, x, torch.zeros(x.shape[0], b_o.shape[0]), None)
            err = float((d_s - d_o).abs().max())
            worst = max(worst, err)
            if not torch.allclose(d_s, d_o, rtol=1e-6, atol=1e-6):
                problems.append(f"{where}: delta differs (max abs {err:.3g}, |delta| max {float(d_o.abs().max()):.3g})")
            modules_checked += 1
        missing = sorted(set(shard.mats) - seen_engine)
        if missing:
            problems.append(f"rank {rank}: our shard has {missing} that SGLang's model has no LoRA layer for")
    stats.update(modules_checked=modules_checked, classes=sorted(classes), max_delta_diff=worst,
                 layer_ranks=sorted(ranks_seen), pool_compared=pool_same)
    return {"problems": problems, "stats": stats}


def main(cases: list) -> dict:
    import sglang

    out = {"version": sglang.__version__}
    torch.manual_seed(0)
    for case in cases:
        recipe, ov, tp, r, alpha, control = case[:6]
        targets = case[6] if len(case) > 6 else None
        key = f"{recipe}|{json.dumps(ov, sort_keys=True)}|{tp}|{r}|{alpha}|{control}|{','.join(targets or ['all'])}"
        try:
            out[key] = compare(recipe, ov, tp, r, alpha, control, targets)
        except Exception as exc:  # noqa: BLE001 - reported: a control may make SGLang's own code raise
            out[key] = {"raised": f"{type(exc).__name__}: {exc}"}
    return out


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    scratch = sglang_models.scratch_tempdir()
    result = main(cases)
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
    scratch.cleanup()
    os._exit(0)   # SGLang leaves non-daemon threads behind
