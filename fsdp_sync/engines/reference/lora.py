"""LoRA adapters in the reference engine: the adapter's config, its tensor names, and one TP
rank's shard of it, laid out the way the rank's fused linear layers apply it.

An adapter is what peft saves (and SGLang's ``load_lora_adapter_from_tensors`` takes): a config
dict (``r``, ``lora_alpha``, ``target_modules``, ...) and full tensors named
``[base_model.model.]model.layers.{i}.{self_attn|mlp}.{module}.lora_A[.{adapter}].weight`` (``[r,
in]``) and ``...lora_B...`` (``[out, r]``). A module's output becomes ``W x + scale * B A x`` with
``scale = lora_alpha / r`` (peft's and SGLang's scaling).

TP sharding follows the base weight's own placement (`weights.layout.TPLayout.placements`): in a
column-parallel layer (``qkv_proj``, ``gate_up_proj``) B is split as the weight's output rows are
and A is whole; in a row-parallel layer (``o_proj``, ``down_proj``) A is split as the weight's input
columns are and B is whole, so each rank's ``B (A_r x_r)`` is a partial sum that the layer's own
all-reduce completes. The targets a fused layer holds (q, k, v) are stacked: A's rows one block per
target, B block-diagonal (zeros elsewhere, so each output row takes only its own target's B).

Not here: moving tensors (the engine's payloads, `update_items`), the forward (`tp_model` calls
`LoRAShard.apply`), which adapter a request uses (`generation`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from ...weights.bucket import copy_many
from ...weights.peft_names import unserved_option

__all__ = ["TARGETS", "LoRAConfig", "hf_weight_of", "check_adapter", "shard_adapter", "LoRAShard",
           "unshard_pieces"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers an adapter may target (peft's "all-linear" on these decoders, lm_head aside)."""

_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<prefix>model\.layers\.\d+\.(?:self_attn|mlp)\.)"
                   r"(?P<module>[a-z_]+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight$")


