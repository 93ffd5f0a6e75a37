"""SGLang's weight checksums, recomputed by the trainer: what ``POST /weights_checker``
``{"action": "checksum"}`` reports for each TP rank's own parameters, from full Hugging Face tensors.

SGLang 0.5.23 (``sglang/srt/utils/weight_checker.py``, ``WeightChecker._compute_checksum``) hashes,
per TP rank, every ``named_parameters()`` and ``named_buffers()`` entry of its model except the
non-persistent rotary caches (names containing ``cos_sin_cache``, ``cos_cache``, ``sin_cache``,
``inv_freq``, ``freqs_cis``, ``expert_mask_gpu``), parameters marked ``_skip_weight_check`` (kv-cache
scales) and the request's ``skip_tensor_list`` patterns; quantized weights are hashed dequantized.
SGLang 0.5.12 (verl 0.9.1's pin) hashes the same way with the same ``tensor_hash``, skipping
``cos_sin_cache`` / ``inv_freq`` / ``freqs_cis`` / ``_weight_fp32`` and taking no ``skip_tensor_list``:
its extra entries are names the layout map has none of, so `Checker` reads both answers alike.
Each hash is ``sglang/srt/managers/mm_utils.py:tensor_hash`` of the tensor as it lies, printed
``f"{h:016x}"``:

- a CPU tensor (`cpu_hash`): the first 8 bytes, big-endian, of sha256 over the contiguous tensor's
  bytes (its own dtype, nothing else hashed: no name, shape or dtype);
- a CUDA tensor (`gpu_hash`): ``sglang/kernels/ops/memory/gpu_tensor_hash.py``: the contiguous bytes,
  zero-padded to 4-byte words; per tile of 8192 words two 32-bit sums of ``fmix32(word ^ pos(i))``
  (two position mixes of the global word index, seeded), each xor'ed with the tensor's byte count
  and finished with ``fmix32``; the tiles' ``hi << 32 | lo`` summed mod 2**64 and finished with
  splitmix64 (an empty tensor hashes to 0). Written here in torch integer ops (int64, exact
  mod-2**32 products), so it runs on the trainer's device; checked against SGLang's own Triton
  kernel run by Triton's interpreter on CPU (the SGLang tier).

Which bytes a TP rank holds comes from the layout map (`weights.layout.TPLayout`): `RankParams`
assembles, from full HF tensors streamed in any order, each engine parameter of every TP rank as
soon as all its pieces arrived (fused ``qkv_proj`` / ``gate_up_proj``, vocab shards with zero
padding rows as SGLang's own loader leaves them, expert ``w13_weight`` / ``w2_weight`` of the
rank's experts), hands it out once and forgets it: the trainer holds one engine parameter (all
ranks) at a time, never the model. `Checker` compares those with a ``/weights_checker`` answer,
and names every weight SGLang reports that the layout has no parameter for (`unfilled`: no sync
writes it, e.g. the lm_head SGLang's MoE classes keep apart from a tied embedding).

Unchecked: parameters a runtime repacks after loading (SGLang's ``process_weights_after_loading``:
CPU AMX packing of linear and expert weights, ROCm aiter shuffles, the flashinfer TRT-LLM block
layout, the opt-in ``SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED`` w13 row interleave, ``triton_kernels``'
transposed experts) hash their repacked bytes, which this module does not reproduce: such a server
reports a mismatch for those parameters. Quantized weights (hashed dequantized) are not handled.

Imports only torch and the layout map; no sglang import.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator

import torch

from ...weights.layout import TPLayout

__all__ = ["ALGORITHMS", "NON_PERSISTENT", "cpu_hash", "gpu_hash", "hex_hash", "RankParams",
           "expected_checksums", "rank_reports", "where_on", "Checker", "unfilled"]

NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
"""Name patterns SGLang's checker never hashes (``_NON_PERSISTENT_BUFFER_PATTERNS``)."""

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_POS_A, _POS_B = 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as SGLang reads them: contiguous, flattened, uint8."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def cpu_hash(t: torch.Tensor) -> int:
    """``tensor_hash`` of a CPU tensor: sha256 of its bytes, the first 8 bytes big-endian."""
    raw = _raw(t)
    raw = raw.cpu() if raw.device.type != "cpu" else raw
    return int.from_bytes(hashlib.sha256(memoryview(raw.numpy())).digest()[:8], "big")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x < 2**32: split c in 16-bit halves so no int64 product overflows
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def gpu_hash(t: torch.Tensor, *, seed: int = _SEED, tile_words: int = 8192,
             chunk_tiles: int = 64) -> int:
    """``gpu_tensor_hash`` (SGLang's hash of a CUDA tensor) in torch, on ``t``'s own device.
    ``chunk_tiles`` bounds the temporaries (a few int64 copies of that many tiles)."""
    raw = _raw(t)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    n = words.numel()
    if n == 0:
        return 0
    s1 = seed & _M32
    s2 = ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    hi = lo = 0
    step = tile_words * chunk_tiles
    for start in range(0, n, step):
        v = words[start:start + step].to(torch.int64) & _M32
        i = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device) & _M32
        p1 = ((_mul32(i, _POS_A) + s1) & _M32) ^ _rotl32(i, 15)
        p2 = ((_mul32(i, _POS_B) + s2) & _M32) ^ _rotl32(i, 13)
        k = torch.stack([_fmix32(v ^ p1), _fmix32(v ^ p2)])
        del v, i, p1, p2
        tail = (-k.shape[1]) % tile_words          # the last tile's missing words count 0
        if tail:
            k = torch.cat([k, k.new_zeros(2, tail)], dim=1)
        h = _fmix32((k.view(2, -1, tile_words).sum(dim=2) & _M32) ^ nbytes)
        hi += int(h[0].sum())
        lo += int(h[1].sum())
    return _splitmix64((hi << 32) + lo)


