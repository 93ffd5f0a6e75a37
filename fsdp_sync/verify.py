"""Verify after sync (`SyncConfig.verify`): what the engine now serves equals the trainer's tensors.

Run by the sharding manager right after ``transport.sync`` (every method: tensor, distributed,
disk), on every trainer rank:

1. the ranks that hold engine handles ask each engine for digests of the chosen tensors: an engine
   with ``rank_digests(names)`` and a ``layout`` (`layout.TPLayout`; the reference engine) answers
   one digest per tensor per TP rank, of the pieces that rank serves, each computed inside its
   worker (`layout.rank_digest`), so no tensor leaves the workers; otherwise
   ``engine.tensor_checksums(names)``: sha256 of ``name|dtype|shape|bytes`` of the full tensor
   (`tensor_digest`);
2. every trainer rank streams the same tensors out of the module (collective: ``"full"`` gathers
   bucket by bucket with `export.iter_buckets`, ``"sample"`` gathers only the chosen tensors with
   `export.iter_params`; under FSDP1 from the flat shards whatever ``fsdp1_state_dict`` is, since
   the full state dict would unshard the whole model), so no rank ever holds more than one bucket
   of the model (under FP8 each bucket, or tensor, quantized as the sync quantized it, its success
   agreed over the ranks before the next gather: `_agreed`); the engine
   ranks hash each tensor as it arrives (per TP rank, cut by the engine's layout, or whole) and
   compare at once;
3. at the first tensor that differs, the engine rank reads that one tensor back
   (``get_weights_by_name``) and finds the first differing element (by bit pattern, so NaN equals
   the same NaN and -0.0 differs from 0.0);
4. `topology.agree`: a mismatch, or an engine that cannot report digests, raises the same
   `SyncError` on every rank, naming the tensor (and element) or saying which option turns the
   check off.

What is compared is every HF tensor's bytes where the layout places them; the vocab padding rows of
``embed_tokens`` / ``lm_head`` (no HF tensor fills them) are not, on the reference engine: no result
reads them (it refuses token ids outside the vocab and cuts the logits to ``vocab_size``, as SGLang
0.5.23 masks those ids and cuts its logits), so NaN written there changes no logit
(`tests/test_h6_verify_vocab_padding.py`). SGLang's ``/weights_checker`` hashes them (zero).

Modes: ``"full"``: every exported tensor. ``"sample"``: a rotating subset, tensor ``i`` (export
order) at turn ``s`` with ``i % m == s % m`` where ``m = min(SAMPLE_EVERY, tensors)``: about one
tensor in eight per sync, deterministic, the same on every rank, and every tensor covered within
eight consecutive verified syncs of one manager. The turn is the manager's count of verified
syncs, offset by its ``global_steps`` at its first one (0 when unset; `SampleTurns`): a job that
rebuilds its manager every step (``global_steps`` up by one) still rotates, and one whose
``global_steps`` goes up by 2, 4 or 8 per sync still reaches every tensor (a turn of
``global_steps`` itself would visit only the even, or every fourth, eighth). ``"off"`` (default):
nothing; a verified sync costs another export and hashing on both sides (the bench's
``--verify`` reports the seconds).

SGLang (`engines.sglang.SGLangEngine.weight_checksums`, an HTTP server): SGLang 0.5.23's ``POST
/weights_checker`` ``{"action": "checksum"}`` answers, per TP rank, a hash of each of its *own*
parameters (fused qkv / gate_up / expert w13 and w2, vocab-padded shards; sha256 on CPU, a Triton
tile hash on GPU). The layout map says which bytes each rank holds, so the trainer recomputes
them (`engines.sglang.checksums.Checker`: the module's ``config``, the engine's ``tp_size`` and the
server's ``ep_size``; the server's ``--device`` picks the hash), assembling one engine parameter
at a time from the streamed tensors, and a difference names the parameter and the TP rank. In
``"sample"`` mode the chosen tensors grow to whole engine parameters (q with k and v, an expert
with its layer's others) on every rank. Checked against SGLang's own WeightChecker on models
SGLang built and loaded on CPU, and the tile hash against SGLang's Triton kernel run by Triton's
interpreter (the SGLang tier). Unchecked: a GPU server end to end, weights SGLang repacks after
loading (AMX on CPU, some GPU MoE runners; they report a mismatch), quantized weights (hashed
dequantized there), pipeline or data parallelism beyond merging the answer's entries. An
in-process ``sglang.Engine`` has no checker call: with ``verify`` on, a sync into it raises,
naming ``SyncConfig.verify="off"``; so does a server without ``/weights_checker``.

A caller that streams its own tensors and holds no module (verl's adapter: verl's export is a
generator it walks once) records what it sends as it sends it, in the form the engine is checked
in (`sent_record`): full-tensor digests for an engine that reports them (`SentDigests`,
`check_sent`), or, for SGLang, each TP rank's hash of each engine parameter, assembled from the
passing tensors one engine parameter at a time by the same code the manager's check uses
(`SentToSGLang`: `checksums.RankParams`, `hex_hash`, `rank_reports`), compared after the sync with
``/weights_checker``. ``"sample"`` there picks every `SAMPLE_EVERY`-th engine parameter, rotating.

Not here: the sync itself (the transports), the stages around it (the manager).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from .weights import bucket as _bucket
from .weights import export, export_checks, quantize
from .topology import agree, cpu_group
from .engines.base import checksum_named_tensors
from .weights.layout import TPLayout, layout_for, names_layout, rank_digest

__all__ = ["SAMPLE_EVERY", "SampleTurns", "select", "tensor_digest", "trainer_tensors", "first_difference",
           "verify_engines", "digests", "check_sent", "SentDigests", "SentToSGLang", "sent_record"]

SAMPLE_EVERY = 8


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """The digest of one full tensor, as engines report it (`checksum_named_tensors` of one)."""
    return checksum_named_tensors([(name, t)])


def select(names: list[str], mode: str, step: int) -> list[str]:
    """The tensors a verify of sync ``step`` checks (see the module docstring)."""
    if mode == "off" or not names:
        return []
    if mode == "full":
        return list(names)
    if mode != "sample":
        raise ValueError(f"verify must be 'off', 'sample' or 'full', got {mode!r}")
    m = min(SAMPLE_EVERY, len(names))
    return [n for i, n in enumerate(names) if i % m == step % m]


class SampleTurns:
    """The ``"sample"`` turn of each verified sync of one manager (`select`'s ``step``): ``start +
    count``, ``start`` the run's ``global_steps`` at the first (0 when unset), ``count`` the
    verified syncs before this one, a failed one included (module docstring)."""

    def __init__(self) -> None:
        self.start: int | None = None
        self.count = 0

    def next(self, global_steps: Any = None) -> int:
        """The turn of the verify about to run; counts it."""
        if self.start is None:
            self.start = int(global_steps) if global_steps is not None else 0
        turn, self.count = self.start + self.count, self.count + 1
        return turn


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return torch.device("cuda", torch.cuda.current_device()) if p.device.type == "cuda" else p.device
    return torch.device("cpu")


def trainer_tensors(module: torch.nn.Module, config: Any, chosen: list[str], *,
                    every: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective on every trainer rank: ``(name, full tensor)`` of the chosen tensors, in export
    order; ``every``: all of them, gathered a bucket at a time (one all-gather per bucket)."""
    dtype, kind = config.dtype, config.fsdp1_state_dict
    quant = quantize.for_sync(module, config, 1)       # quantized: what the sync sent, fp8 and scales
    if every:
        device = _device(module)
        alloc = lambda n: torch.empty(n, dtype=torch.uint8, device=device)  # noqa: E731
        it = export.iter_buckets(module, config.bucket_bytes, dtype=dtype, fsdp1_state_dict=kind, alloc=alloc)
        for index, (bkt, flat) in enumerate(it):
            if quant is not None:       # its buffer and scratch: agreed before the next gather
                bkt, flat = _agreed(lambda: quant.bucket(bkt, flat, alloc), f"bucket {index} "
                                    f"({bkt.names[0]!r}...)")
            yield from _bucket.unflatten(flat, bkt.entries)
            del flat
    else:
        names = {n.removesuffix("_scale_inv") if quant is not None else n for n in chosen}
        # FSDP1: the chosen tensors from the flat shards ("local": the same parameters, gathered
        # one at a time), whatever the sync's state-dict type: "full" would unshard the whole model.
        # Where "local" is refused (units made with a device_mesh, or sharding over a group smaller
        # than the world: `export_checks.state_dict_refusal`), "sharded" does the same
        local = SimpleNamespace(fsdp1_state_dict="local")
        kind = "local" if export_checks.state_dict_refusal(module, local) is None else "sharded"
        it = export.iter_params(module, dtype=dtype, fsdp1_state_dict=kind, names=names)
        for name, t in it:
            if quant is None or name not in quant.hf:
                yield name, t
                continue
            pair = [(name, t)]
            del t           # the quantizer holds the only reference while it works
            yield from _agreed(lambda: list(quant.named([pair.pop()])), repr(name))


def _agreed(work: Any, what: str) -> Any:
    """``work()`` (quantizing one bucket or tensor of `trainer_tensors`' stream), its success
    agreed over the trainer ranks before the stream's next collective: a rank-local failure (its
    output buffer or scratch not allocated, a MemoryError) raised on that rank alone left its
    peers waiting in the next gather out the process group's timeout. Every rank now raises the
    same `topology.SyncError` naming the failing rank; the world is the group, as verify's caller
    agrees its result over it (every trainer rank streams the same tensors). Without a process
    group of more than one rank, ``work``'s own error is raised."""
    agreed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    error, out = None, None
    try:
        out = work()
    except Exception as exc:  # noqa: BLE001 - whatever it is, every peer must hear of it
        if not agreed:
            raise
        error = f"quantizing {what} on rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    if agreed:
        try:
            agree(error, what="verify's fp8 stream")
        except BaseException:
            out = None       # the traceback keeps this frame: not this rank's buffers with it
            raise
    return out


def first_difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    """Where two tensors first differ, bit for bit (flat index and the two values)."""
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        return (f"the engine holds {got.dtype} {tuple(got.shape)}, the trainer "
                f"{expected.dtype} {tuple(expected.shape)}")
    a = expected.detach().cpu().contiguous().reshape(-1)
    b = got.detach().cpu().contiguous().reshape(-1)
    if a.element_size() in (1, 2, 4, 8):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        diff = (a.view(bits) != b.view(bits)).nonzero()
    else:
        diff = (a != b).nonzero()
    if not diff.numel():
        return "its bytes equal the trainer's but its digest does not (the engine's checksum is off?)"
    i = int(diff[0])
    return (f"first differing element at flat index {i} of {a.numel()} "
            f"(trainer {a[i].item()!r}, engine {b[i].item()!r}; {diff.numel()} elements differ)")


def _where(engine: Any, name: str, t: torch.Tensor, bad: list[int] | None) -> str:
    """The first differing element of ``name`` in the engine: in the failing TP ranks' own pieces
    where the engine hands them back (``rank_pieces``: a replica wrong on one rank shows there
    only), else in the full tensor it reads back (the owners' pieces)."""
    per_rank = getattr(engine, "rank_pieces", None)
    if callable(per_rank):
        held = per_rank(name)
        for r in (bad if bad else sorted(held)):
            for src, piece in held.get(r, ()):
                text = first_difference(t[src], piece)
                if not text.startswith("its bytes equal"):
                    return f"TP rank {r}'s piece (block {_block(src, tuple(t.shape))}): {text}"
    return first_difference(t, engine.get_weights_by_name(name))


def _block(src: Any, shape: tuple[int, ...]) -> Any:
    from .weights.layout import block_of

    try:
        return block_of(src, shape)
    except Exception:  # noqa: BLE001 - only a label
        return src


def verify_engines(module: torch.nn.Module, config: Any, engines: list, step: int) -> tuple[str | None, dict]:
    """Steps 1-3 of the module docstring on this rank (collective: call it on every trainer rank,
    with ``engines`` [] where this rank holds none). Returns ``(error or None, figures)``; the
    caller agrees on the error over the trainer ranks."""
    t0 = time.perf_counter()
    names = [m.name for m in quantize.sync_metas(module, config)]
    chosen = select(names, config.verify, step)
    err: str | None = None
    # (the engine's index in ``engines``, its layout for per-rank digests or None, digests): the
    # index, not the place in this list, names the engine (SGLang engines are checked apart)
    reports: list[tuple[int, Any, dict]] = []
    checkers: dict[int, Any] = {}             # engine index -> `checksums.Checker` (SGLang)
    for i, engine in enumerate(engines):
        sglang = getattr(engine, "weight_checksums", None)
        try:
            report = sglang() if callable(sglang) else None
            if report is not None:
                checkers[i] = _sglang_checker(module, config, engine, report, chosen)
                continue
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            err = (f"engine {i} cannot be verified: {type(exc).__name__}: {exc}; set "
                   f"SyncConfig.verify='off' to sync without checking")
            break
        layout = getattr(engine, "layout", None)
        per_rank = getattr(engine, "rank_digests", None)
        fn = per_rank if callable(per_rank) and isinstance(layout, TPLayout) else getattr(
            engine, "tensor_checksums", None)
        try:
            if not callable(fn):
                raise RuntimeError(f"{type(engine).__name__} cannot report per-tensor checksums "
                                   f"(no tensor_checksums method)")
            got = dict(fn(chosen))
            missing = [n for n in chosen if n not in got]
            if missing:
                raise RuntimeError(f"engine reported no checksum for {missing[:3]} "
                                   f"({len(missing)} tensors)")
            reports.append((i, layout if fn is per_rank else None, got))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            err = (f"engine {i} cannot be verified: {type(exc).__name__}: {exc}; set "
                   f"SyncConfig.verify='off' to sync without checking")
            break
    chosen = _whole_engine_params(module, chosen, bool(checkers))
    want = set(chosen)
    checked = 0
    mine_full: str | None = None
    for name, t in trainer_tensors(module, config, chosen, every=config.verify == "full"):
        if name not in want:
            continue
        checked += 1
        want.discard(name)
        try:    # a rank-local failure (a digest's host copy, a hash) must not end this rank's stream
            err = _compare(step, name, t, engines, checkers, reports, err)
        except Exception as exc:  # noqa: BLE001 - the stream is collective: keep consuming it
            err = (f"after sync {step} checking {name!r} against the engines failed: "
                   f"{type(exc).__name__}: {exc}")
        del t
    for i, checker in checkers.items():
        problems = checker.finish() if err is None else []
        if problems:
            err = _sglang_error(step, i, problems)
    if err is None and want and (reports or checkers):   # a tensor never compared is no pass
        missing = [n for n in chosen if n in want]
        err = (f"after sync {step} verify chose {len(chosen)} tensors but the trainer's stream gave "
               f"{len(chosen) - len(missing)} of them: {missing[:3]} ({len(missing)}) were never "
               f"compared; set SyncConfig.verify='off' to sync without checking")
    figures = {"verify": config.verify, "verify_tensors": checked,
               "verify_s": time.perf_counter() - t0}
    return err, figures


def _compare(step: int, name: str, t: torch.Tensor, engines: list, checkers: dict, reports: list,
             err: str | None) -> str | None:
    """Step 3 for one streamed tensor on this rank: fed to the SGLang checkers, compared with each
    digest engine's report; returns the error so far (``err``, or the first difference). Raises
    only what the caller turns into an error while it keeps consuming the collective stream."""
    for i, checker in checkers.items():
        problems = checker.feed(name, t) if err is None else []
        if problems:
            err = _sglang_error(step, i, problems)
    if err is not None or not reports:
        return err
    mine_full = None
    for i, layout, got in reports:
        if name not in got:     # grown for an SGLang engine's sake (`_whole_engine_params`): this
            continue            # engine was asked for (and answered) every tensor `select` chose
        ranks = ""
        if layout is not None:      # one digest per TP rank, of the pieces that rank serves
            mine = [rank_digest(layout, name, r, lambda pl: t[pl.src]) for r in range(layout.tp)]
            if len(got[name]) != len(mine):    # an engine that answers for other ranks
                return (f"after sync {step} engine {i} reported {len(got[name])} per-rank digests "
                        f"of {name!r} where its TP {layout.tp} needs {len(mine)}: it cannot be "
                        f"verified; set SyncConfig.verify='off' to sync without checking")
            bad = [r for r, (a, b) in enumerate(zip(mine, got[name])) if a != b]
            if not bad:
                continue
            ranks = f" on TP rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
        else:
            mine_full = mine_full or tensor_digest(name, t)
            if got[name] == mine_full:
                continue
            ranks = _engine_note(got[name])
        where = ""
        try:
            where = "; " + _where(engines[i], name, t, bad if layout is not None else None)
            if ranks.startswith("; the engine says") and "its bytes equal" in where:
                where = "; the owners' copy it reads back equals the trainer's"
        except Exception as exc:  # noqa: BLE001 - the name is what matters
            where = f" (reading it back failed: {type(exc).__name__}: {exc})"
        return (f"after sync {step} engine {i} serves {name!r} different from the "
                f"trainer's{ranks}{where}")
    return err


def _sglang_checker(module: torch.nn.Module, config: Any, engine: Any, report: dict,
                    chosen: list[str]) -> Any:
    """A `checksums.Checker` for an SGLang engine's ``weight_checksums()`` report, over the
    engine parameters the chosen HF tensors feed."""
    from .engines.sglang.checksums import Checker

    if getattr(config, "quantization", None) is not None:
        raise ValueError(f"SGLang's /weights_checker hashes FP8 weights dequantized, which the trainer "
                         f"does not recompute: verify with quantization={config.quantization!r} runs "
                         f"against the reference engine only")
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ValueError("the module has no Hugging Face .config, so the trainer cannot tell "
                         "which bytes each SGLang TP rank holds")
    layout = layout_for(cfg, int(engine.tp_size), int(report.get("ep_size", 1)))
    params = {pl.engine for n in chosen if layout.accepts(n)
              for r in range(layout.tp) for pl in layout.placements(n, r)}
    if layout.spec.tie_word_embeddings and "lm_head.weight" in chosen:
        params.add("model.embed_tokens.weight")
    return Checker(layout, report["answer"], algorithm=report["algorithm"], names=params,
                   dtype=config.dtype)


def _whole_engine_params(module: torch.nn.Module, chosen: list[str], mine: bool) -> list[str]:
    """Collective: where any rank compares against SGLang (per-rank hashes of fused engine
    parameters), the chosen HF tensors plus every other tensor feeding the same engine parameter
    (q with k and v, one expert with the layer's others), in export order, on every rank."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=cpu_group())
    if not flag.item():
        return chosen
    try:     # the split-independent map: `layout_for(config, 1)` evicted the run's TP layout
        layout = names_layout(module.config)
    except Exception:  # noqa: BLE001 - the ranks with engines have reported it already
        return chosen
    group = {n: pl.engine for n in layout.hf_names() for pl in layout.placements(n, 0)}
    engine_params = {group.get(n) for n in chosen}
    names = [m.name for m in export.param_metas(module)]
    return [n for n in names if n in chosen or group.get(n) in engine_params]


def _sglang_error(step: int, i: int, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"after sync {step} engine {i} (SGLang, /weights_checker) serves weights different from "
            f"the trainer's: {problems[0]}{more}")


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: tensor_digest}`` of named tensors (what ``tensor_checksums`` returns)."""
    return {n: tensor_digest(n, t) for n, t in named}


def check_sent(engine: Any, sent: dict[str, str], mode: str, step: int) -> tuple[str | None, dict]:
    """For a caller that streams its own tensors (verl's adapter, which gets them from verl's
    export and keeps ``sent``: ``{name: tensor_digest}`` of each tensor as it was sent): after the
    sync, the digests ``engine.tensor_checksums`` reports for the tensors `select` picks, compared
    with ``sent``. Returns ``(error or None, figures)``; runs where the engine is (the caller
    agrees on the error over its group)."""
    t0 = time.perf_counter()
    chosen = select(list(sent), mode, step)
    err: str | None = None
    try:
        got = dict(engine.tensor_checksums(chosen)) if chosen else {}
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        got = None
        err = (f"the engine cannot be verified: {type(exc).__name__}: {exc}; set "
               f"SyncConfig.verify='off' to sync without checking")
    if got is not None:
        bad = [n for n in chosen if got.get(n) != sent[n]]
        if bad:
            missing = [n for n in bad if n not in got]
            err = (f"after sync {step} the engine serves {len(bad)} of {len(chosen)} checked "
                   f"tensors different from what was sent, first {bad[0]!r}"
                   + (f" ({len(missing)} not reported at all, e.g. {missing[0]!r})"
                      if missing else "") + _engine_note(got.get(bad[0])))
    return err, {"verify": mode, "verify_tensors": len(chosen),
                 "verify_s": time.perf_counter() - t0}



def _engine_note(reported: Any) -> str:
    """An engine's own word in place of a digest (a reference engine's replica that differs
    between TP ranks: `readback.REPLICA_MISMATCH`), as ``"; <note>"``; "" for a digest."""
    text = str(reported) if reported is not None else ""
    if not text or all(c in "0123456789abcdef" for c in text):
        return ""
    return f"; the engine says: {text}"


class SentDigests:
    """`tensor_digest` of each tensor as it is sent, checked by `check_sent` after the sync."""

    def __init__(self, mode: str, step: int) -> None:
        self.mode, self.step = mode, step
        self.digests: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.digests:
            raise ValueError(f"the weight stream holds {name!r} twice")
        self.digests[name] = tensor_digest(name, t)

    def check(self, engine: Any) -> tuple[str | None, dict]:
        return check_sent(engine, self.digests, self.mode, self.step)


class SentToSGLang:
    """SGLang's per-TP-rank hash of each (chosen) engine parameter, computed from the tensors as
    they are sent, and their comparison with ``/weights_checker`` after the sync.

    ``hf_config``: the model's Hugging Face config (which bytes each rank holds); ``tp_size``: the
    server's tensor parallelism; ``dtype``: what the engine stores (the sent tensors' dtype if
    None). The hash is the server's (``--device``: sha256 on CPU, the tile hash on GPU); a
    parameter the server keeps elsewhere (offloaded to CPU on a GPU server) reports a mismatch."""

    def __init__(self, engine: Any, mode: str, step: int, *, hf_config: Any, tp_size: int,
                 dtype: torch.dtype | None = None, quantization: str | None = None) -> None:
        from .engines.sglang.checksums import RankParams

        if quantization is not None:
            raise ValueError(f"SGLang's /weights_checker hashes FP8 weights dequantized, which the "
                             f"trainer does not recompute: verify with quantization={quantization!r} "
                             f"runs against the reference engine only")
        if hf_config is None:
            raise ValueError("verifying against SGLang needs the model's Hugging Face config, to "
                             "tell which bytes each TP rank holds; there is none")
        info = engine.server_info()
        self.algorithm = "cpu" if str(info.get("device") or "cuda") == "cpu" else "gpu"
        self.mode, self.step, self.tp_size = mode, step, int(tp_size)
        self.layout = layout_for(hf_config, self.tp_size, int(info.get("ep_size") or 1))
        chosen = select(list(self.layout.engine_shapes()), mode, step)
        self.params = RankParams(self.layout, chosen, dtype)
        self.expected: dict[str, list[str]] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        from .engines.sglang.checksums import hex_hash

        if not self.layout.accepts(name):
            return
        for engine_name, per_rank in self.params.add(name, t):
            self.expected[engine_name] = [hex_hash(x, self.algorithm) for x in per_rank]

    def check(self, engine: Any) -> tuple[str | None, dict]:
        from .engines.sglang.checksums import rank_reports, unfilled, where_on

        t0 = time.perf_counter()
        problems: list[str] = []
        try:
            reports = rank_reports(engine.weights_checker("checksum"), self.tp_size)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            return (f"the engine cannot be verified: {type(exc).__name__}: {exc}; set "
                    f"SyncConfig.verify='off' to sync without checking"), {
                "verify": self.mode, "verify_tensors": 0, "verify_s": time.perf_counter() - t0}
        for name, per_rank in self.expected.items():
            for r, want in enumerate(per_rank):
                for d, sums in enumerate(reports[r]):
                    got = sums.get(name)
                    if got != want:
                        problems.append(f"{name!r} on {where_on(r, d, len(reports[r]))}: " + (
                            "SGLang reports no checksum for it" if got is None else
                            f"SGLang hashes {got}, the sent bytes hash {want} ({self.algorithm})"))
                        break
        pending = self.params.pending()
        if pending:
            problems.append(f"the sent tensors did not complete {pending[:3]} ({len(pending)} "
                            f"engine parameters)")
        problems += unfilled(self.layout, reports)      # SGLang's weights no sync writes
        err = _sglang_error(self.step, 0, problems) if problems else None
        return err, {"verify": self.mode, "verify_tensors": len(self.expected),
                     "verify_s": time.perf_counter() - t0}


def sent_record(engine: Any, mode: str, step: int, **sglang: Any) -> "SentDigests | SentToSGLang":
    """The record a streaming sender keeps for ``engine``: `SentToSGLang` when it is an SGLang
    server (its client says it has no full-tensor digests), else `SentDigests`. ``sglang``: the
    keyword arguments of `SentToSGLang` past the first three."""
    serves = getattr(engine, "serves_tensor_checksums", None)
    if callable(serves) and not serves():
        return SentToSGLang(engine, mode, step, **sglang)
    return SentDigests(mode, step)