@dataclass(frozen=True)
class LoRAConfig:
    """The parts of a peft ``LoraConfig`` dict the engine uses; anything it cannot serve exactly
    (an option of `peft_names.UNSERVED`: DoRA, rsLoRA, LoRA biases, extra saved modules, ...;
    trained biases; a ``rank_pattern`` / ``alpha_pattern`` entry other than ``r`` /
    ``lora_alpha``) is refused by name. ``layers_to_transform`` / ``exclude_modules`` /
    ``layers_pattern`` only choose which layers hold tensors: served as given."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r

    @classmethod
    def from_dict(cls, d: Any) -> "LoRAConfig":
        if not isinstance(d, dict):
            raise ValueError(f"config_dict must be a dict (a peft LoraConfig's to_dict()), got {type(d).__name__}")
        peft_type = d.get("peft_type", "LORA")
        if str(getattr(peft_type, "value", peft_type)).upper() != "LORA":
            raise ValueError(f"config_dict peft_type must be 'LORA', got {peft_type!r}")
        r = d.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"config_dict r must be an int >= 1, got {r!r}")
        alpha = d.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"config_dict lora_alpha must be a finite number, got {alpha!r}")
        why = unserved_option(d)
        if why is not None:
            raise ValueError(f"config_dict: {why}")
        if d.get("bias") not in (None, "none"):
            raise ValueError(f"config_dict bias={d.get('bias')!r} is not served by the reference engine "
                             f"(it serves plain LoRA: bias 'none')")
        for key, whole in (("rank_pattern", r), ("alpha_pattern", alpha)):
            why = _pattern_refusal(key, d.get(key), whole)
            if why is not None:
                raise ValueError(why)
        tm = d.get("target_modules")
        if tm in ("all-linear", "all"):
            targets = TARGETS
        elif isinstance(tm, str) or not isinstance(tm, (list, tuple, set, frozenset)) or not tm:
            raise ValueError(f"config_dict target_modules must be a list of module names (of {list(TARGETS)}) "
                             f"or 'all-linear', got {tm!r}")
        else:
            # module names, or peft's resolved paths ('model.layers.0.self_attn.q_proj', what a
            # peft model's config holds after "all-linear"): the last part, as SGLang reads them
            bad = sorted(str(m) for m in tm if not isinstance(m, str) or m.split(".")[-1] not in TARGETS)
            if bad:
                raise ValueError(f"config_dict target_modules {bad[:4]} cannot take a LoRA adapter here; "
                                 f"the reference engine serves {list(TARGETS)}")
            names = {m.split(".")[-1] for m in tm}
            targets = tuple(m for m in TARGETS if m in names)
        return cls(r=r, lora_alpha=float(alpha), target_modules=targets)


def _pattern_refusal(key: str, pattern: Any, whole: float) -> str | None:
    """Why a peft ``rank_pattern`` / ``alpha_pattern`` cannot be served (None: it is empty, or
    every entry equals the adapter's own ``r`` / ``lora_alpha``, so nothing differs). SGLang's LoRA
    reads neither (0.5.23: one ``scaling = lora_alpha / r`` and one rank per adapter), nor does
    this engine, so an entry that differs would serve its modules with another scaling than
    peft's ``lora_alpha / r`` of that module."""
    if pattern is None or pattern == {}:
        return None
    main = "r" if key == "rank_pattern" else "lora_alpha"
    if not isinstance(pattern, dict):
        return f"config_dict {key} must be a dict of module pattern -> {main}, got {pattern!r}"
    differ = {k: v for k, v in pattern.items() if v != whole}
    if not differ:
        return None
    return (f"config_dict {key}={differ!r} is not served: the reference engine, as SGLang, applies "
            f"one {main} ({whole:g}) and one scaling lora_alpha / r to every module of an adapter; "
            f"train the adapter with the same r and lora_alpha for every module, or merge it into "
            f"the weights")


def hf_weight_of(name: str) -> tuple[str, str, str]:
    """``(HF weight name, module, "A" | "B")`` of an adapter tensor name (peft's, with or without
    ``base_model.model.`` and the adapter's name segment). Raises ValueError naming it."""
    m = _NAME.match(name)
    if m is None or m["module"] not in TARGETS:
        raise ValueError(f"{name!r} is not a LoRA tensor name of a decoder layer "
                         f"(e.g. 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight', "
                         f"modules {list(TARGETS)})")
    return f"{m['prefix']}{m['module']}.weight", m["module"], m["ab"]


def check_adapter(layout: Any, cfg: LoRAConfig,
                  named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{HF weight name: (A, B)}`` of an adapter's full tensors, every one checked against the
    base model (``layout``) and the config: a known module of a target in ``cfg``, A ``[r, in]``
    and B ``[out, r]`` of that weight's shape, both present, none twice, a floating dtype. Raises
    ValueError naming the tensor and the values."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        weight, module, ab = hf_weight_of(name)
        if module not in cfg.target_modules:
            raise ValueError(f"{name!r}: module {module!r} is not in the adapter's target_modules "
                             f"{list(cfg.target_modules)}")
        if not layout.accepts(weight) or weight not in layout.hf_shapes:
            raise ValueError(f"{name!r}: the base model has no {weight!r} (layers 0..{layout.spec.num_layers - 1}"
                             f"{'; LoRA on MoE experts is not served' if layout.spec.num_experts else ''})")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name!r}: expected a floating-point tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        out_dim, in_dim = layout.full_shape(weight)
        want = (cfg.r, in_dim) if ab == "A" else (out_dim, cfg.r)
        if tuple(t.shape) != want:
            raise ValueError(f"{name!r}: expected shape {want} (r={cfg.r}, base weight {weight!r} "
                             f"{(out_dim, in_dim)}), got {tuple(t.shape)}")
        if ab in parts.setdefault(weight, {}):
            raise ValueError(f"{name!r}: lora_{ab} of {weight!r} appears twice")
        parts[weight][ab] = t
    out = {}
    for weight, p in parts.items():
        if len(p) != 2:
            missing = "lora_B" if "A" in p else "lora_A"
            raise ValueError(f"{weight!r}: the adapter has no {missing} for it (every module needs lora_A and lora_B)")
        out[weight] = (p["A"], p["B"])
    if not out:
        raise ValueError("the adapter holds no tensors")
    return out


def _two(idx: tuple) -> tuple:
    return tuple(idx) + (slice(None),) * (2 - len(idx))


@dataclass
class LoRAShard:
    """One rank's share of one adapter: ``{engine linear name: (A_stacked [k*r, in_local],
    B_fused [out_local, k*r])}`` plus its scale, and where each HF weight's pieces sit (for
    reading the adapter back)."""

    name: str
    cfg: LoRAConfig
    mats: dict[str, tuple[torch.Tensor, torch.Tensor]]
    pieces: dict[str, list[tuple[str, int, tuple, tuple]]]   # engine -> [(hf weight, block j, src, dst)]
    # how it was laid out (`shard_adapter`'s reuse): (layout, rank, r, weights, dtype, device), and
    # the views of ``mats`` each piece is copied into, in ``pieces`` order (A block, B block)
    plan: tuple = field(default=(), repr=False, compare=False)
    views: list = field(default_factory=list, repr=False, compare=False)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.mats.values())

    def apply(self, engine_name: str, h: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``y`` (``F.linear(h, W)``) plus ``scale * B A h`` at ``rows`` (None: every row)."""
        m = self.mats.get(engine_name)
        if m is None:
            return y
        a, b = m
        if rows is None:
            return y + F.linear(F.linear(h, a), b) * self.cfg.scale
        if rows.numel() == 0:
            return y
        return y.index_add(0, rows, F.linear(F.linear(h[rows], a), b) * self.cfg.scale)


def shard_adapter(layout: Any, rank: int, name: str, cfg: LoRAConfig,
                  pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                  device: torch.device | str = "cpu", reuse: LoRAShard | None = None) -> LoRAShard:
    """TP rank ``rank``'s `LoRAShard` of checked full ``pairs`` (`check_adapter`), in ``dtype``.
    ``reuse``: a shard nobody serves any more (the adapter this one replaces, or an earlier spare)
    laid out for the same layout, rank, rank r, target weights, dtype and device: its matrices are
    written in place (every element that is not one of B's off-block zeros is rewritten; those
    stay zero) with the plan and views it was built with, instead of new memory whose pages fault
    in and a plan made again; anything else is laid out afresh."""
    r = cfg.r
    plan = (layout, rank, r, frozenset(pairs), dtype, torch.device(device))
    if reuse is not None and reuse.plan[:1] == (layout,) and reuse.plan[1:] == plan[1:]:
        mats, pieces, views = reuse.mats, reuse.pieces, reuse.views
    else:
        mats, pieces, views = _layout_shard(layout, rank, cfg, pairs, dtype, device)
    srcs = []
    for lst in pieces.values():
        for weight, _, src, _ in lst:
            A, B = pairs[weight]
            srcs += [A[:, src[1]], B[src[0], :]]
    copy_many(views, srcs)   # one fused copy (casts included), not two per module
    return LoRAShard(name, cfg, mats, pieces, plan, views)


def _layout_shard(layout: Any, rank: int, cfg: LoRAConfig, pairs: dict, dtype: torch.dtype,
                  device: torch.device | str) -> tuple[dict, dict, list]:
    """New matrices for `shard_adapter` (A empty, B zeros), the pieces, and the views of the
    matrices the pieces go to; raises ValueError where a weight's split cannot be taken."""
    r = cfg.r
    by_engine: dict[str, list[tuple[str, tuple, tuple]]] = {}
    for weight in layout.hf_names():
        if weight not in pairs:
            continue
        for pl in layout.placements(weight, rank):
            by_engine.setdefault(pl.engine, []).append((weight, _two(pl.src), _two(pl.dst)))
    shapes = layout.engine_shapes()
    mats, pieces, views = {}, {}, []
    for engine, lst in by_engine.items():
        out_local, in_local = shapes[engine]
        a = torch.empty(len(lst) * r, in_local, dtype=dtype, device=device)
        b = torch.zeros(out_local, len(lst) * r, dtype=dtype, device=device)
        pieces[engine] = []
        for j, (weight, src, dst) in enumerate(lst):
            A = pairs[weight][0]
            if A[:, src[1]].shape[1] != in_local or dst[1] != slice(None) and dst[1].indices(in_local) != (0, in_local, 1):
                raise ValueError(f"{weight!r} on TP rank {rank}: its input columns {src[1]} do not fill "
                                 f"{engine!r}'s {in_local} (cannot shard its lora_A)")
            if not isinstance(dst[0], slice):
                raise ValueError(f"{weight!r} on TP rank {rank}: {engine!r} places it at {dst}, not a "
                                 f"block of rows (cannot shard its lora_B)")
            views += [a[j * r:(j + 1) * r], b[dst[0], j * r:(j + 1) * r]]
            pieces[engine].append((weight, j, src, dst))
        mats[engine] = (a, b)
    return mats, pieces, views


def unshard_pieces(shard: LoRAShard) -> dict[str, list[tuple[str, tuple, torch.Tensor]]]:
    """What this rank holds of each full adapter tensor: ``{peft name: [(src index, tensor)]}``
    with names ``model.layers.{i}...{module}.lora_A.weight`` (read back from the stacked
    matrices, not from a copy kept aside)."""
    r = shard.cfg.r
    out: dict[str, list] = {}
    for engine, lst in shard.pieces.items():
        a, b = shard.mats[engine]
        for weight, j, src, dst in lst:
            base = weight[:-len(".weight")]
            out.setdefault(f"{base}.lora_A.weight", []).append(
                ((slice(None), src[1]), a[j * r:(j + 1) * r].cpu().clone()))
            out.setdefault(f"{base}.lora_B.weight", []).append(
                ((src[0], slice(None)), b[dst[0], j * r:(j + 1) * r].cpu().clone()))
    return out
