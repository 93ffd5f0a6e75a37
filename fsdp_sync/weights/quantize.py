"""Quantizing a sync's stream on the trainer side (``SyncConfig.quantization``): after the gather,
bucket by bucket, on the device the bucket is on, before any handle is made or byte is sent.

A `StreamQuantizer` is made per sync from the model's layout map at the engine's TP/EP
(`fp8.FP8Layout`: which tensors are quantized, and a refusal naming the tensor and the split when
a TP cut would split a 128 block). The layers the model config's ``quantization_config`` leaves
unquantized (``ignored_layers`` / ``modules_to_not_convert``, read as SGLang and the reference
engine read them: `fp8_config.ignored_layers`) stay in the rollout dtype, so every transport,
the manager's coverage check and verify send and expect what the engine holds. It turns each item of the three kinds of stream the transports
consume into its block-FP8 form:

- a full-tensor bucket (`export.iter_buckets`: HF names; tensor ``flattened``, distributed,
  disk): `StreamQuantizer.bucket` returns a new bucket in which each quantized ``X.weight``
  is ``float8_e4m3fn`` followed by ``X.weight_scale_inv`` (float32), the other tensors' bytes
  copied as they are. One input bucket gives one output bucket, its entries ordered by item size
  (8, 4, 2, 1 bytes, stable), so both the 16-byte aligned layout and SGLang's tight broadcast layout
  (``tight=True``, `bucket.plan_tight`) hold it without padding between dtypes;
- a per-rank bucket (`reshard.iter_rank_buckets`: engine names, one engine rank's slice each;
  ``layout="engine"``): `StreamQuantizer.rank_bucket` quantizes each buffer this rank holds.
  Because no split cuts a block, a rank's slice quantized on its own is bit for bit that slice of
  the full tensor's quantization: the same blocks, the same amax, the same scale;
- ``(name, tensor)`` pairs (`export.iter_params`: the per-tensor and bucketed strategies, verify's
  sample mode): `StreamQuantizer.named`.

`sync_metas` gives the names, dtypes and shapes the engine receives (the scales included), for the
manager's coverage check, verify and the bench. The quantization time is counted in
``seconds`` (the sync's stats report it as its own stage, ``quantize_s``), and the bytes before
and after in ``bytes_in`` / ``bytes_out``.

Not here: the quantizer's math (`fp8`), gathering (`export`, `reshard`), who sends what where (the
transports), loading (the engines).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from . import bucket as _bucket
from . import fp8, fp8_config
from .layout import ModelSpec, layout_for, names_layout

__all__ = ["StreamQuantizer", "for_sync", "sync_metas", "quantized_hf_names", "held_layout"]


# What a sync's quantizer is cut by, worked out once for a run's syncs, not at every sync (each
# entry is the last one asked for; qwen3-235b-a22b at TP 8, EP 8 on this host: the config's
# ignored layers 0.21 s, its FP8Layout 0.73 s, the quantized names 0.35 s, every FP8 sync). The
# keys hold what each depends on: the model, the config's quantization_config, SGLang's
# environment variable (`fp8_config.ENV`), and the split and ignored layers of a layout.
_IGNORED: dict = {}
_NAMES: dict = {}
_HELD: dict = {}


def _last(cache: dict, key: tuple, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made (and the one entry kept) where it is not the last one asked for."""
    if key not in cache:
        value = make()            # a refusal raises here and is asked again next time
        cache.clear()
        cache[key] = value
    return cache[key]


def _config_key(cfg: Any, spec: ModelSpec) -> tuple:
    return (spec, repr(fp8_config.quantization_config(cfg)), os.environ.get(fp8_config.ENV, ""))


def _ignored(cfg: Any, spec: ModelSpec) -> tuple[str, ...]:
    return _last(_IGNORED, _config_key(cfg, spec),
                 lambda: tuple(fp8_config.ignored_layers(cfg, names_layout(spec))))