ALGORITHMS = {"cpu": cpu_hash, "gpu": gpu_hash}
"""SGLang's hash by where the parameter lives: ``"cpu"`` (sha256) or ``"gpu"`` (the tile hash)."""


def hex_hash(t: torch.Tensor, algorithm: str = "cpu") -> str:
    """What ``/weights_checker`` prints for a tensor: 16 hex digits."""
    return f"{ALGORITHMS[algorithm](t):016x}"


class RankParams:
    """Every TP rank's engine parameters, assembled from full HF tensors fed in any order.

    ``add(hf_name, full)`` returns ``[(engine_name, [tensor of rank 0, 1, ...]), ...]`` for the
    engine parameters that tensor completed (each returned once, then dropped). ``names``: only
    these engine parameters (HF tensors feeding none are ignored). ``dtype``: cast to the
    engine's dtype (default: the first tensor's). A tied ``lm_head.weight`` feeds nothing."""

    def __init__(self, layout: TPLayout, names: Iterable[str] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.layout, self.dtype = layout, dtype
        wanted = set(layout.engine_shapes()) if names is None else set(names)
        unknown = sorted(wanted - set(layout.engine_shapes()))
        if unknown:
            raise KeyError(f"not engine parameters of this layout: {unknown[:3]}")
        self.need: dict[str, set[str]] = {n: set() for n in wanted}
        for r in range(layout.tp):
            for engine, pieces in layout.sources(r).items():
                if engine in wanted:
                    self.need[engine].update(hf for hf, _ in pieces)
        self._bufs: dict[str, list[torch.Tensor]] = {}

    def hf_names(self) -> set[str]:
        """The HF tensors the wanted engine parameters are built from."""
        return set().union(*self.need.values()) if self.need else set()

    def pending(self) -> list[str]:
        """Engine parameters still waiting for pieces (in the layout's order)."""
        return [n for n in self.layout.engine_shapes() if n in self.need]

    def add(self, name: str, full: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]:
        lay, done = self.layout, []
        touched: list[str] = []
        for r in range(lay.tp):
            for pl in lay.placements(name, r):
                if pl.engine not in self.need:
                    continue
                bufs = self._bufs.get(pl.engine)
                if bufs is None:
                    dtype = self.dtype or full.dtype
                    shape = lay.engine_shapes()[pl.engine]
                    bufs = self._bufs[pl.engine] = [torch.zeros(shape, dtype=dtype, device=full.device)
                                                    for _ in range(lay.tp)]
                bufs[r][pl.dst].copy_(full[pl.src])
                if pl.engine not in touched:
                    touched.append(pl.engine)
        for engine in touched:
            self.need[engine].discard(name)
            if not self.need[engine]:
                del self.need[engine]
                done.append((engine, self._bufs.pop(engine)))
        return done


def expected_checksums(layout: TPLayout, tensors: Iterable[tuple[str, torch.Tensor]], *,
                       algorithm: str = "cpu", names: Iterable[str] | None = None,
                       dtype: torch.dtype | None = None) -> Iterator[tuple[str, list[str]]]:
    """``(engine_name, [hex of rank 0, 1, ...])`` as each engine parameter completes."""
    rp = RankParams(layout, names, dtype)
    for name, t in tensors:
        for engine, per_rank in rp.add(name, t):
            yield engine, [hex_hash(x, algorithm) for x in per_rank]
    if rp.pending():
        raise KeyError(f"the tensors did not complete {rp.pending()[:3]} ({len(rp.pending())} "
                       f"engine parameters)")


def rank_reports(answer: Any, tp_size: int) -> dict[int, list[dict[str, str]]]:
    """A ``/weights_checker`` checksum answer as ``{tp_rank: [checksums of each replica]}``: the
    target model's entries (drafts left out), pipeline stages of one replica merged."""
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"expected a checksum answer with 'ranks', got {str(answer)[:200]!r}")
    merged: dict[tuple[int, int], dict[str, str]] = {}
    for entry in ranks:
        info = entry.get("parallelism_info") or {}
        if info.get("role", "target") != "target":
            continue
        tp, dp = int(info.get("tp_rank", 0)), int(info.get("dp_rank", 0) or 0)
        if int(info.get("tp_size", tp_size)) != tp_size:
            raise ValueError(f"SGLang reports tp_size {info.get('tp_size')}, the layout has {tp_size}")
        merged.setdefault((dp, tp), {}).update({str(k): str(v) for k, v in entry["checksums"].items()})
    out: dict[int, list[dict[str, str]]] = {r: [] for r in range(tp_size)}
    for (_, tp), sums in sorted(merged.items()):
        out[tp].append(sums)
    missing = [r for r, v in out.items() if not v]
    if missing:
        raise ValueError(f"no checksums reported for TP ranks {missing}")
    return out


