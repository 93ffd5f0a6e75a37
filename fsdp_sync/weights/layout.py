"""The layout map: where each Hugging Face tensor of a Llama/Qwen2-family decoder lands on each
tensor-parallel (TP) rank of the rollout engine. The one source of truth for the reference
engine's sharding, the per-rank buckets (`reshard`) and the SGLang custom weight loader.

`ModelSpec` reads what the layout needs from a ``transformers`` config and refuses what the engine
cannot run (other activations, rope scaling, sliding-window layers) with a clear error.
`TPLayout(spec, tp_size)` is a pure function of the two, the same split as SGLang's for these
models:

- vocab-parallel ``embed_tokens`` and ``lm_head``: the vocab is padded up to a multiple of
  `VOCAB_PADDING` (64, SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``) and split evenly, so rank r owns
  ids ``[r*Vs, (r+1)*Vs)`` with ``Vs = round_up(V, 64) / tp`` (SGLang's per-rank shape); the padding rows of the last shard are zero; a tied ``lm_head`` is the
  embedding shard, and the engine has no ``lm_head`` parameter of its own);
- column-parallel fused ``qkv_proj`` (rows ``[q heads | k heads | v heads]`` of this rank, biases
  split the same way) and fused ``gate_up_proj`` (rows ``[gate | up]``, biases too);
- row-parallel ``o_proj`` and ``down_proj``: a column slice of the weight; their biases (if any)
  replicated, added once after the all-reduce;
- replicated RMSNorm weights;
- GQA: KV heads split across ranks when there are at least as many as TP ranks, otherwise each
  rank holds (a replica of) the one KV head its query heads use, as SGLang does; this needs
  ``tp % num_key_value_heads == 0``.

A `Placement` says where a piece of a full HF tensor lives in a rank's own parameter
(``engine_param[dst] = full[src]``), with ``src`` a block of rows or of columns. Loading,
gathering (`get_weights_by_name`), `shard_state_dict` ("direct" payloads) and the per-rank
buckets all use the same placements. `TPLayout.sources` is the reverse map: which HF tensors
(and which blocks of them) make up one engine parameter on one rank.

Not here: moving data between processes (`reshard`, `handles`), the model math (`engines.reference.tp_model`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB_PADDING = 64
"""The vocab is padded to a multiple of this before the TP split (SGLang's default padding)."""

__all__ = ["VOCAB_PADDING", "ModelSpec", "TPLayout", "Placement", "shard_state_dict", "layout_for", "block_of",
           "rank_digest"]


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
        # SGLang's VocabParallelEmbedding/ParallelLMHead: pad to 64, then an even split
        self.vocab_shard = math.ceil(math.ceil(s.vocab_size / VOCAB_PADDING) * VOCAB_PADDING / tp_size)
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
        return sum(math.prod(s) for s in self.engine_shapes().values()) * itemsize


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


def layout_for(config: Any, tp_size: int) -> TPLayout:
    """The layout map of a ``transformers`` config (or a `ModelSpec`) at ``tp_size``."""
    spec = config if isinstance(config, ModelSpec) else ModelSpec.from_config(config)
    return TPLayout(spec, tp_size)


def block_of(sl: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A placement's slices as a block ``rows [r0, r1) x cols [c0, c1)`` of the tensor viewed as
    2-D (a 1-D tensor of n elements is ``n x 1``)."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
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
