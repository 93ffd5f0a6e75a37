"""Token generation of a reference-engine worker, one decode step per call, and SGLang's sampling.

`Sampling` is one request's sampling parameters as SGLang's ``sampling_params`` name them, checked
(`Sampling.from_sglang`); `pick` draws the next token of every row of a batch from its logits and
returns the token's log-probability as SGLang reports it by default (``log_softmax(logits / T)`` of
the temperature-scaled distribution before top-k/top-p/min-p filtering; ``log_softmax(logits)``
when greedy). A greedy row is ``argmax`` of the raw logits: the same tokens the engine produced
before sampling grew options.

`Decode` is the state of one generate call on one worker: prompts are packed into waves whose
KV-cache slots fit together, and `Decode.step` runs exactly one forward (a wave's prefill or one
decode step of its active rows). The engine client drives the steps, so between two steps it can
stream tokens out and drop aborted rows; every TP worker runs the same steps with the same rows,
so the collective forward never goes out of step.

Not here: the HTTP fields (`fsdp_sync.engines.reference.serve`), the worker's process loop (`worker`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .tp_model import Span

__all__ = ["Sampling", "pick", "Decode", "SAMPLING_KEYS"]

# SGLang's sampling_params keys this engine honours, and the ones that are accepted only at the
# value that changes nothing here (penalties off; options that shape detokenized text, which this
# tokenizer-less engine does not produce).
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens",
                 "n", "stop_token_ids", "ignore_eos", "stream_interval")
_NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
            "repetition_penalty": (1, 1.0), "stop": (None, [], ""), "regex": (None,),
            "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
            "logit_bias": (None, {}), "custom_params": (None,), "sampling_seed": (None,)}
_TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def _num(sp: dict, key: str, default: Any, ok: Callable[[float], bool], expected: str,
         integer: bool = False) -> Any:
    v = sp.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ValueError(f"sampling_params.{key} must be {'an integer' if integer else 'a number'}, "
                         f"got {v!r}")
    if not (math.isfinite(v) and ok(v)):
        raise ValueError(f"sampling_params.{key} must be {expected}, got {v!r}")
    return v


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
    stop: frozenset = field(default_factory=frozenset)   # what ends a row: stop ids (+ eos)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

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
        max_new = _num(sp, "max_new_tokens", default_max_new_tokens, lambda v: v >= 0,
                       ">= 0", integer=True)
        min_new = _num(sp, "min_new_tokens", 0, lambda v: 0 <= v, ">= 0", integer=True)
        if min_new > max_new:
            raise ValueError(f"sampling_params.min_new_tokens ({min_new}) must be <= max_new_tokens "
                             f"({max_new})")
        temperature = float(_num(sp, "temperature", 1.0, lambda v: v >= 0, ">= 0 (0 is greedy)"))
        top_p = float(_num(sp, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"))
        top_k = _num(sp, "top_k", -1, lambda v: v == -1 or v >= 1, "-1 (off) or an integer >= 1",
                     integer=True)
        min_p = float(_num(sp, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]"))
        n = _num(sp, "n", 1, lambda v: 1 <= v <= 1024, "an integer in [1, 1024]", integer=True)
        interval = _num(sp, "stream_interval", 1, lambda v: v >= 1, "an integer >= 1", integer=True)
        ignore_eos = sp.get("ignore_eos", False)
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
        stop = set(stop_ids) | (set() if ignore_eos else set(eos))
        return cls(max_new_tokens=int(max_new), temperature=temperature, top_p=top_p,
                   top_k=int(top_k), min_p=min_p, min_new_tokens=int(min_new), n=int(n),
                   stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos,
                   stream_interval=int(interval), stop=frozenset(stop))


def _filtered_probs(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities to draw from, log-probabilities to report) of one row's float logits."""
    scaled = logits / s.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    if s.top_k > 0 and s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p   # mass of the tokens ranked above
        sorted_p = torch.where(before < s.top_p * sorted_p.sum(), sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if s.min_p > 0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum(), logprobs


def pick(logits: torch.Tensor, rows: Sequence[Sampling], produced: Sequence[int],
         gen: torch.Generator | None, want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """Next token of each row of ``logits`` [rows, vocab] (see the module docstring). ``produced``:
    tokens each row has made so far (``min_new_tokens`` keeps its stop tokens out until then)."""
    logits = logits.float().cpu()
    masked = [i for i, s in enumerate(rows) if produced[i] < s.min_new_tokens and s.stop]
    if masked:
        logits = logits.clone()
        for i in masked:
            logits[i, list(rows[i].stop)] = float("-inf")
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
        t = int(torch.multinomial(probs, 1, generator=gen))
        tokens[i] = t
        if logprobs is not None:
            logprobs[i] = float(lps[t])
    return tokens, logprobs


class Decode:
    """One generate call on one worker: waves of prompts, one forward per `step`."""

    def __init__(self, model: Any, kv: torch.Tensor, kv_tokens: int, device: torch.device,
                 prompts: list[list[int]], rows: list[Sampling], gen: torch.Generator | None,
                 want_logprobs: bool) -> None:
        self.model, self.kv, self.device, self.gen = model, kv, device, gen
        self.prompts, self.rows, self.want_logprobs = prompts, rows, want_logprobs
        self.need = [len(p) + max(s.max_new_tokens, 1) - 1 for p, s in zip(prompts, rows)]
        for i, n in enumerate(self.need):
            if n > kv_tokens:
                raise ValueError(f"prompt {i} ({len(prompts[i])} tokens) + max_new_tokens "
                                 f"({rows[i].max_new_tokens}) needs {n} KV-cache tokens; the cache "
                                 f"holds {kv_tokens} (kv_cache_tokens)")
        self.kv_tokens = kv_tokens
        self.produced = [0] * len(prompts)
        self.done = [s.max_new_tokens <= 0 for s in rows]
        self.order = [i for i in range(len(prompts)) if not self.done[i]]
        self.wave: list[tuple[int, int]] = []     # (row, first KV slot) of the running wave
        self.cached: dict[int, int] = {}          # row -> tokens it has in the KV cache
        self.last: dict[int, int] = {}            # row -> its newest token

    @property
    def finished(self) -> bool:
        return not self.order and not self._active()

    def _active(self) -> list[int]:
        return [i for i, _ in self.wave if not self.done[i]]

    def drop(self, rows: Sequence[int]) -> None:
        """Stop ``rows`` (aborted): no more tokens for them; their KV slots free with the wave."""
        for i in rows:
            self.done[i] = True
        self.order = [i for i in self.order if not self.done[i]]

    def step(self) -> dict:
        """One forward. Returns ``{"tokens": {row: token}, "logprobs": {row: lp}, "ended":
        {row: "stop" | "length"}}`` for the rows it advanced."""
        active = self._active()
        if not active:
            return self._prefill()
        ids = torch.tensor([self.last[i] for i in active], dtype=torch.long, device=self.device)
        pos = torch.tensor([self.cached[i] for i in active], dtype=torch.long, device=self.device)
        slots = dict(self.wave)
        spans = [Span(k, 1, slots[i], self.cached[i]) for k, i in enumerate(active)]
        rows = torch.arange(len(active), device=self.device)
        logits = self.model.forward(ids, pos, spans, self.kv, rows)
        for i in active:
            self.cached[i] += 1
        return self._take(active, logits)

    def _prefill(self) -> dict:
        if not self.order:
            return {"tokens": {}, "logprobs": {}, "ended": {}}
        wave, used = [], 0
        while self.order and used + self.need[self.order[0]] <= self.kv_tokens:
            i = self.order.pop(0)
            wave.append((i, used))
            used += self.need[i]
        self.wave = wave
        idx = [i for i, _ in wave]
        chunks = [self.prompts[i] for i in idx]
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(len(c)) for c in chunks]).to(self.device)
        spans, off, last_rows = [], 0, []
        for (i, slot), c in zip(wave, chunks):
            spans.append(Span(off, len(c), slot, 0))
            last_rows.append(off + len(c) - 1)
            off += len(c)
        logits = self.model.forward(ids, pos, spans, self.kv, torch.tensor(last_rows, device=self.device))
        for i in idx:
            self.cached[i] = len(self.prompts[i])
        return self._take(idx, logits)

    def _take(self, idx: list[int], logits: torch.Tensor) -> dict:
        tokens, lps = pick(logits, [self.rows[i] for i in idx], [self.produced[i] for i in idx],
                           self.gen, self.want_logprobs)
        out: dict = {"tokens": {}, "logprobs": {}, "ended": {}}
        for k, i in enumerate(idx):
            t = tokens[k]
            self.last[i] = t
            self.produced[i] += 1
            out["tokens"][i] = t
            if lps is not None:
                out["logprobs"][i] = lps[k]
            if t in self.rows[i].stop and self.produced[i] >= self.rows[i].min_new_tokens:
                self.done[i] = True
                out["ended"][i] = "stop"
            elif self.produced[i] >= self.rows[i].max_new_tokens:
                self.done[i] = True
                out["ended"][i] = "length"
        return out