def _layout(module: torch.nn.Module, tp: int, ep: int, ignored: Iterable[str] | None = None) -> fp8.FP8Layout:
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ValueError("quantization='fp8' needs the module's Hugging Face .config: the layout "
                         "map says which tensors SGLang quantizes and how the engine's TP cuts them")
    spec = layout_for(cfg, tp, ep).spec      # refuses a split the layout map cannot cut
    # the model config's own list, as the engines started from it read it
    ignored = _ignored(cfg, spec) if ignored is None else tuple(ignored)
    return _last(_HELD, (spec, tp, ep, ignored), lambda: fp8.FP8Layout(spec, tp, ep, ignored=ignored))


def held_layout(module: torch.nn.Module, layout: Any, quantization: str | None) -> Any:
    """``layout`` (the module's layout map at the engine's split) as the engine holds it under
    ``quantization``: itself, or the `fp8.FP8Layout` the sync's quantizer cuts by."""
    if quantization is None:
        return layout
    return _layout(module, layout.tp, layout.ep)


def quantized_hf_names(module: torch.nn.Module) -> frozenset[str]:
    """The HF tensors of ``module`` that travel as FP8 (any TP: the set does not depend on it):
    SGLang's Fp8 layers but those the config's ``quantization_config`` leaves unquantized."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ValueError("quantization='fp8' needs the module's Hugging Face .config (which tensors "
                         "to quantize is read from the layout map)")
    spec = ModelSpec.from_config(cfg)
    return _last(_NAMES, _config_key(cfg, spec),
                 lambda: frozenset(fp8.quantized_names(names_layout(spec), _ignored(cfg, spec))))


def sync_metas(module: torch.nn.Module, config: Any) -> list[_bucket.TensorMeta]:
    """What a sync of ``module`` under ``config`` sends, by HF name: `export.param_metas`, with
    each quantized weight as float8_e4m3fn followed by its ``weight_scale_inv`` under
    ``config.quantization``."""
    from . import export

    metas = export.param_metas(module, config.dtype)
    if getattr(config, "quantization", None) is None:
        return metas
    return expand_metas(metas, quantized_hf_names(module))


def expand_metas(metas: Iterable[_bucket.TensorMeta], quantized: frozenset[str]) -> list[_bucket.TensorMeta]:
    """``metas`` with each quantized weight turned fp8 and followed by its scale."""
    out = []
    for m in metas:
        if m.name in quantized:
            out.append(_bucket.TensorMeta(m.name, torch.float8_e4m3fn, m.shape))
            out.append(_bucket.TensorMeta(fp8.scale_name(m.name), torch.float32, fp8.scale_shape(m.shape)))
        else:
            out.append(m)
    return out


def for_sync(module: torch.nn.Module, config: Any, tp: int, ep: int = 1, *,
             tight: bool = False, ignored: Iterable[str] | None = None) -> "StreamQuantizer | None":
    """The quantizer of one sync into engines of TP ``tp`` and EP ``ep`` (None when
    ``config.quantization`` is None). ``ignored``: the engine's ignored layers (module paths,
    SGLang's ``ignored_layers`` / ``modules_to_not_convert``), left in the rollout dtype as
    `fp8.is_quantized` matches them; None (the default): the module config's own list
    (`fp8_config.ignored_layers`, which refuses a list the engines read differently). Raises
    ValueError for a model the layout map does not know, a split that cuts a block, or an
    ``ignored`` list that splits a fused layer; call it where every rank hears of a failure
    (`agree`)."""
    if getattr(config, "quantization", None) is None:
        return None
    return StreamQuantizer(_layout(module, tp, ep, ignored), tight=tight)


class StreamQuantizer:
    """Quantizes buckets, per-rank buckets and ``(name, tensor)`` pairs of one sync (see the
    module docstring). ``tight``: full-tensor output buckets in SGLang's broadcast layout (no
    padding); per-rank buckets are always 16-byte aligned, their own wire layout."""

    def __init__(self, layout: fp8.FP8Layout, *, tight: bool = False) -> None:
        self.layout = layout
        self.hf: frozenset[str] = layout.quantized
        self.engine: frozenset[str] = layout.engine_quantized
        self.block = layout.block
        self.tight = tight
        self.seconds = 0.0
        self.bytes_in = 0
        self.bytes_out = 0
        self.tensors = 0
        self._plans: dict[tuple, _bucket.Bucket] = {}

    # ------------------------------------------------------------------ plans (pure)
    def plan(self, bkt: _bucket.Bucket, engine: bool = False) -> _bucket.Bucket:
        """The output bucket of input bucket ``bkt`` (HF names, or engine names with ``engine``)."""
        key = (bkt, engine)
        out = self._plans.get(key)
        if out is None:
            quantized = self.engine if engine else self.hf
            metas = expand_metas((_bucket.TensorMeta(e.name, e.dtype, e.shape) for e in bkt.entries),
                                 quantized)
            metas.sort(key=lambda m: -m.dtype.itemsize)          # stable: 8, 4, 2, 1 bytes
            total = sum(m.nbytes for m in metas) + _bucket.ALIGNMENT * len(metas) + 1
            # per-rank buckets go out in their own wire layout (`wire.per_rank_bucket_plan`: aligned)
            tight = self.tight and not engine
            plans = _bucket.plan_tight(metas, total) if tight else _bucket.plan_buckets(metas, total)
            if len(plans) > 1:      # pragma: no cover - the sort above makes one bucket hold it
                raise RuntimeError(f"quantized bucket of {bkt.names[:2]} did not fit one bucket")
            out = plans[0] if plans else _bucket.Bucket((), 0)
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = out
        return out

    # ------------------------------------------------------------------ data
    def bucket(self, bkt: _bucket.Bucket, flat: torch.Tensor, alloc: Callable[[int], torch.Tensor],
               *, engine: bool = False, rank: int | None = None) -> tuple[_bucket.Bucket, torch.Tensor]:
        """``(output bucket, its buffer from alloc)`` of bucket ``bkt`` held in ``flat``, on
        ``alloc``'s device (the bucket's own device: pass an alloc on it). ``rank``: the engine
        rank whose slices ``bkt`` holds (``engine``): a NaN or Inf is then named by its HF tensor
        and its place in the full tensor (`slice_refusal`), not in the slice."""
        t0 = time.perf_counter()
        out = self.plan(bkt, engine)
        quantized = self.engine if engine else self.hf
        dst = alloc(out.nbytes)
        if not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.numel() < out.nbytes:
            raise ValueError(f"alloc({out.nbytes}) must return a 1-D uint8 tensor of at least that many bytes")
        dst = dst[:out.nbytes]
        places = {e.name: e for e in out.entries}
        with torch.no_grad():   # zero the padding: bytes are hashed
            _bucket.zero_gaps(dst, sorted(out.entries, key=lambda e: e.start), out.nbytes)
            dsts, srcs = [], []         # the tensors passed through unquantized: one fused copy
            scales, done = [], []
            for src, (name, t) in zip(bkt.entries, _bucket.unflatten(flat, bkt.entries)):
                if name in quantized:
                    e, se = places[name], places[fp8.scale_name(name)]   # q and its scale in place
                    _, s = fp8.quantize_block(name, t.to(dst.device), self.block, check=False,
                                              out=dst[e.start:e.end].view(e.dtype).view(e.shape),
                                              scale_out=dst[se.start:se.end].view(se.dtype).view(se.shape))
                    scales.append(s)
                    done.append((name, t))
                    self.tensors += 1
                else:
                    e = places[name]
                    dsts.append(dst[e.start:e.end])
                    srcs.append(flat[src.start:src.end])
            _bucket.copy_many(dsts, srcs)
            # one wait for the device per bucket (it also puts the kernels' time in `seconds`)
            if not fp8.scales_finite(scales):
                for name, t in done:
                    if engine and rank is not None:
                        bad = ~torch.isfinite(t)
                        if bool(bad.any()):
                            raise ValueError(self.slice_refusal(name, t, rank, bad))
                    fp8.check_finite(name, t)
                raise RuntimeError(f"a scale of bucket {bkt.names[:2]} is not finite but no weight "
                                   f"holds a NaN or Inf")   # pragma: no cover - amax propagates NaN
        self.bytes_in += bkt.payload_bytes
        self.bytes_out += out.payload_bytes
        self.seconds += time.perf_counter() - t0
        return out, dst

    def rank_bucket(self, rb: Any, alloc: Callable[[int], torch.Tensor],
                    ranks: Iterable[int] | None = None) -> Any:
        """A `reshard.RankBucket` with each buffer of ``ranks`` (default: all it holds) quantized
        into a fresh one from ``alloc``; the input buffers are not kept."""
        from .reshard import RankBucket

        keep = rb.buffers if ranks is None else {r: rb.buffers[r] for r in ranks if r in rb.buffers}
        out_bkt, buffers = self.plan(rb.bucket, engine=True), {}
        for r, flat in keep.items():
            out_bkt, buffers[r] = self.bucket(rb.bucket, flat, alloc, engine=True, rank=r)
        return RankBucket(rb.index, out_bkt, buffers, shared=False)

    def slice_refusal(self, name: str, t: torch.Tensor, rank: int, bad: torch.Tensor) -> str:
        """The refusal of engine rank ``rank``'s slice ``t`` of engine parameter ``name``, whose
        non-finite values ``bad`` marks: the HF tensor and the place in the full tensor of the
        first (`TPLayout.sources` maps the slice back), the engine rank, the count in the slice."""
        pos = tuple(int(i) for i in bad.nonzero()[0])
        value = t[pos].item()
        hf, full = name, None
        for src_name, pl in self.layout.sources(rank).get(name, ()):
            full = _full_place(pl, pos, tuple(t.shape), self.layout.full_shape(src_name))
            if full is not None:
                hf = src_name
                break
        where = (f"first at {full} of the full {tuple(self.layout.full_shape(hf))} tensor"
                 if full is not None else f"first at {pos} of the slice")
        return (f"cannot quantize {hf!r} to fp8 on engine rank {rank}: {int(bad.sum())} of the "
                f"{t.numel()} values of its {tuple(t.shape)} slice of {name!r} are NaN or Inf "
                f"({where}: {value})")

    def named(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs with each quantized weight replaced by ``(name, q)`` and
        ``(scale name, scale)``."""
        for name, t in items:
            if name in self.hf:
                t0 = time.perf_counter()
                q, s = fp8.quantize_block(name, t, self.block)
                self.seconds += time.perf_counter() - t0
                self.bytes_in += t.numel() * t.element_size()
                self.bytes_out += q.numel() + s.numel() * 4
                self.tensors += 1
                del t
                yield name, q
                yield fp8.scale_name(name), s
            else:
                yield name, t

    def figures(self) -> dict[str, Any]:
        """What this sync's quantization did, for `SyncStats.extra`."""
        return {"quantization": "fp8", "quantize_s": self.seconds, "quantized_tensors": self.tensors,
                "quantize_bytes_in": self.bytes_in, "quantize_bytes_out": self.bytes_out}


def _full_place(pl: Any, pos: tuple[int, ...], shape: tuple[int, ...],
                full: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where element ``pos`` of an engine rank's parameter (of ``shape``) lies in the full HF
    tensor (of ``full``) that placement ``pl`` fills it from; None where ``pl`` does not cover it."""
    dst, pos, shape = pl.dst, list(pos), list(shape)
    if dst and isinstance(dst[0], int):              # (expert, rows[, cols]) of a fused 3-D parameter
        if pos[0] != dst[0]:
            return None
        dst, pos, shape = dst[1:], pos[1:], shape[1:]
    if len(pos) != len(full):
        return None
    out = []
    for i, p in enumerate(pos):
        d0, d1, _ = (dst[i] if i < len(dst) else slice(None)).indices(shape[i])
        if not d0 <= p < d1:
            return None
        s0 = (pl.src[i] if i < len(pl.src) else slice(None)).indices(full[i])[0]
        out.append(s0 + p - d0)
    return tuple(out)