def where_on(tp_rank: int, replica: int, replicas: int) -> str:
    """``"TP rank r"``, with the data-parallel replica where the server has more than one
    (`rank_reports` lists each TP rank's replicas in ``dp_rank`` order)."""
    return f"TP rank {tp_rank}" + (f" of DP replica {replica}" if replicas > 1 else "")


class Checker:
    """Compares a ``/weights_checker`` answer with the trainer's tensors, streamed.

    ``feed(hf_name, full)`` for each trainer tensor; it returns one line per difference found in
    the engine parameters that tensor completed (``"'<engine name>' on TP rank r: SGLang hashes
    …, the trainer's bytes hash …"``). ``finish()`` adds the parameters never completed, and those
    SGLang reports that the layout never fills (`unfilled`). ``algorithm``: the server's hash (``"gpu"`` for a CUDA server); on a difference the
    other one is tried too (a CPU-offloaded parameter of a GPU server is hashed on CPU)."""

    def __init__(self, layout: TPLayout, answer: Any, *, algorithm: str = "cpu",
                 names: Iterable[str] | None = None, dtype: torch.dtype | None = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
        self.layout, self.algorithm = layout, algorithm
        self.reports = rank_reports(answer, layout.tp)
        self.params = RankParams(layout, names, dtype)
        self.checked = 0

    def hf_names(self) -> set[str]:
        return self.params.hf_names()

    def feed(self, name: str, full: torch.Tensor) -> list[str]:
        problems = []
        for engine, per_rank in self.params.add(name, full):
            self.checked += 1
            for r, t in enumerate(per_rank):
                mine: dict[str, str] = {}
                for d, sums in enumerate(self.reports[r]):
                    where = where_on(r, d, len(self.reports[r]))
                    got = sums.get(engine)
                    if got is None:
                        problems.append(f"{engine!r} on {where}: SGLang reports no checksum for it")
                        break
                    for alg in (self.algorithm, *(a for a in ALGORITHMS if a != self.algorithm)):
                        if alg not in mine:
                            mine[alg] = hex_hash(t, alg)
                        if mine[alg] == got:
                            break
                    else:
                        problems.append(f"{engine!r} on {where}: SGLang hashes {got}, the "
                                        f"trainer's bytes hash {mine[self.algorithm]} ({self.algorithm})")
                        break
        return problems

    def finish(self) -> list[str]:
        pending = self.params.pending()
        return ([f"the trainer's tensors did not complete {pending[:3]} ({len(pending)} engine "
                 f"parameters)"] if pending else []) + unfilled(self.layout, self.reports)


def unfilled(layout: TPLayout, reports: dict[int, list[dict[str, str]]]) -> list[str]:
    """A line per parameter SGLang hashes (`rank_reports`) that the layout map has none of, so no
    sync writes it (SGLang's own lm_head behind a tied MoE model, say): whatever it holds, the
    trainer cannot vouch for it. Non-persistent buffers (`NON_PERSISTENT`) are not weights."""
    known = set(layout.engine_shapes())
    out: dict[str, list[int]] = {}
    for r, replicas in sorted(reports.items()):
        for sums in replicas:
            for name in sums:
                if name not in known and not any(p in name for p in NON_PERSISTENT):
                    if r not in out.setdefault(name, []):
                        out[name].append(r)
    return [f"{name!r} on TP rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: SGLang "
            f"holds it, but the trainer's layout has no such parameter, so no sync writes it"
            for name, ranks in out.items()]
