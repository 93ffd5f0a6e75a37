"""One TP rank's shard of a Llama/Qwen2-family decoder, written from scratch (no transformers modules).

`ModelSpec` reads what the engine needs from a ``transformers`` config and refuses what it cannot
run (other activations, rope scaling, sliding-window layers, q/k norms) with a clear error.
`TPLayout` is the pure sharding plan, the same as SGLang's for these models:

- vocab-parallel ``embed_tokens`` and ``lm_head`` (vocab padded up to a multiple of TP; rank r owns
  ids ``[r*Vs, (r+1)*Vs)``; a tied ``lm_head`` is the embedding shard);
- column-parallel fused ``qkv_proj`` (rows ``[q heads | k heads | v heads]`` of this rank, biases
  when the model has them) and fused ``gate_up_proj`` (rows ``[gate | up]``);
- row-parallel ``o_proj`` and ``down_proj`` followed by an all-reduce (their biases, if any, are
  added once after it);
- replicated RMSNorm weights;
- GQA: KV heads split across ranks when there are at least as many as TP ranks, otherwise each
  rank holds (a replica of) the one KV head its query heads use, as SGLang does; this needs
  ``tp % num_key_value_heads == 0``.

A `Placement` says where a piece of a full Hugging Face tensor lives in a rank's own parameter
(``engine_param[dst] = full[src]``); loading, gathering (`get_weights_by_name`) and
`shard_state_dict` ("direct" payloads) all use the same placements.

`TPModel` holds one rank's parameters and runs the forward pass with its process group:
RMSNorm, rotary embeddings and attention follow transformers' numerics (float32 norm statistics,
cos/sin computed in float32 then cast, SDPA). Attention runs per sequence over its own span of the
KV cache, so prompts of different lengths need no padding.

Not here: processes, pipes, payloads and memory tags (`worker`), or the engine API (`reference`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ModelSpec", "TPLayout", "Placement", "Span", "TPModel", "shard_state_dict"]


# --------------------------------------------------------------------------- the model's shape

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

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelSpec":
        mt = getattr(cfg, "model_type", None)
        if mt not in ("qwen2", "llama"):
            raise ValueError(f"the reference engine runs Llama/Qwen2-family decoders "
                             f"(model_type 'llama' or 'qwen2'), got model_type {mt!r}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"expected hidden_act 'silu', got {act!r}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = getattr(cfg, "rope_scaling", None)
        if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type"))
                                      not in (None, "default")):
            raise ValueError(f"expected the default rope, got rope_type {rope_type!r}")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"sliding-window attention is not supported (layer_types {layer_types})")
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if heads % kv:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv})")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        if mt == "qwen2":   # Qwen2: q/k/v always carry biases, o_proj never, the MLP never
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(getattr(cfg, "mlp_bias", False))
        return cls(model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                   num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=float(theta),
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                   qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                   max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
                   initializer_range=float(getattr(cfg, "initializer_range", 0.02)))


# --------------------------------------------------------------------------- the sharding plan

@dataclass(frozen=True)
class Placement:
    """``engine_param[dst] = full_hf_tensor[src]`` on one rank. ``owner``: the first rank holding
    this piece of the full tensor (replicas are skipped when gathering)."""

    engine: str
    dst: tuple[slice, ...]
    src: tuple[slice, ...]
    owner: bool = True


def _rows(a: int, b: int) -> tuple[slice, ...]:
    return (slice(a, b),)


def _cols(a: int, b: int) -> tuple[slice, ...]:
    return (slice(None), slice(a, b))


_ALL = (slice(None),)


class TPLayout:
    """Which piece of which Hugging Face tensor each TP rank holds, and under which own name."""

    def __init__(self, spec: ModelSpec, tp_size: int):
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        s = spec
        self.spec, self.tp = s, tp_size
        if s.num_heads % tp_size:
            raise ValueError(f"num_attention_heads ({s.num_heads}) must be divisible by tp_size ({tp_size})")
        if s.intermediate_size % tp_size:
            raise ValueError(f"intermediate_size ({s.intermediate_size}) must be divisible by "
                             f"tp_size ({tp_size})")
        if s.num_kv_heads >= tp_size:
            if s.num_kv_heads % tp_size:
                raise ValueError(f"num_key_value_heads ({s.num_kv_heads}) must be divisible by "
                                 f"tp_size ({tp_size})")
            self.kv_local, self.kv_replicas = s.num_kv_heads // tp_size, 1
        else:
            if tp_size % s.num_kv_heads:
                raise ValueError(f"with fewer KV heads ({s.num_kv_heads}) than TP ranks ({tp_size}), "
                                 f"tp_size must be a multiple of num_key_value_heads to replicate them")
            self.kv_local, self.kv_replicas = 1, tp_size // s.num_kv_heads
        self.q_local = s.num_heads // tp_size
        self.inter_local = s.intermediate_size // tp_size
        self.vocab_shard = math.ceil(s.vocab_size / tp_size)
        self.hf_shapes: dict[str, tuple[int, ...]] = self._hf_shapes()

    # ----------------------------------------------------------------- names and shapes
    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        s, d = self.spec, self.spec.head_dim
        H, I = s.hidden_size, s.intermediate_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, H)}
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            for proj, rows in (("q_proj", s.num_heads * d), ("k_proj", s.num_kv_heads * d),
                               ("v_proj", s.num_kv_heads * d)):
                out[p + f"self_attn.{proj}.weight"] = (rows, H)
                if s.qkv_bias:
                    out[p + f"self_attn.{proj}.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (H, s.num_heads * d)
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = (H,)
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out[p + f"mlp.{proj}.weight"] = shape
                if s.mlp_bias:
                    out[p + f"mlp.{proj}.bias"] = (shape[0],)
            out[p + "input_layernorm.weight"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
        out["model.norm.weight"] = (H,)
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (s.vocab_size, H)
        return out

    def hf_names(self) -> list[str]:
        """Hugging Face parameter names in ``named_parameters()`` order (tied lm_head excluded)."""
        return list(self.hf_shapes)

    def accepts(self, name: str) -> bool:
        """Known HF name; a tied model also accepts (and ignores) ``lm_head.weight``."""
        return name in self.hf_shapes or (self.spec.tie_word_embeddings and name == "lm_head.weight")

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            return (self.spec.vocab_size, self.spec.hidden_size)
        return self.hf_shapes[name]

    def engine_shapes(self) -> dict[str, tuple[int, ...]]:
        """This layout's own parameter names and per-rank shapes (the same on every rank)."""
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
            out[p + "self_attn.o_proj.weight"] = (H, self.q_local * d)
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
            out[p + "mlp.gate_up_proj.weight"] = (2 * self.inter_local, H)
            if s.mlp_bias:
                out[p + "mlp.gate_up_proj.bias"] = (2 * self.inter_local,)
            out[p + "mlp.down_proj.weight"] = (H, self.inter_local)
            if s.mlp_bias:
                out[p + "mlp.down_proj.bias"] = (H,)
        out["model.norm.weight"] = (H,)
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_shard, H)
        return out

    def engine_covers(self, engine_name: str) -> list[str]:
        """HF names an engine parameter is built from (a whole engine param counts as all of them)."""
        if engine_name.endswith("qkv_proj.weight") or engine_name.endswith("qkv_proj.bias"):
            base, kind = engine_name.rsplit(".", 1)
            base = base.removesuffix("qkv_proj")
            return [f"{base}{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
        if ".gate_up_proj." in engine_name:
            base, kind = engine_name.rsplit(".", 1)
            base = base.removesuffix("gate_up_proj")
            return [f"{base}{p}.{kind}" for p in ("gate_proj", "up_proj")]
        return [engine_name]

    # ----------------------------------------------------------------- placements
    def kv_heads_of(self, rank: int) -> int:
        """First KV head index held by ``rank``."""
        if self.kv_replicas == 1:
            return rank * self.kv_local
        return rank // self.kv_replicas

    def placements(self, name: str, rank: int) -> list[Placement]:
        """Where HF tensor ``name`` goes on ``rank`` (empty for a tied lm_head or a rank that holds
        no part of it)."""
        s, d = self.spec, self.spec.head_dim
        if name not in self.hf_shapes:
            if self.accepts(name):
                return []
            raise KeyError(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            v0 = rank * self.vocab_shard
            n = max(0, min(s.vocab_size, v0 + self.vocab_shard) - v0)
            return [Placement(name, _rows(0, n), _rows(v0, v0 + n))] if n else []
        if not name.startswith("model.layers."):
            return [Placement(name, _ALL, _ALL, owner=rank == 0)]
        if ".self_attn." in name:
            prefix, rest = name.split(".self_attn.", 1)
        elif ".mlp." in name:
            prefix, rest = name.split(".mlp.", 1)
        else:   # layer norms
            return [Placement(name, _ALL, _ALL, owner=rank == 0)]
        proj, kind = rest.rsplit(".", 1)
        if ".self_attn." in name:
            qkv = f"{prefix}.self_attn.qkv_proj.{kind}"
            ql, kl = self.q_local * d, self.kv_local * d
            if proj == "q_proj":
                return [Placement(qkv, _rows(0, ql), _rows(rank * ql, (rank + 1) * ql))]
            if proj in ("k_proj", "v_proj"):
                h0 = self.kv_heads_of(rank)
                off = ql if proj == "k_proj" else ql + kl
                owner = self.kv_replicas == 1 or rank % self.kv_replicas == 0
                return [Placement(qkv, _rows(off, off + kl), _rows(h0 * d, h0 * d + kl), owner=owner)]
            if proj == "o_proj":
                if kind == "bias":
                    return [Placement(name, _ALL, _ALL, owner=rank == 0)]
                ql = self.q_local * d
                return [Placement(name, _cols(0, ql), _cols(rank * ql, (rank + 1) * ql))]
        else:
            il = self.inter_local
            gu = f"{prefix}.mlp.gate_up_proj.{kind}"
            if proj == "gate_proj":
                return [Placement(gu, _rows(0, il), _rows(rank * il, (rank + 1) * il))]
            if proj == "up_proj":
                return [Placement(gu, _rows(il, 2 * il), _rows(rank * il, (rank + 1) * il))]
            if proj == "down_proj":
                if kind == "bias":
                    return [Placement(name, _ALL, _ALL, owner=rank == 0)]
                return [Placement(name, _cols(0, il), _cols(rank * il, (rank + 1) * il))]
        raise KeyError(name)


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
    dtype = full[layout.hf_names()[0]].dtype
    shapes = layout.engine_shapes()
    for k in out:
        out[k] = torch.zeros(shapes[k], dtype=dtype)
    for name in layout.hf_names():
        for pl in layout.placements(name, rank):
            out[pl.engine][pl.dst].copy_(full[name][pl.src])
    return out


# --------------------------------------------------------------------------- the forward pass

@dataclass(frozen=True)
class Span:
    """One sequence in a packed batch: its new tokens are ``[offset, offset + n_new)`` of the batch;
    it already has ``n_cached`` tokens in KV-cache slots ``[slot, slot + n_cached)``."""

    offset: int
    n_new: int
    slot: int = 0
    n_cached: int = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TPModel:
    """One TP rank's parameters (a plain dict, so memory can be dropped and reallocated by name)
    and its forward pass over its ``group`` (None when tp_size is 1)."""

    def __init__(self, layout: TPLayout, rank: int, *, dtype: torch.dtype, device: torch.device,
                 group: Any = None):
        self.layout, self.spec, self.rank = layout, layout.spec, rank
        self.dtype, self.device, self.group = dtype, torch.device(device), group
        self.shapes = layout.engine_shapes()
        self.params: dict[str, torch.Tensor] = {}
        d = self.spec.head_dim
        self.inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.inv_freq = self.inv_freq.to(self.device)

    # ----------------------------------------------------------------- parameters
    def allocate(self) -> None:
        self.params = {k: torch.zeros(s, dtype=self.dtype, device=self.device) for k, s in self.shapes.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())

    def init_random(self, seed: int) -> None:
        """Deterministic random weights, identical full tensors for every tp_size: each HF tensor
        is drawn whole from its own generator, then this rank keeps its placements."""
        std = self.spec.initializer_range
        for i, (name, shape) in enumerate(self.layout.hf_shapes.items()):
            if name.endswith("norm.weight"):
                full = torch.ones(shape)
            elif name.endswith(".bias"):
                full = torch.zeros(shape)
            else:
                g = torch.Generator().manual_seed(seed * 100_003 + i)
                full = torch.randn(shape, generator=g) * std
            for pl in self.layout.placements(name, self.rank):
                self.params[pl.engine][pl.dst].copy_(full[pl.src])

    # ----------------------------------------------------------------- collectives
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.layout.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ----------------------------------------------------------------- layers
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.params["model.embed_tokens.weight"]
        if self.layout.tp == 1:
            return F.embedding(ids, w)
        v0 = self.rank * self.layout.vocab_shard
        local = ids - v0
        outside = (local < 0) | (local >= self.layout.vocab_shard)
        out = F.embedding(local.masked_fill(outside, 0), w)
        out = out.masked_fill(outside[:, None], 0)
        return self._all_reduce(out)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                kv_cache: torch.Tensor | None, logits_rows: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (float of the engine dtype) at packed rows ``logits_rows``.

        ``ids``/``positions``: packed new tokens of every span. ``kv_cache``: ``[layers, 2, tokens,
        kv_local, head_dim]`` or None (then every span must have ``n_cached == 0`` and keys are
        not kept).
        """
        s, L = self.spec, self.layout
        d, ql, kl = s.head_dim, L.q_local, L.kv_local
        P = self.params
        x = self.embed(ids)
        cos, sin = self.rope(positions, x.dtype)
        n = ids.shape[0]
        scale = d ** -0.5
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, P[p + "input_layernorm.weight"], s.rms_norm_eps)
            qkv = F.linear(h, P[p + "self_attn.qkv_proj.weight"], P.get(p + "self_attn.qkv_proj.bias"))
            q, k, v = qkv.split([ql * d, kl * d, kl * d], dim=-1)
            q = q.view(n, ql, d)
            k = k.view(n, kl, d)
            v = v.view(n, kl, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = torch.empty(n, ql, d, dtype=x.dtype, device=x.device)
            for sp in spans:
                rows = slice(sp.offset, sp.offset + sp.n_new)
                if kv_cache is not None:
                    a, b = sp.slot + sp.n_cached, sp.slot + sp.n_cached + sp.n_new
                    kv_cache[i, 0, a:b] = k[rows]
                    kv_cache[i, 1, a:b] = v[rows]
                    keys = kv_cache[i, 0, sp.slot:b]
                    vals = kv_cache[i, 1, sp.slot:b]
                else:
                    keys, vals = k[rows], v[rows]
                attn[rows] = self._attend(q[rows], keys, vals, sp.n_cached, scale)
            o = F.linear(attn.view(n, ql * d), P[p + "self_attn.o_proj.weight"])
            o = self._all_reduce(o)
            if s.o_bias:
                o = o + P[p + "self_attn.o_proj.bias"]
            x = x + o
            h = rms_norm(x, P[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            gate, up = F.linear(h, P[p + "mlp.gate_up_proj.weight"],
                                P.get(p + "mlp.gate_up_proj.bias")).chunk(2, dim=-1)
            m = F.linear(F.silu(gate) * up, P[p + "mlp.down_proj.weight"])
            m = self._all_reduce(m)
            if s.mlp_bias:
                m = m + P[p + "mlp.down_proj.bias"]
            x = x + m
        x = rms_norm(x[logits_rows], P["model.norm.weight"], s.rms_norm_eps)
        head = P["model.embed_tokens.weight"] if s.tie_word_embeddings else P["lm_head.weight"]
        logits = self._all_gather_last(F.linear(x, head))
        return logits[:, :s.vocab_size]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_cached: int,
                scale: float) -> torch.Tensor:
        """q ``[n, hq, d]`` against k/v ``[n_cached + n, hkv, d]``, causal; returns ``[n, hq, d]``."""
        n, groups = q.shape[0], q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)[None]
        kh = k.transpose(0, 1)[None]
        vh = v.transpose(0, 1)[None]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        if n_cached == 0:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=scale)
        elif n == 1:
            out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        else:
            keys = torch.arange(n_cached + n, device=q.device)
            mask = keys[None, :] <= (n_cached + torch.arange(n, device=q.device))[:, None]
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)
