"""One TP rank's shard of a decoder (Llama, Qwen2, Qwen3; Qwen3-MoE, Qwen2-MoE, Mixtral), written
from scratch (no transformers modules).

Its parameters are laid out by the layout map, `fsdp_sync.weights.layout` (`ModelSpec`, `TPLayout`,
`Placement`, re-exported here): vocab-parallel embedding and lm_head, fused column-parallel
``qkv_proj`` / ``gate_up_proj``, row-parallel ``o_proj`` / ``down_proj`` followed by an all-reduce,
replicated norms, KV heads replicated when TP exceeds them, Qwen3's per-head q/k norms, and MoE
layers whose experts are fused per layer (``w13_weight`` / ``w2_weight``, split over TP and EP).

`TPModel` holds one rank's parameters and runs the forward pass with its process group:
RMSNorm, rotary embeddings and attention follow transformers' numerics (float32 norm statistics,
cos/sin computed in float32 then cast, SDPA). Attention runs per sequence over its own span of the
KV cache, so prompts of different lengths need no padding.

What the forward does not compute (rope scaling, another activation, sliding-window layers) is
refused by `check_runnable` when a `TPModel` is built, naming it.

Block FP8 (a `fp8.FP8Layout`): each parameter is stored in ``layout.dtype_of`` (quantized weights
as float8_e4m3fn, their ``_scale_inv`` as float32) and each quantized weight is dequantized
(`fp8.dequantize_block`, to the engine dtype) where a matmul uses it; nothing derived is cached, so
no load can leave a stale dequantized copy behind. The matmuls themselves run in the engine dtype
(SGLang's FP8 GEMMs are a GPU matter; the weights they read are the same).

Not here: processes, pipes, payloads and memory tags (`worker`, `regions`), or the engine API
(`engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ModelSpec", "TPLayout", "Placement", "Span", "TPModel", "shard_state_dict", "initial_tensors",
           "check_runnable"]

from ...weights import fp8  # noqa: E402
# the layout map lives in fsdp_sync.weights.layout (one source of truth); re-exported here for old imports
from ...weights.layout import ModelSpec, Placement, TPLayout, shard_state_dict  # noqa: E402,F401


def check_runnable(spec: ModelSpec) -> None:
    """Raise ValueError where this forward would compute another model than ``spec``'s: it knows
    silu, the default rope and full attention only (`ModelSpec.unsupported` says what else the
    config asks for). Run where the reference engine builds its model, so it never serves a wrong
    rope; the layout map itself takes such a model (SGLang runs it)."""
    if spec.unsupported:
        raise ValueError(f"the reference engine cannot compute this {spec.model_type} model (its forward "
                         f"knows silu, the default rope and full attention): {spec.unsupported}")


def initial_tensors(layout: TPLayout, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The full float32 start-up tensors of an engine of ``seed``, ``(hf name, tensor)`` in HF order:
    norms ones, biases zeros, every other tensor drawn whole from its own generator (``N(0,
    initializer_range)``, seeded by `_draw_seed`). Scales are not drawn (a quantized engine
    quantizes these), so one seed gives the same weights quantized or not, at every TP size."""
    std = layout.spec.initializer_range
    scales = {fp8.scale_name(n) for n in getattr(layout, "quantized", ())}
    for i, name in enumerate(n for n in layout.hf_shapes if n not in scales):
        shape = layout.hf_shapes[name]
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape)
        else:
            yield name, torch.randn(shape, generator=torch.Generator().manual_seed(_draw_seed(seed, i))) * std


