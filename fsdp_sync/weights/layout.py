"""The layout map: where each Hugging Face tensor of a decoder (Llama, Qwen2, Qwen3; Qwen3-MoE,
Qwen2-MoE, Mixtral) lands on each tensor-parallel (TP) rank of the rollout engine. The one source of truth for the reference
engine's sharding, the per-rank buckets (`reshard`) and the SGLang custom weight loader.

`ModelSpec` reads what the layout needs from a ``transformers`` config and refuses, naming it, a
family the map does not know. What only the reference engine's forward cannot compute (other
activations, rope scaling such as Llama 3's or YaRN, sliding-window layers) changes no tensor's
place: it is noted (`ModelSpec.unsupported`) and refused where that engine builds its model
(`engines.reference.tp_model.check_runnable`), so SGLang's per-rank buckets, its verify and
`plan` take such a model.
`TPLayout(spec, tp_size, ep_size)` is a pure function of them, the same split as SGLang's for these
models:

- vocab-parallel ``embed_tokens`` and ``lm_head``: the vocab is padded up to a multiple of
  `VOCAB_PADDING` (64, SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``) and split evenly, so rank r owns
  ids ``[r*Vs, (r+1)*Vs)`` with ``Vs = round_up(V, 64) / tp`` (SGLang's per-rank shape), or
  ``round_up(V, 64 * tp) / tp`` where ``round_up(V, 64)`` does not split evenly (SGLang 0.5.23's
  rule: TP 3, say); the padding rows of the last shard are zero; a tied ``lm_head`` is the
  embedding shard, and the engine has no ``lm_head`` parameter of its own);
- column-parallel fused ``qkv_proj`` (rows ``[q heads | k heads | v heads]`` of this rank, biases
  split the same way) and fused ``gate_up_proj`` (rows ``[gate | up]``, biases too);
- row-parallel ``o_proj`` and ``down_proj``: a column slice of the weight; their biases (if any)
  replicated, added once after the all-reduce;
- replicated RMSNorm weights;
- GQA: KV heads split across ranks when there are at least as many as TP ranks, otherwise each
  rank holds (a replica of) the one KV head its query heads use, as SGLang does; this needs
  ``tp % num_key_value_heads == 0``;
- Qwen3's per-head ``q_norm`` / ``k_norm`` (``[head_dim]``): replicated;
- MoE layers (SGLang's ``FusedMoE``): the router ``gate`` replicated; the routed experts, named in
  the Hub checkpoint one by one (``experts.{e}.gate_proj/up_proj/down_proj``, Mixtral's
  ``block_sparse_moe.experts.{e}.w1/w3/w2``), land in two fused parameters per layer,
  ``experts.w13_weight`` ``[E_local, 2 * I_local, H]`` (gate rows, then up rows) and
  ``experts.w2_weight`` ``[E_local, H, I_local]``: with ``ep_size`` 1 every rank holds every expert
  and slice ``r`` of its intermediate dim; with expert parallelism each group of ``tp / ep_size``
  ranks holds ``E / ep_size`` whole experts, sliced over that group. Qwen2-MoE's shared expert is a
  TP-split gated MLP (``shared_expert.gate_up_proj`` / ``down_proj``) with a replicated
  ``shared_expert_gate``.

Which layers are MoE, the expert sizes and the routing come from the config (`ModelSpec`); a
family this map does not know is refused by `ModelSpec.from_config` by name.

A split SGLang refuses (heads, KV heads, intermediate sizes or experts that do not divide) is
refused by `TPLayout` naming the config field and its value (`split_refusal`) and the TP (or EP)
sizes this model does split at.

A `Placement` says where a piece of a full HF tensor lives in a rank's own parameter
(``engine_param[dst] = full[src]``), with ``src`` a block of rows or of columns. Loading,
gathering (`get_weights_by_name`), `shard_state_dict` ("direct" payloads) and the per-rank
buckets all use the same placements. `TPLayout.sources` is the reverse map: which HF tensors
(and which blocks of them) make up one engine parameter on one rank.

Not here: moving data between processes (`reshard`, `handles`), the model math (`engines.reference.tp_model`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB_PADDING = 64
"""The vocab is padded to a multiple of this before the TP split (SGLang's default padding)."""

__all__ = ["VOCAB_PADDING", "FAMILIES", "ModelSpec", "TPLayout", "Placement", "shard_state_dict", "layout_for",
           "names_layout", "split_refusal", "block_of", "view2d", "rank_digest", "engine_ep_size"]


# --------------------------------------------------------------------------- the model's shape

_DENSE = ("llama", "qwen2", "qwen3")
_MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
FAMILIES = _DENSE + _MOE
"""The ``model_type`` values the layout map (and the reference engine) know."""


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    initializer_range: float = 0.02
    qk_norm: bool = False                 # Qwen3: per-head RMSNorm of q and k before rope
    num_experts: int = 0                  # routed experts per MoE layer (0: a dense model)
    top_k: int = 0                        # experts per token
    moe_intermediate_size: int = 0        # each routed expert's intermediate size
    norm_topk_prob: bool = False          # renormalize the top-k routing weights
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's shared expert (0: none)
    moe_layers: tuple[int, ...] = ()      # the layers whose MLP is the sparse MoE block
    unsupported: str = ""
    """Why the reference engine's forward cannot compute this model (another activation, rope
    scaling, sliding-window layers), as its refusal says it; "" when it can. The sharding does not
    depend on it: `engines.reference.tp_model.check_runnable` refuses it, the layout does not."""

    @property
    def moe_prefix(self) -> str:
        """The MoE block's module name in a layer (Hub checkpoint and SGLang alike)."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """(gate, up, down) projection names of one expert in the Hub checkpoint."""
        return ("w1", "w3", "w2") if self.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelSpec":
        mt = getattr(cfg, "model_type", None)
        if mt not in FAMILIES:
            raise ValueError(f"the layout map knows model_type {', '.join(map(repr, FAMILIES))} "
                             f"(Llama, Qwen2, Qwen3 dense; Qwen3-MoE, Qwen2-MoE, Mixtral), got model_type {mt!r}")
        # what the reference engine's forward cannot compute; none of it changes the sharding, so
        # it is noted here (`unsupported`) and refused where that engine builds its model, while
        # the layout serves SGLang (per-rank buckets, verify, `plan`) for such a model all the same
        unsupported = []
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            unsupported.append(f"expected hidden_act 'silu', got {act!r}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = getattr(cfg, "rope_scaling", None)
        if rope_type == "default" and isinstance(scaling, dict):
            rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
        if rope_type != "default":
            unsupported.append(f"expected the default rope, got rope_type {rope_type!r}")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        layer_types = getattr(cfg, "layer_types", None) or []
        # transformers decides each layer's attention by layer_types where the config has them
        # (use_sliding_window with max_window_layers >= the layer count: every layer full)
        if any(t != "full_attention" for t in layer_types) or (
                not layer_types and getattr(cfg, "use_sliding_window", False)):
            unsupported.append(f"sliding-window attention is not supported (layer_types {layer_types})")
        elif mt in ("qwen3_moe", "mixtral") and getattr(cfg, "sliding_window", None) is not None:
            unsupported.append(f"sliding-window attention is not supported ({mt} sliding_window "
                               f"{cfg.sliding_window}; set it to null for full attention)")
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv})")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        if mt == "qwen2":                  # q/k/v always carry biases, o_proj never, the MLP never
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif mt == "qwen2_moe":            # q/k/v biases as the config's qkv_bias says (default on),
            # as transformers (bias=config.qkv_bias) and SGLang (getattr(config, "qkv_bias", True)) read it
            qkv_bias, o_bias, mlp_bias = bool(getattr(cfg, "qkv_bias", True)), False, False
        elif mt == "mixtral":
            qkv_bias = o_bias = mlp_bias = False
        elif mt == "llama":
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(getattr(cfg, "mlp_bias", False))
        else:                              # qwen3, qwen3_moe: attention_bias on q/k/v and o
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, False
        moe: dict[str, Any] = {}
        if mt in _MOE:
            moe = cls._moe_fields(cfg, mt)
        return cls(model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                   num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=float(theta),
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                   qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                   max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
                   initializer_range=float(getattr(cfg, "initializer_range", 0.02)),
                   qk_norm=mt in ("qwen3", "qwen3_moe"), unsupported="; ".join(unsupported), **moe)

    @staticmethod
    def _moe_fields(cfg: Any, mt: str) -> dict[str, Any]:
        layers = cfg.num_hidden_layers
        if mt == "mixtral":
            experts, inter, norm = cfg.num_local_experts, cfg.intermediate_size, True
            moe_layers, shared = tuple(range(layers)), 0
        else:
            experts, inter = cfg.num_experts, cfg.moe_intermediate_size
            norm = bool(getattr(cfg, "norm_topk_prob", False))
            step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(cfg, "mlp_only_layers", None) or [])
            moe_layers = tuple(i for i in range(layers)
                               if i not in dense and experts > 0 and (i + 1) % step == 0)
            shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
            if mt == "qwen2_moe" and moe_layers and not shared:
                raise ValueError(      # transformers still builds them; SGLang has no such parameter
                    "qwen2_moe: shared_expert_intermediate_size 0 is not supported: transformers builds "
                    "a zero-width shared_expert and a live shared_expert_gate ([1, hidden_size]) in "
                    "every MoE layer anyway, which SGLang's Qwen2-MoE has no parameter for; give it "
                    "a shared expert (shared_expert_intermediate_size > 0)")
        top_k = int(cfg.num_experts_per_tok)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ValueError(f"{mt}: expected num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                             f"got {experts} experts, num_experts_per_tok {top_k}")
        return dict(num_experts=int(experts), top_k=top_k, moe_intermediate_size=int(inter),
                    norm_topk_prob=norm, shared_expert_intermediate_size=shared, moe_layers=moe_layers)


# --------------------------------------------------------------------------- the sharding plan

@dataclass(frozen=True)
class Placement:
    """``engine_param[dst] = full_hf_tensor[src]`` on one rank. ``owner``: the first rank holding
    this piece of the full tensor (replicas are skipped when gathering).

    ``src`` is a block of rows or columns of a 1-D or 2-D HF tensor. ``dst`` indexes the engine
    parameter: a block of rows/columns of a 1-D/2-D one, or ``(expert, rows)`` /
    ``(expert, all rows, cols)`` of a fused 3-D expert parameter (``w13_weight``/``w2_weight``)."""

    engine: str
    dst: tuple[Any, ...]
    src: tuple[slice, ...]
    owner: bool = True


def _rows(a: int, b: int) -> tuple[slice, ...]:
    return (slice(a, b),)


def _cols(a: int, b: int) -> tuple[slice, ...]:
    return (slice(None), slice(a, b))


_ALL = (slice(None),)


def split_refusal(spec: ModelSpec, tp_size: int, ep_size: int = 1) -> str | None:
    """Why SGLang (and so the layout map) cannot split ``spec``'s model over ``tp_size`` ranks with
    ``ep_size`` expert groups, naming the config field and its value; None where it can (pure)."""
    s, t = spec, tp_size
    if s.num_heads % t:
        return f"num_attention_heads ({s.num_heads}) must be divisible by tp_size ({t})"
    if any(i not in s.moe_layers for i in range(s.num_layers)) and s.intermediate_size % t:
        return f"intermediate_size ({s.intermediate_size}) must be divisible by tp_size ({t})"
    if s.num_kv_heads >= t and s.num_kv_heads % t:
        return f"num_key_value_heads ({s.num_kv_heads}) must be divisible by tp_size ({t})"
    if s.num_kv_heads < t and t % s.num_kv_heads:
        return (f"with fewer KV heads ({s.num_kv_heads}) than TP ranks ({t}), tp_size must be a "
                f"multiple of num_key_value_heads to replicate them")
    if t % ep_size:
        return f"ep_size ({ep_size}) must divide tp_size ({t}) (SGLang's rule)"
    if s.num_experts:
        if s.num_experts % ep_size:
            return f"num_experts ({s.num_experts}) must be divisible by ep_size ({ep_size})"
        if s.moe_intermediate_size % (t // ep_size):
            return (f"moe_intermediate_size ({s.moe_intermediate_size}) must be divisible by "
                    f"tp_size / ep_size ({t // ep_size})")
        if s.shared_expert_intermediate_size % t:
            return (f"shared_expert_intermediate_size ({s.shared_expert_intermediate_size}) "
                    f"must be divisible by tp_size ({t})")
    return None


def _splits_hint(spec: ModelSpec, tp_size: int, ep_size: int) -> str:
    """What to do about a refused split: the TP sizes (up to 64, or ``tp_size`` up to 4096) this model splits
    at with ``ep_size``, else the expert-parallel sizes that make ``tp_size`` work."""
    top = min(max(64, tp_size), 4096)        # a mistyped tp_size costs no long search
    at = f" with ep_size {ep_size}" if ep_size > 1 else ""
    ok = [t for t in range(1, top + 1) if split_refusal(spec, t, ep_size) is None]
    eps = [e for e in range(1, min(tp_size, 4096) + 1)
           if spec.num_experts and split_refusal(spec, tp_size, e) is None]
    if eps:
        return (f"; SGLang refuses this split too: at tp_size {tp_size} use ep_size "
                f"{', '.join(map(str, eps[:8]))}, or a tp_size this model splits at{at}: "
                f"{', '.join(map(str, ok[:8])) or 'none up to ' + str(top)}")
    if not ok:
        return f"; SGLang refuses this split too, and every tp_size up to {top}{at}"
    return (f"; SGLang refuses this split too: start the engine (and make the trainer's infer_tp) "
            f"at a tp_size this model splits at{at}: {', '.join(map(str, ok[:8]))}"
            f"{' …' if len(ok) > 8 else ''}")


class TPLayout:
    """Which piece of which Hugging Face tensor each TP rank holds, and under which own name.

    ``ep_size`` (MoE only): expert parallelism inside the TP group, as SGLang's ``--ep-size``: the
    experts are split into ``ep_size`` groups of ``E / ep_size`` whole experts, and each group's
    experts are tensor-parallel over ``tp / ep_size`` ranks (``moe_tp``). TP rank r serves expert
    group ``r // moe_tp`` and slice ``r % moe_tp`` of each of those experts' intermediate dim.
    Attention, embeddings, the router and the shared expert stay tensor-parallel over all ``tp``."""

    def __init__(self, spec: ModelSpec, tp_size: int, ep_size: int = 1):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        s = spec
        self.spec, self.tp = s, tp_size
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
        if ep_size > 1 and not s.num_experts:
            raise ValueError(f"ep_size {ep_size} needs an MoE model; {s.model_type} has no experts")
        why = split_refusal(s, tp_size, ep_size)
        if why is not None:
            raise ValueError(why + _splits_hint(s, tp_size, ep_size))
        if s.num_kv_heads >= tp_size:
            self.kv_local, self.kv_replicas = s.num_kv_heads // tp_size, 1
        else:       # each rank holds a replica of the one KV head its query heads use
            self.kv_local, self.kv_replicas = 1, tp_size // s.num_kv_heads
        self.ep = ep_size
        self.moe_tp = tp_size // ep_size
        self.experts_local = s.num_experts // ep_size
        self.moe_inter_local = s.moe_intermediate_size // self.moe_tp if s.num_experts else 0
        self.shared_local = s.shared_expert_intermediate_size // tp_size
        self.q_local = s.num_heads // tp_size
        self.inter_local = s.intermediate_size // tp_size
        # SGLang's VocabParallelEmbedding/ParallelLMHead: pad to 64, then an even split; where
        # that does not split evenly, pad to 64 x tp instead (SGLang 0.5.23; 0.5.12 on CPU)
        padding = VOCAB_PADDING if math.ceil(s.vocab_size / VOCAB_PADDING) * VOCAB_PADDING % tp_size == 0 \
            else VOCAB_PADDING * tp_size
        self.vocab_shard = math.ceil(s.vocab_size / padding) * padding // tp_size
        self._kinds: dict[str, tuple] = {}
        self.hf_shapes: dict[str, tuple[int, ...]] = self._hf_shapes()

    # ----------------------------------------------------------------- names and shapes
    def _add(self, out: dict, name: str, shape: tuple[int, ...], kind: str, engine: str = "", *extra: Any) -> None:
        out[name] = shape
        self._kinds[name] = (kind, engine or name, *extra)

    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF (Hub checkpoint) names and full shapes, each with how it is split (``_kinds``)."""
        s, d = self.spec, self.spec.head_dim
        H, I = s.hidden_size, s.intermediate_size
        out: dict[str, tuple[int, ...]] = {}
        self._add(out, "model.embed_tokens.weight", (s.vocab_size, H), "vocab")
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            for proj, rows in (("q_proj", s.num_heads * d), ("k_proj", s.num_kv_heads * d),
                               ("v_proj", s.num_kv_heads * d)):
                self._add(out, f"{a}{proj}.weight", (rows, H), proj[0], f"{a}qkv_proj.weight")
                if s.qkv_bias:
                    self._add(out, f"{a}{proj}.bias", (rows,), proj[0], f"{a}qkv_proj.bias")
            self._add(out, a + "o_proj.weight", (H, s.num_heads * d), "row", "", self.q_local * d)
            if s.o_bias:
                self._add(out, a + "o_proj.bias", (H,), "replicated")
            if s.qk_norm:
                self._add(out, a + "q_norm.weight", (d,), "replicated")
                self._add(out, a + "k_norm.weight", (d,), "replicated")
            if i in s.moe_layers:
                self._moe_shapes(out, p)
            else:
                self._mlp_shapes(out, p + "mlp.", I, self.inter_local, s.mlp_bias)
            self._add(out, p + "input_layernorm.weight", (H,), "replicated")
            self._add(out, p + "post_attention_layernorm.weight", (H,), "replicated")
        self._add(out, "model.norm.weight", (H,), "replicated")
        if not s.tie_word_embeddings:
            self._add(out, "lm_head.weight", (s.vocab_size, H), "vocab")
        return out

    def _mlp_shapes(self, out: dict, m: str, inter: int, local: int, bias: bool) -> None:
        """A gated MLP under TP: gate/up column-parallel into ``gate_up_proj``, down row-parallel."""
        H = self.spec.hidden_size
        for proj, shape, half in (("gate_proj", (inter, H), 0), ("up_proj", (inter, H), 1)):
            self._add(out, f"{m}{proj}.weight", shape, "gu", f"{m}gate_up_proj.weight", half, local)
            if bias:
                self._add(out, f"{m}{proj}.bias", (inter,), "gu", f"{m}gate_up_proj.bias", half, local)
        self._add(out, f"{m}down_proj.weight", (H, inter), "row", "", local)
        if bias:
            self._add(out, f"{m}down_proj.bias", (H,), "replicated")

    def _moe_shapes(self, out: dict, p: str) -> None:
        s, H, Im = self.spec, self.spec.hidden_size, self.spec.moe_intermediate_size
        m = f"{p}{s.moe_prefix}."
        g, u, dn = s.expert_names
        self._add(out, m + "gate.weight", (s.num_experts, H), "replicated")
        for e in range(s.num_experts):
            x = f"{m}experts.{e}."
            self._add(out, f"{x}{g}.weight", (Im, H), "expert", m + "experts.w13_weight", e, 0)
            self._add(out, f"{x}{u}.weight", (Im, H), "expert", m + "experts.w13_weight", e, 1)
            self._add(out, f"{x}{dn}.weight", (H, Im), "expert", m + "experts.w2_weight", e, 2)
        if s.shared_expert_intermediate_size:
            self._mlp_shapes(out, m + "shared_expert.", s.shared_expert_intermediate_size, self.shared_local, False)
            self._add(out, m + "shared_expert_gate.weight", (1, H), "replicated")

    def hf_names(self) -> list[str]:
        """Hugging Face parameter names in ``named_parameters()`` order (tied lm_head excluded)."""
        return list(self.hf_shapes)

    def accepts(self, name: str) -> bool:
        """Known HF name; a tied model also accepts (and ignores) ``lm_head.weight`` (a trainer
        refuses to send one that differs from the embedding: `weights.tied`)."""
        return name in self.hf_shapes or (self.spec.tie_word_embeddings and name == "lm_head.weight")

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return (self.spec.vocab_size, self.spec.hidden_size)
        return self.hf_shapes[name]

    def engine_shapes(self) -> dict[str, tuple[int, ...]]:
        """This layout's own parameter names and per-rank shapes (the same on every rank), in the
        engine's order."""
        cache = self.__dict__.get("_engine_shapes")
        if cache is not None:
            return dict(cache)
        s, d = self.spec, self.spec.head_dim
        H = s.hidden_size
        qkv_rows = (self.q_local + 2 * self.kv_local) * d
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_shard, H)}
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (H,)
            out[p + "self_attn.qkv_proj.weight"] = (qkv_rows, H)
            if s.qkv_bias:
                out[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
            if s.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (d,)
                out[p + "self_attn.k_norm.weight"] = (d,)
            out[p + "self_attn.o_proj.weight"] = (H, self.q_local * d)
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
            if i in s.moe_layers:
                m = f"{p}{s.moe_prefix}."
                il, el = self.moe_inter_local, self.experts_local
                out[m + "gate.weight"] = (s.num_experts, H)
                out[m + "experts.w13_weight"] = (el, 2 * il, H)
                out[m + "experts.w2_weight"] = (el, H, il)
                if s.shared_expert_intermediate_size:
                    out[m + "shared_expert.gate_up_proj.weight"] = (2 * self.shared_local, H)
                    out[m + "shared_expert.down_proj.weight"] = (H, self.shared_local)
                    out[m + "shared_expert_gate.weight"] = (1, H)
                continue
            out[p + "mlp.gate_up_proj.weight"] = (2 * self.inter_local, H)
            if s.mlp_bias:
                out[p + "mlp.gate_up_proj.bias"] = (2 * self.inter_local,)
            out[p + "mlp.down_proj.weight"] = (H, self.inter_local)
            if s.mlp_bias:
                out[p + "mlp.down_proj.bias"] = (H,)
        out["model.norm.weight"] = (H,)
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_shard, H)
        self.__dict__["_engine_shapes"] = out
        return dict(out)

    def engine_name(self, name: str) -> str:
        """The engine parameter HF tensor ``name`` lands in, on every rank that holds a piece of it
        (``qkv_proj.weight`` for ``q_proj.weight``, ``experts.w13_weight`` for an expert's gate)."""
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return self._kinds[name][1]

    def engine_covers(self, engine_name: str, rank: int = 0) -> list[str]:
        """HF names an engine parameter on ``rank`` is built from (a whole engine param counts as
        all of them)."""
        return [hf for hf, _ in self.sources(rank).get(engine_name, [])] or [engine_name]

    def rank_names(self, rank: int) -> set[str]:
        """The HF names ``rank`` holds a piece of (every name but the experts of other EP ranks)."""
        return {n for n in self.hf_names() if self.placements(n, rank)}

    # ----------------------------------------------------------------- placements
    def kv_heads_of(self, rank: int) -> int:
        """First KV head index held by ``rank``."""
        if self.kv_replicas == 1:
            return rank * self.kv_local
        return rank // self.kv_replicas

    def expert_range(self, rank: int) -> range:
        """The (global) experts whose slices ``rank`` holds."""
        g = rank // self.moe_tp
        return range(g * self.experts_local, (g + 1) * self.experts_local)

    def placements(self, name: str, rank: int) -> list[Placement]:
        """Where HF tensor ``name`` goes on ``rank`` (empty for a tied lm_head or a rank that holds
        no part of it)."""
        s, d = self.spec, self.spec.head_dim
        kind = self._kinds.get(name)
        if kind is None:
            if self.accepts(name):
                return []
            raise KeyError(name)
        what, engine = kind[0], kind[1]
        if what == "vocab":
            v0 = rank * self.vocab_shard
            n = max(0, min(s.vocab_size, v0 + self.vocab_shard) - v0)
            return [Placement(name, _rows(0, n), _rows(v0, v0 + n))] if n else []
        if what == "replicated":
            return [Placement(engine, _ALL, _ALL, owner=rank == 0)]
        ql, kl = self.q_local * d, self.kv_local * d
        if what == "q":
            return [Placement(engine, _rows(0, ql), _rows(rank * ql, (rank + 1) * ql))]
        if what in ("k", "v"):
            h0 = self.kv_heads_of(rank)
            off = ql if what == "k" else ql + kl
            owner = self.kv_replicas == 1 or rank % self.kv_replicas == 0
            return [Placement(engine, _rows(off, off + kl), _rows(h0 * d, h0 * d + kl), owner=owner)]
        if what == "row":
            w = kind[2]
            return [Placement(engine, _cols(0, w), _cols(rank * w, (rank + 1) * w))]
        if what == "gu":
            half, il = kind[2], kind[3]
            return [Placement(engine, _rows(half * il, (half + 1) * il), _rows(rank * il, (rank + 1) * il))]
        if what == "expert":
            e, part = kind[2], kind[3]
            if e not in self.expert_range(rank):
                return []
            le, il, t = e - self.expert_range(rank).start, self.moe_inter_local, rank % self.moe_tp
            if part == 2:
                return [Placement(engine, (le, slice(None), slice(0, il)), _cols(t * il, (t + 1) * il))]
            return [Placement(engine, (le, slice(part * il, (part + 1) * il)), _rows(t * il, (t + 1) * il))]
        raise KeyError(name)   # pragma: no cover - every kind is handled above


    # ----------------------------------------------------------------- reverse map
    def sources(self, rank: int) -> dict[str, list[tuple[str, Placement]]]:
        """Reverse map for ``rank``: engine parameter -> ``[(hf_name, placement), ...]`` that fill it,
        in HF order (every engine parameter is listed, with the pieces that make it up)."""
        cache = self.__dict__.setdefault("_sources_cache", {})
        if rank not in cache:
            out: dict[str, list[tuple[str, Placement]]] = {k: [] for k in self.engine_shapes()}
            for name in self.hf_names():
                for pl in self.placements(name, rank):
                    out[pl.engine].append((name, pl))
            cache[rank] = out
        return cache[rank]

    def padding(self, engine_name: str, rank: int) -> tuple[slice, ...] | None:
        """The rows of ``engine_name`` on ``rank`` that no HF tensor fills (vocab padding), or None."""
        if engine_name not in ("model.embed_tokens.weight", "lm_head.weight"):
            return None
        n = max(0, min(self.spec.vocab_size, (rank + 1) * self.vocab_shard) - rank * self.vocab_shard)
        return (slice(n, self.vocab_shard),) if n < self.vocab_shard else None

    def engine_bytes(self, itemsize: int) -> int:
        """Bytes of one rank's shard (every rank's shard has the same shapes)."""
        return sum(math.prod(s) * self.dtype_of(n, None, itemsize)
                   for n, s in self.engine_shapes().items())

    quantization: str | None = None
    """None: every weight in the rollout dtype (``fp8.FP8Layout``: block FP8)."""

    def dtype_of(self, name: str, dtype: Any, itemsize: int | None = None) -> Any:
        """The dtype HF or engine tensor ``name`` is held in when the rollout dtype is ``dtype``
        (``itemsize`` given: its size in bytes instead). Here always the rollout dtype; a
        quantized layout (``fp8.FP8Layout``) answers ``float8_e4m3fn`` / ``float32`` for its
        quantized weights and their scales."""
        return itemsize if itemsize is not None else dtype


