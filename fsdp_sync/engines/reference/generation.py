"""Token generation of a reference-engine worker, one decode step per call, and SGLang's sampling.

`Sampling` is one request's sampling parameters as SGLang's ``sampling_params`` name them, checked
(`Sampling.from_sglang`); `pick` draws the next token of every row of a batch from its logits and
returns the token's log-probability as SGLang reports it by default (``log_softmax(logits / T)`` of
the temperature-scaled distribution before top-k/top-p/min-p filtering; ``log_softmax(logits)``
when greedy). A greedy row is ``argmax`` of the raw logits: the same tokens the engine produced
before sampling grew options.

`Decode` is a worker's running batch (continuous batching): the engine's scheduler
(`scheduler.Scheduler`) adds requests to it and removes them between steps, choosing their
KV-cache slots, and `Decode.step` runs exactly one forward over all of them (the prefill of the
ones just added packed with one decode token of each running one). A greedy row's tokens depend
only on its own prompt and the weights, never on the other rows of the batch; so do a sampled
row's when it gives SGLang's ``sampling_seed`` (each of its draws comes from a generator seeded by
that seed and the token's index, `draw_seed`, so a retract and recompute draws the same). A
sampled row without one draws from the worker's one generator (the engine's ``seed``) in batch
order, as SGLang's sampler does: its tokens depend on what else runs beside it. Every TP worker
runs the same steps with the same rows, so the collective forward never goes out of step.

Not here: which requests run and where their KV goes (`scheduler`), the HTTP fields
(`fsdp_sync.engines.reference.serve`), the worker's process loop (`worker`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .tp_model import Span

__all__ = ["Sampling", "pick", "Decode", "SAMPLING_KEYS", "NO_LIMIT", "draw_seed"]

# SGLang's sampling_params keys this engine honours, and the ones that are accepted only at the
# value that changes nothing here (penalties off; options that shape detokenized text, which this
# tokenizer-less engine does not produce).
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens",
                 "n", "stop_token_ids", "ignore_eos", "stream_interval", "sampling_seed")
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
            # not "": SGLang's stop_strs [""] match at once (every text holds ""), ending a row
            # after its first token with finish_reason matched ""
            "repetition_penalty": (1, 1.0), "stop": (None, []), "regex": (None,),
            "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
            "logit_bias": (None, {}), "custom_params": (None,)}
_TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def _num(sp: dict, key: str, default: Any, ok: Callable[[float], bool], expected: str,
         integer: bool = False) -> Any:
    v = sp.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ValueError(f"sampling_params.{key} must be {'an integer' if integer else 'a number'}, "
                         f"got {v!r}")
    try:
        finite = math.isfinite(v)
    except OverflowError:       # an int past a float's range (JSON has any size): whole, not a float
        finite = integer
    if not (finite and ok(v)):
        raise ValueError(f"sampling_params.{key} must be {expected}, got {v!r:.40}")
    return v


NO_LIMIT = 1 << 30
"""``max_new_tokens`` of a request that gives it as null (SGLang's scheduler's stand-in), before
the context length caps it (`rollout.fit_max_new_tokens`)."""

GREEDY_BELOW = 1e-6
"""A temperature below this samples greedily (SGLang's ``_SAMPLING_EPS``)."""


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream_interval: int = 1
    seed: int | None = None        # SGLang's ``sampling_seed``: this row's own draws (`draw_seed`)
    stop: frozenset = field(default_factory=frozenset)   # what ends a row: stop ids + eos, or
    # nothing under ignore_eos (SGLang ends no row on a token then, its stop ids' either)
    # what min_new_tokens masks until then: stop ids and eos, ignore_eos or not (SGLang's
    # BatchedMinNewTokensPenalizer takes the eos ids whatever ignore_eos says)
    min_stop: frozenset = field(default_factory=frozenset)
    lora: str | None = None   # the request's LoRA adapter (SGLang's ``lora_path``), not a sampling key

    @property
    def greedy(self) -> bool:
        # SGLang's rule (``SamplingParams``): a temperature below 1e-6 is greedy; dividing the
        # logits by one as small as 1e-300 would overflow them to inf and NaN probabilities
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @classmethod
    def from_sglang(cls, sp: dict | None, *, eos: Sequence[int] = (), vocab: int | None = None,
                    default_max_new_tokens: int = 128) -> "Sampling":
        """Check ``sp`` (SGLang's ``sampling_params``) and build one; every refusal names the key.
        A key this engine cannot honour is refused, never ignored (see the module docstring)."""
        sp = dict(sp or {})
        for key in list(sp):
            if key in SAMPLING_KEYS:
                continue
            if key in _NEUTRAL:
                if sp[key] not in _NEUTRAL[key]:
                    raise ValueError(f"sampling_params.{key}={sp[key]!r} is not supported by this "
                                     f"engine (it takes {_NEUTRAL[key][0]!r}, which changes nothing)"
                                     + ("; stop strings need a tokenizer: use stop_token_ids"
                                        if key == "stop" else ""))
            elif key not in _TEXT_ONLY:
                raise ValueError(f"sampling_params.{key} is not supported by this engine; supported: "
                                 f"{', '.join(SAMPLING_KEYS)}")
        # missing: SGLang's default (128); null: no limit of its own (SGLang's 1 << 30), so the
        # context decides (`rollout.fit_max_new_tokens`), and min_new_tokens is not held to it
        unlimited = "max_new_tokens" in sp and sp["max_new_tokens"] is None
        max_new = NO_LIMIT if unlimited else \
            _num(sp, "max_new_tokens", default_max_new_tokens, lambda v: v >= 0, ">= 0", integer=True)
        min_new = _num(sp, "min_new_tokens", 0, lambda v: 0 <= v, ">= 0", integer=True)
        if min_new > max_new and not unlimited:
            raise ValueError(f"sampling_params.min_new_tokens ({min_new}) must be <= max_new_tokens "
                             f"({max_new})")
        temperature = float(_num(sp, "temperature", 1.0, lambda v: v >= 0, ">= 0 (0 is greedy)"))
        top_p = float(_num(sp, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"))
        top_k = _num(sp, "top_k", -1, lambda v: v == -1 or v >= 1, "-1 (off) or an integer >= 1",
                     integer=True)
        min_p = float(_num(sp, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"))
        n = _num(sp, "n", 1, lambda v: 1 <= v <= 1024, "an integer in [1, 1024]", integer=True)
        interval = _num(sp, "stream_interval", 1, lambda v: v >= 1, "an integer >= 1", integer=True)
        # SGLang 0.5.23's range (SamplingParams.verify): a negative seed is a seed there too
        seed = _num(sp, "sampling_seed", None, lambda v: -2 ** 63 <= v < 2 ** 63,
                    "an integer in [-2**63, 2**63)", integer=True)
        ignore_eos = sp.get("ignore_eos", False)
        if ignore_eos is None:          # SGLang's ``SamplingParams``: null is the default, false
            ignore_eos = False
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"sampling_params.ignore_eos must be true or false, got {ignore_eos!r}")
        stop_ids = sp.get("stop_token_ids") or []
        if not isinstance(stop_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got "
                             f"{stop_ids!r}")
        if vocab is not None:
            outside = [t for t in stop_ids if not 0 <= t < vocab]
            if outside:
                raise ValueError(f"sampling_params.stop_token_ids {outside[:5]} are outside the "
                                 f"vocabulary [0, {vocab})")
        # SGLang's Req._check_token_based_finish: ignore_eos ignores the stop ids as well
        stop = set() if ignore_eos else set(stop_ids) | set(eos)
        min_stop = set(stop_ids) | set(eos)
        if min_new > 0 and vocab is not None and len(min_stop & set(range(vocab))) >= vocab:
            raise ValueError(f"sampling_params.min_new_tokens={min_new} cannot be honoured: the stop "
                             f"tokens (stop_token_ids and eos) cover the whole vocabulary of {vocab}, "
                             f"so no token may be drawn before min_new_tokens")
        return cls(max_new_tokens=int(max_new), temperature=temperature, top_p=top_p,
                   top_k=int(top_k), min_p=min_p, min_new_tokens=int(min_new), n=int(n),
                   stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos,
                   stream_interval=int(interval), seed=None if seed is None else int(seed),
                   stop=frozenset(stop), min_stop=frozenset(min_stop))


def _filtered_probs(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities to draw from, log-probabilities to report) of one row's float logits."""
    scaled = logits / s.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    full = probs
    if s.top_k > 0 and s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if s.top_p < 1.0:
        # as SGLang's sampler (`top_k_top_p_min_p_sampling_from_probs_torch`; flashinfer's "joint"
        # order keeps the same tokens): the mass ranked above a token is the distribution's before
        # top-k, and a token goes only where it exceeds top_p
        sorted_p, idx = torch.sort(full, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, idx, before <= s.top_p)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if s.min_p > 0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum(), logprobs


def input_token_logprobs(prompt: Sequence[int], logits: torch.Tensor, start: int) -> list[list]:
    """SGLang's ``input_token_logprobs`` of ``prompt`` from position ``start`` on: ``[logprob,
    token_id, None]`` each, from ``logits`` [len, vocab] of a forward over the prompt (position
    0 has no logprob: None)."""
    lps = torch.log_softmax(logits.float(), dim=-1)
    return [[None if j == 0 else float(lps[j - 1, prompt[j]]), prompt[j], None]
            for j in range(min(start, len(prompt)), len(prompt))]


_MIX = 0x9E3779B97F4A7C15       # 2**64 / golden ratio: spreads consecutive seeds and indices


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded row's draw of its token ``index`` (0: its first new token),
    a function of the two alone: the same on every TP rank, after a retract and recompute, and
    whatever else the batch holds. The ``n`` samples of one request all draw with its seed, so
    they are the same tokens, as in SGLang 0.5.23 with ``--enable-deterministic-inference`` (the
    only mode in which it applies ``sampling_seed``: `SamplingBatchInfo.from_schedule_batch`):
    ``TokenizerManager._handle_batch_request`` sends every sample with the request's sampling
    params, and ``sampler.multinomial_with_seed`` hashes the seed with the token's position alone."""
    return ((seed + 1) * _MIX + index * 0xBF58476D1CE4E5B9) % (2 ** 63)


def pick(logits: torch.Tensor, rows: Sequence[Sampling], produced: Sequence[int],
         gen: torch.Generator | None, want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """Next token of each row of ``logits`` [rows, vocab] (see the module docstring). ``produced``:
    tokens each row has made so far (``min_new_tokens`` keeps its stop tokens out until then)."""
    logits = logits.float().cpu()
    masked = [i for i, s in enumerate(rows) if produced[i] < s.min_new_tokens and s.min_stop]
    if masked:
        logits = logits.clone()
        for i in masked:
            logits[i, list(rows[i].min_stop)] = float("-inf")
    tokens: list[int] = [0] * len(rows)
    logprobs: list[float] | None = [0.0] * len(rows) if want_logprobs else None
    greedy = [i for i, s in enumerate(rows) if s.greedy]
    if greedy:
        best = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, best):
            tokens[i] = t
            if logprobs is not None:
                logprobs[i] = float(torch.log_softmax(logits[i], dim=-1)[t])
    for i, s in enumerate(rows):
        if s.greedy:
            continue
        probs, lps = _filtered_probs(logits[i], s)
        own = gen if s.seed is None else torch.Generator().manual_seed(draw_seed(s.seed, produced[i]))
        t = int(torch.multinomial(probs, 1, generator=own))
        tokens[i] = t
        if logprobs is not None:
            logprobs[i] = float(lps[t])
    return tokens, logprobs


@dataclass
class _Row:
    """One request in a worker's running batch."""

    slot: int                      # first of its KV-cache slots (a contiguous run)
    sampling: Sampling
    want_logprobs: bool
    produced: int                  # tokens it made so far (before it joined, when recomputed)
    pending: list[int] | None      # tokens to prefill at the next step (None once prefilled)
    cached: int = 0                # tokens it holds in the KV cache
    last: int = -1                 # its newest token, fed to the next decode step


class Decode:
    """A worker's running batch: requests `add`-ed and `remove`-d by id between steps, one forward
    per `step` over all of them (prefills of the new ones packed with one decode token of each
    running one). The KV-cache slots are the engine's to choose (`scheduler`): this only writes
    where it is told, so every TP rank runs the same rows in the same order."""

    def __init__(self, model: Any, device: torch.device, gen: torch.Generator | None) -> None:
        self.model, self.device, self.gen = model, device, gen
        self.rows: dict[int, _Row] = {}

    def add(self, rid: int, tokens: list[int], sampling: Sampling, slot: int, produced: int = 0,
            want_logprobs: bool = False) -> None:
        """Admit request ``rid``: ``tokens`` (its prompt, or prompt + the tokens it had made when it
        is recomputed after a retract) are prefilled at the next step into slots from ``slot``."""
        if rid in self.rows:
            raise ValueError(f"request {rid} is already in the batch")
        if not tokens:
            raise ValueError(f"request {rid} has no tokens to prefill")
        self.rows[rid] = _Row(slot=int(slot), sampling=sampling, want_logprobs=bool(want_logprobs),
                              produced=int(produced), pending=list(tokens))

    def remove(self, rids: Sequence[int]) -> None:
        """Drop ``rids`` (finished elsewhere, aborted, retracted); unknown ids are ignored."""
        for rid in rids:
            self.rows.pop(rid, None)

    def clear(self) -> None:
        self.rows.clear()

    def step(self, kv: torch.Tensor) -> dict:
        """One forward over every row. Returns ``{"tokens": {rid: token}, "logprobs": {rid: lp}
        (rows that asked), "ended": {rid: "stop" | "length"}}``; ended rows leave the batch."""
        out: dict = {"tokens": {}, "logprobs": {}, "ended": {}}
        if not self.rows:
            return out
        order = list(self.rows)
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        spans, last_rows, off = [], [], 0
        for rid in order:
            r = self.rows[rid]
            chunk = r.pending if r.pending is not None else [r.last]
            ids.extend(chunk)
            pos.append(torch.arange(r.cached, r.cached + len(chunk)))
            spans.append(Span(off, len(chunk), r.slot, r.cached))
            off += len(chunk)
            last_rows.append(off - 1)
        lora: dict[str, list[int]] = {}
        for rid, sp in zip(order, spans):
            name = self.rows[rid].sampling.lora
            if name is not None:
                lora.setdefault(name, []).extend(range(sp.offset, sp.offset + sp.n_new))
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=self.device),
                                    torch.cat(pos).to(self.device), spans, kv,
                                    torch.tensor(last_rows, device=self.device),
                                    lora={n: (None if len(r) == len(ids) else torch.tensor(r, device=self.device))
                                          for n, r in lora.items()})
        rows = [self.rows[rid] for rid in order]
        want = any(r.want_logprobs for r in rows)
        tokens, lps = pick(logits, [r.sampling for r in rows], [r.produced for r in rows],
                           self.gen, want)
        for k, (rid, r) in enumerate(zip(order, rows)):
            r.cached += len(r.pending) if r.pending is not None else 1
            r.pending = None
            t = tokens[k]
            r.last = t
            r.produced += 1
            out["tokens"][rid] = t
            if lps is not None and r.want_logprobs:
                out["logprobs"][rid] = lps[k]
            if t in r.sampling.stop and r.produced >= r.sampling.min_new_tokens:
                out["ended"][rid] = "stop"
            elif r.produced >= r.sampling.max_new_tokens:
                out["ended"][rid] = "length"
        self.remove(list(out["ended"]))
        return out