def _draw_seed(seed: int, i: int) -> int:
    """The generator seed of tensor ``i``'s start-up draw: ``seed * 100_003 + i`` where torch takes
    it (every seed in use before), else that number folded into ``[0, 2**64)``, so every seed
    `engine_args.check_engine_args` takes (up to 2**64 - 1, down to -2**63) starts an engine."""
    s = seed * 100_003 + i
    return s if -(2 ** 63) <= s < 2 ** 64 else s % 2 ** 64


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
        check_runnable(layout.spec)
        self.layout, self.spec, self.rank = layout, layout.spec, rank
        self.dtype, self.device, self.group = dtype, torch.device(device), group
        self.shapes = layout.engine_shapes()
        self.quantized: frozenset[str] = getattr(layout, "engine_quantized", frozenset())
        self.params: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, Any] = {}   # LoRA adapters by name (`lora.LoRAShard`)
        self._active: list[tuple[Any, torch.Tensor | None]] = []   # this forward's (adapter, rows)
        d = self.spec.head_dim
        self.inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.inv_freq = self.inv_freq.to(self.device)

    # ----------------------------------------------------------------- parameters
    def allocate(self) -> None:
        self.params = {k: torch.zeros(s, dtype=self.layout.dtype_of(k, self.dtype), device=self.device)
                       for k, s in self.shapes.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())

    def init_random(self, seed: int) -> None:
        """Deterministic random weights, identical full tensors for every tp_size
        (`initial_tensors`), of which this rank keeps its placements. Block FP8: each quantized
        weight is cast to the engine dtype and quantized (`fp8.quantize_block`, as SGLang
        quantizes a checkpoint online), then its weight and its scale are placed."""
        quantized = getattr(self.layout, "quantized", frozenset())
        for name, full in initial_tensors(self.layout, seed):
            pairs = [(name, full)]
            if name in quantized:
                q, scale = fp8.quantize_block(name, full.to(self.dtype), self.layout.block)
                pairs = [(name, q), (fp8.scale_name(name), scale)]
            for n, t in pairs:
                for pl in self.layout.placements(n, self.rank):
                    self.params[pl.engine][pl.dst].copy_(t[pl.src])

    def weight(self, name: str, index: int | None = None) -> torch.Tensor:
        """Parameter ``name`` (``index``: one expert of a fused 3-D one) as a matmul takes it: a
        block-FP8 weight dequantized with its ``_scale_inv`` into the engine dtype, at every use."""
        w = self.params[name] if index is None else self.params[name][index]
        if name not in self.quantized:
            return w
        s = self.params[name + "_scale_inv"]
        return fp8.dequantize_block(w, s if index is None else s[index], self.dtype, self.layout.block)

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

    def linear(self, h: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` of engine weight ``name``, plus each active LoRA adapter's ``scale * B A h``
        on its rows (`lora.LoRAShard.apply`; this rank's share of a row-parallel layer's partial sum)."""
        y = F.linear(h, self.weight(name), bias)
        for adapter, rows in self._active:
            y = adapter.apply(name, h, y, rows)
        return y

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                kv_cache: torch.Tensor | None, logits_rows: torch.Tensor,
                lora: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Full-vocabulary logits (float of the engine dtype) at packed rows ``logits_rows``.

        ``ids``/``positions``: packed new tokens of every span. ``kv_cache``: ``[layers, 2, tokens,
        kv_local, head_dim]`` or None (then every span must have ``n_cached == 0`` and keys are
        not kept). ``lora``: loaded adapter name -> the packed rows it applies to (None: all).
        """
        missing = [n for n in (lora or {}) if n not in self.adapters]
        if missing:
            raise KeyError(f"LoRA adapter {missing[0]!r} is not loaded (loaded: {sorted(self.adapters)})")
        self._active = [(self.adapters[n], rows) for n, rows in (lora or {}).items()]
        try:
            return self._forward(ids, positions, spans, kv_cache, logits_rows)
        finally:
            self._active = []

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                 kv_cache: torch.Tensor | None, logits_rows: torch.Tensor) -> torch.Tensor:
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
            qkv = self.linear(h, p + "self_attn.qkv_proj.weight", P.get(p + "self_attn.qkv_proj.bias"))
            q, k, v = qkv.split([ql * d, kl * d, kl * d], dim=-1)
            q = q.view(n, ql, d)
            k = k.view(n, kl, d)
            v = v.view(n, kl, d)
            if s.qk_norm:   # Qwen3: per-head RMSNorm before rope
                q = rms_norm(q, P[p + "self_attn.q_norm.weight"], s.rms_norm_eps)
                k = rms_norm(k, P[p + "self_attn.k_norm.weight"], s.rms_norm_eps)
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
            o = self.linear(attn.view(n, ql * d), p + "self_attn.o_proj.weight")
            o = self._all_reduce(o)
            if s.o_bias:
                o = o + P[p + "self_attn.o_proj.bias"]
            x = x + o
            h = rms_norm(x, P[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
            if i in s.moe_layers:
                m = self._all_reduce(self._moe(h, f"{p}{s.moe_prefix}."))
            else:
                m = self._all_reduce(self._mlp(h, p + "mlp."))
                if s.mlp_bias:
                    m = m + P[p + "mlp.down_proj.bias"]
            x = x + m
        x = rms_norm(x[logits_rows], P["model.norm.weight"], s.rms_norm_eps)
        head = P["model.embed_tokens.weight"] if s.tie_word_embeddings else P["lm_head.weight"]
        logits = self._all_gather_last(F.linear(x, head))
        return logits[:, :s.vocab_size]

    def _mlp(self, h: torch.Tensor, m: str) -> torch.Tensor:
        """This rank's partial sum of a gated MLP (``m``: its prefix); the caller all-reduces."""
        gate, up = self.linear(h, m + "gate_up_proj.weight", self.params.get(m + "gate_up_proj.bias")).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, m + "down_proj.weight")

    def _moe(self, h: torch.Tensor, m: str) -> torch.Tensor:
        """This rank's partial sum of a sparse MoE block: routing as transformers does it (softmax
        in float32, top-k, renormalized when the config says so, Qwen's weights cast back to the
        activations' dtype, Mixtral's kept in float32), then the experts this rank holds, each on
        the tokens routed to it, plus Qwen2-MoE's sigmoid-gated shared expert. The caller
        all-reduces (one all-reduce for attention-free MoE, experts and shared expert alike)."""
        s, P = self.spec, self.params
        logits = F.linear(h, P[m + "gate.weight"])
        top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), s.top_k, dim=-1)
        if s.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if s.model_type != "mixtral":
            top_w = top_w.to(logits.dtype)
        out = torch.zeros_like(h)
        for le, e in enumerate(self.layout.expert_range(self.rank)):
            tok, pos = torch.where(top_i == e)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(h[tok], self.weight(m + "experts.w13_weight", le)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.weight(m + "experts.w2_weight", le)) * top_w[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if s.shared_expert_intermediate_size:
            shared = self._mlp(h, m + "shared_expert.")
            out = out + torch.sigmoid(F.linear(h, P[m + "shared_expert_gate.weight"])) * shared
        return out

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