def shard_state_dict(named: Any, layout: TPLayout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters in the engine's own layout, from full HF-named tensors
    (a mapping or ``(name, tensor)`` pairs that cover every HF name): input for ``"direct"``."""
    items = named.items() if hasattr(named, "items") else named
    out = {k: None for k in layout.engine_shapes()}
    full = dict(items)
    missing = [n for n in layout.hf_names() if n not in full]
    if missing:
        raise KeyError(f"shard_state_dict needs every HF tensor; missing {missing[:3]}"
                       f"{' …' if len(missing) > 3 else ''}")
    dtype = next(t.dtype for n, t in full.items() if layout.dtype_of(n, None) is None)
    shapes = layout.engine_shapes()
    for k in out:
        out[k] = torch.zeros(shapes[k], dtype=layout.dtype_of(k, dtype))
    for name in layout.hf_names():
        for pl in layout.placements(name, rank):
            out[pl.engine][pl.dst].copy_(full[name][pl.src])
    return out


def layout_for(config: Any, tp_size: int, ep_size: int = 1) -> TPLayout:
    """The layout map of a ``transformers`` config (or a `ModelSpec`) at ``tp_size`` (and, for an
    MoE model, ``ep_size``). Read-only: the last one asked for is kept and given again, so that
    what it works out (its reverse maps, its shapes) is worked out once for a run's syncs, not at
    every sync (the reverse map alone: 4 ms of a 338-tensor sync on this host)."""
    spec = config if isinstance(config, ModelSpec) else ModelSpec.from_config(config)
    return _layout(spec, tp_size, ep_size)


# the last one only: a trainer's, kept for its syncs (qwen3-235b-a22b's at TP 16, with its reverse
# maps, is ~170 MB: `plan` over five TPs peaked at 0.72 GB keeping one, 0.89 keeping two)
@functools.lru_cache(maxsize=1)
def _layout(spec: ModelSpec, tp_size: int, ep_size: int) -> TPLayout:
    return TPLayout(spec, tp_size, ep_size)


def names_layout(config: Any) -> TPLayout:
    """The layout map of ``config`` (or a `ModelSpec`) at TP 1, for what does not depend on the
    split (the HF names and shapes, which tensors a quantization covers). Kept apart from
    `layout_for`'s one entry: a sync that asks it (an FP8 sync's coverage check and its names)
    then leaves the run's TP layout, and its reverse maps, in place for the next sync (asking
    `layout_for(config, 1)` there made every FP8 sync of qwen3-235b-a22b at TP 8 build its TP-8
    layout again: 0.44 s on this host)."""
    return _names_layout(config if isinstance(config, ModelSpec) else ModelSpec.from_config(config))


@functools.lru_cache(maxsize=1)
def _names_layout(spec: ModelSpec) -> TPLayout:
    return TPLayout(spec, 1)


def view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view blocks are cut in: ``[n, 1]`` for 1-D, ``[prod(shape[:-1]), shape[-1]]``
    otherwise (a 2-D tensor as it is, a fused ``[experts, rows, cols]`` one as stacked rows)."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


def engine_ep_size(engine: Any) -> int:
    """The expert-parallel size an engine object runs (its layout's ``ep``, else its ``ep_size``
    attribute, else 1): per-rank buckets are cut for the engine's split, not a guess."""
    ep = getattr(getattr(engine, "layout", None), "ep", None) or getattr(engine, "ep_size", None) or 1
    return int(ep)


def block_of(sl: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A placement's index as a block ``rows [r0, r1) x cols [c0, c1)`` of the tensor's `view2d`
    (a 1-D tensor of n elements is ``n x 1``; a 3-D expert parameter is indexed ``(expert,
    rows[, cols])`` and its block lies in that expert's rows)."""
    if len(shape) == 3:
        if not sl or not isinstance(sl[0], int):
            raise ValueError(f"a 3-D parameter is indexed (expert, rows[, cols]), got {sl}")
        e, (A, B) = sl[0], shape[1:]
        r0, r1, _ = (sl[1] if len(sl) > 1 else slice(None)).indices(A)
        c0, c1, _ = (sl[2] if len(sl) > 2 else slice(None)).indices(B)
        return e * A + r0, e * A + r1, c0, c1
    rows, cols = view2d(shape)
    r0, r1, _ = (sl[0].indices(rows) if sl else (0, rows, 1))
    if len(sl) > 1:
        if len(shape) != 2:
            raise ValueError(f"a column slice needs a 2-D tensor, got shape {shape}")
        c0, c1, _ = sl[1].indices(cols)
    else:
        c0, c1 = 0, cols
    return r0, r1, c0, c1



def rank_digest(layout: TPLayout, name: str, rank: int, piece: Callable[[Placement], torch.Tensor]) -> str:
    """sha256 of the pieces of HF tensor ``name`` that TP ``rank`` serves (replicas included), in
    placement order, each with its engine parameter, its block of the full tensor, dtype and shape.

    ``piece(pl)`` gives one piece: an engine worker passes ``params[pl.engine][pl.dst]`` (what it
    serves), a trainer ``full[pl.src]`` (what it should serve), so both hash the same bytes and
    `SyncConfig.verify` compares every rank without moving a tensor. A tied ``lm_head.weight`` is
    the embedding's pieces (the engine has no lm_head of its own)."""
    src = ("model.embed_tokens.weight" if name == "lm_head.weight" and layout.spec.tie_word_embeddings
           else name)
    full = layout.full_shape(src)
    h = hashlib.sha256(f"{name}|tp{rank}/{layout.tp}|".encode())
    for pl in layout.placements(src, rank):
        t = piece(pl).detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
        h.update(f"{pl.engine}|{block_of(pl.src, full)}|{str(t.dtype).removeprefix('torch.')}|"
                 f"{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
