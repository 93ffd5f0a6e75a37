"""Generation on a reference engine, from the client's side: checking prompts, SGLang's
``generate`` and the per-request `generate_requests` (sampling, EOS, aborts, input logprobs, weight
versions), SGLang's generation controls (``pause_generation`` / ``continue_generation``,
``update_weight_version`` / ``get_weight_version``), fsdp_sync's ``set_serving`` (out of service,
for a fleet's quarantine), and ``forward_logits``. A mixin of `ReferenceEngine`: requests go to
the engine's scheduler (``_sched``), other calls to the workers through the engine's ``_call``.

Not here: batching, pausing and versioning requests (`scheduler`), the decode loop and sampling
math (`generation`, run in each worker), the HTTP fields (`generate_request`).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any, Callable, Sequence

import torch

from ..base import EngineStateError, EngineUnavailableError
from .generation import Sampling, input_token_logprobs
from .scheduler import PAUSE_MODES, check_version, kv_need, weight_version_spans

__all__ = ["GenerationCalls", "fit_max_new_tokens", "sglang_context_length", "check_context_length",
           "CONTEXT_LENGTH_KEYS"]

CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
"""The config keys SGLang 0.5.23 reads the context length from, the first one set winning
(``hf_transformers.common.CONTEXT_LENGTH_KEYS``)."""

_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def _token_id(t: Any) -> int | None:
    """``t`` as a token id, or None where it is not an integer (a bool, a float, a string...)."""
    if isinstance(t, (bool, float)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
        return None
    try:
        return operator.index(t)      # int, numpy integers, one-element integer tensors
    except TypeError:
        return None


def _ids_of(p: Any) -> list | None:
    """A prompt as a list (a list, tuple, or 1-D tensor or numpy array), else None."""
    if isinstance(p, (list, tuple)):
        return list(p)
    if hasattr(p, "tolist") and getattr(p, "ndim", 0) == 1:
        return p.tolist()
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def sglang_context_length(config: Any) -> int:
    """The context length SGLang 0.5.23 derives from a model config (``get_context_length``, which
    ``ModelConfig`` applies to the text config when no ``--context-length`` is given): the first
    of `CONTEXT_LENGTH_KEYS` the config sets (so a ``seq_length`` or ``max_sequence_length`` wins
    over ``max_position_embeddings``), 2048 when it sets none, times the ``rope_scaling`` factor,
    except where ``rope_scaling`` holds ``original_max_position_embeddings`` (yarn, longrope: and
    transformers 5 adds that key to every yarn config) or its ``rope_type`` is ``llama3``. So
    ``linear`` and ``dynamic`` scaling multiply the context, and so does a ``factor`` beside the
    default rope type; the legacy ``type`` key is not read for ``llama3``, as in SGLang. Read from
    the config object as loaded (transformers 5 keeps ``rope_scaling`` as ``rope_parameters``)."""
    scaling = getattr(config, "rope_scaling", None)
    factor: Any = 1
    if scaling:
        if not isinstance(scaling, dict):
            raise ValueError(f"config.rope_scaling must be a dict or null, got {_shown(scaling)}")
        factor = scaling.get("factor", 1)
        if "original_max_position_embeddings" in scaling or scaling.get("rope_type", None) == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(factor * value)
    return 2048


def fit_max_new_tokens(prompt_len: int, s: Sampling, *, given: bool, context: int | None,
                       kv_tokens: int | None) -> Sampling:
    """``s`` with SGLang 0.5.23's ``max_new_tokens`` for a prompt of ``prompt_len`` tokens, or
    SGLang's refusal (`ValueError`, its words). ``given``: the request gave ``max_new_tokens`` (not
    missing, not null); ``s.max_new_tokens`` is then that, else SGLang's default 128 (missing) or
    `generation.NO_LIMIT` (null). As SGLang:

    - a prompt of ``context`` tokens or more is refused (``TokenizerManager._validate_one_request``);
    - a given ``max_new_tokens`` that with the prompt exceeds ``context`` is refused (only a given
      one: a default or null one is capped instead);
    - every request's is capped at ``max_req_len - prompt_len - 1``, ``max_req_len`` being
      ``context - 1`` (``Scheduler.init_req_max_new_tokens``), so a prompt and its output hold
      ``context - 2`` tokens at most, and ``min_new_tokens`` at that cap;
    - a prompt of ``max_req_len - 5`` tokens or more is refused (``validate_input_length``).

    SGLang's ``max_req_len`` is also below its KV pool: for a ``max_new_tokens`` not given this
    engine's KV cache (``kv_tokens``) caps it the same way, so such a request is never refused for
    the cache's size; a given one the cache cannot hold is refused (`generate_requests`), where
    SGLang would cut it to its pool."""
    if context is not None and prompt_len >= context:
        raise ValueError(f"The input ({prompt_len} tokens) is longer than the model's context length "
                         f"({context} tokens).")
    if given and context is not None and prompt_len + s.max_new_tokens > context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {prompt_len + s.max_new_tokens} tokens: {prompt_len} "
            f"tokens from the input messages and {s.max_new_tokens} tokens for the "
            f"completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit.")
    if context is not None and prompt_len >= context - 1 - 5:
        raise ValueError(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                         f"({context - 6} tokens). Use a shorter input (SGLang's limit: the context "
                         f"length {context} less 6; this engine does not truncate).")
    bounds = [b for b in (context, None if given else kv_tokens) if b is not None]
    if not bounds:
        return s
    max_new = max(0, min(s.max_new_tokens, min(bounds) - 1 - prompt_len - 1))
    if max_new == s.max_new_tokens and s.min_new_tokens <= max_new:
        return s
    return dataclasses.replace(s, max_new_tokens=max_new, min_new_tokens=min(s.min_new_tokens, max_new))


def check_context_length(config: Any, context_length: int) -> None:
    """Raise ValueError where SGLang refuses ``--context-length context_length`` for ``config``: not
    an integer >= 1, or longer than the length derived from the config (`sglang_context_length`)
    unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true in this process's environment."""
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"context_length must be an integer >= 1 or None, got {context_length!r}")
    derived = sglang_context_length(config)
    allow = os.environ.get(_LONGER_CONTEXT_ENV, "false").strip().lower() in ("true", "1", "yes", "y")
    if context_length > derived and not allow:
        raise ValueError(
            f"context_length {context_length} is greater than the context length derived from "
            f"the model config ({derived}: SGLang's get_context_length, max_position_embeddings "
            f"and rope_scaling); SGLang refuses it too unless {_LONGER_CONTEXT_ENV}=1 is set")


class GenerationCalls:
    """`ReferenceEngine`'s generation methods (it provides ``_call``, ``_lock``, ``_sched``,
    ``weight_version``, ``spec``, ``config``)."""

    def _check_prompts(self, input_ids: Any) -> list[list[int]]:
        """``input_ids`` as a list of prompts, each a non-empty list of token ids in the vocabulary.
        A token id is an int (a numpy or 0-dim integer tensor one too); a float (3.7, or 3.0) or a
        bool is refused, not truncated to a token: a float tensor of ids is a mistake upstream."""
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            input_ids = input_ids.tolist()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError(f"input_ids is a non-empty list of token-id lists, got {_shown(input_ids)}")
        if not any(_ids_of(p) is not None for p in input_ids):
            input_ids = [input_ids]             # one prompt given flat
        prompts = []
        V = self.spec.vocab_size
        for i, given in enumerate(input_ids):
            p = _ids_of(given)
            if p is None:
                raise ValueError(f"prompt {i} must be a list of token ids, got {_shown(given)}")
            if not p:
                raise ValueError(f"prompt {i} is empty")
            ids = [_token_id(t) for t in p]
            wrong = [(k, t) for k, (t, got) in enumerate(zip(p, ids)) if got is None]
            if wrong:
                k, t = wrong[0]
                raise ValueError(f"prompt {i} has {len(wrong)} token ids that are not ints (position {k}: "
                                 f"{t!r} of type {type(t).__name__}); token ids are ints in [0, {V}), "
                                 f"a float or bool is not rounded to one")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {V})")
            prompts.append(ids)
        return prompts

    def generate(self, input_ids: Any = None, max_new_tokens: int = 16, temperature: float = 0.0, *,
                 sampling_params: dict | None = None, stop_token_ids: Sequence[int] | None = None,
                 ignore_eos: bool = False, lora_path: str | Sequence[str | None] | None = None) -> list[list[int]]:
        """New token ids for each prompt (greedy when ``temperature`` is 0). Prompts may differ in
        length. ``sampling_params`` are SGLang's (`generation.Sampling`; they override the
        keywords); they stop at the config's eos and at their ``stop_token_ids``, at neither
        under ``ignore_eos`` (SGLang's rule). The ``stop_token_ids`` keyword replaces the eos, unless
        ``sampling_params`` give ``stop_token_ids`` (then theirs and the eos apply, the keyword
        not at all). ``lora_path``:
        a loaded LoRA adapter's name for every prompt (or one per prompt), as SGLang's."""
        sp = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        sp.update(sampling_params or {})
        eos = None
        if stop_token_ids is not None and sp.get("stop_token_ids") is None:   # else sampling_params' win
            ids = [_token_id(t) for t in stop_token_ids]
            if None in ids:
                raise ValueError(f"generate: stop_token_ids must be token ids (ints), got "
                                 f"{list(stop_token_ids)[:5]!r}")
            sp["stop_token_ids"] = ids
            eos = []
        return [r["output_ids"] for r in self.generate_requests(input_ids, sp, eos=eos, lora_path=lora_path)]

    def _eos(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(t) for t in eos])

    _context_override: int | None = None

    @property
    def context_length(self) -> int:
        """The context length requests are held to, as SGLang's ``model_config.context_len``:
        `set_context_length`'s (SGLang's ``--context-length``), else `sglang_context_length` of
        the config (``rope_scaling`` and the other keys SGLang reads, not only
        ``max_position_embeddings``)."""
        if self._context_override is not None:
            return self._context_override
        return sglang_context_length(self.config)

    def set_context_length(self, context_length: int | None) -> None:
        """SGLang's ``--context-length``: hold requests to ``context_length`` tokens instead of the
        length derived from the config (None: derived again). As SGLang, one longer than the
        derived length is refused unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true in
        this process's environment."""
        if context_length is None:
            self._context_override = None
            return
        check_context_length(self.config, context_length)
        self._context_override = context_length

    ABORT_POLL_S = 0.02
    """How often a waiting caller asks its ``should_abort`` when no step arrives (`generate_requests`)."""

    def generate_requests(self, input_ids: Any, sampling_params: dict | Sequence[dict] | None = None, *,
                          return_logprob: bool = False, logprob_start_len: int | None = None,
                          on_step: Callable[[list[dict]], None] | None = None,
                          should_abort: Callable[[int], bool] | None = None,
                          eos: Sequence[int] | None = None,
                          lora_path: str | Sequence[str | None] | None = None) -> list[dict]:
        """SGLang's ``/generate`` on this engine. One result per prompt and sample (``n`` samples of
        a prompt are consecutive): ``output_ids``, ``finish_reason`` (SGLang's ``{"type": "stop",
        "matched": id}`` / ``{"type": "length", "length": n}`` / ``{"type": "abort", ...}``),
        ``prompt_index``, SGLang's ``weight_versions`` (``{"version", "start", "end"}`` spans over
        the output tokens: the version loaded when each token's step ran) and ``weight_version``
        (the last span's), ``request_id`` (the engine's id of the row, as `step_records` names
        it), and with ``return_logprob`` SGLang's ``output_token_logprobs`` (``[logprob,
        token_id, None]`` each, the temperature-scaled distribution's) and, when
        ``logprob_start_len >= 0``, ``input_token_logprobs`` from that position (position 0 has
        no logprob). ``sampling_params``: one dict for all prompts or one per prompt.

        Calls from several threads run batched together (`scheduler`): each row joins the
        running batch at the next step once KV-cache room is free. ``on_step(results)`` runs in
        the caller's thread after a step that gave one of its results ``stream_interval`` new
        tokens since the last call, or ended it (streaming, SGLang's rule);
        ``should_abort(row)`` is asked after each step and every `ABORT_POLL_S` while waiting, and
        an aborted row ends at the next step (at once while generation is paused). Out of
        service (`set_serving`) this raises `EngineUnavailableError` naming the reason."""
        prompts = self._check_prompts(input_ids)
        sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        eos = self._eos() if eos is None else [int(t) for t in eos]
        loras = self._check_lora_paths(lora_path, len(prompts))
        specs = [dataclasses.replace(Sampling.from_sglang(sp, eos=eos, vocab=self.spec.vocab_size), lora=lp)
                 for sp, lp in zip(sps, loras)]
        ctx = self.context_length
        for i, (p, s, sp) in enumerate(zip(prompts, specs, sps)):
            given = isinstance(sp, dict) and sp.get("max_new_tokens") is not None
            specs[i] = s = fit_max_new_tokens(len(p), s, given=given, context=ctx,
                                              kv_tokens=self.kv_cache_tokens)
            need = kv_need(len(p), s)
            if need > self.kv_cache_tokens:
                raise EngineStateError(f"generate: prompt {i} ({len(p)} tokens) + max_new_tokens "
                                       f"({s.max_new_tokens}) needs {need} KV-cache tokens; the "
                                       f"cache holds {self.kv_cache_tokens} (kv_cache_tokens)")
        if logprob_start_len is not None and logprob_start_len >= 0 and not return_logprob:
            raise ValueError("logprob_start_len needs return_logprob=True")
        if logprob_start_len is not None and logprob_start_len >= 0:
            longer = [i for i, p in enumerate(prompts) if logprob_start_len > len(p)]
            if longer:      # SGLang aborts such a request (Scheduler.handle_generate_request)
                i = longer[0]
                raise ValueError(f"logprob_start_len={logprob_start_len} is higher than the number of "
                                 f"input tokens of prompt {i} ({len(prompts[i])}). Please use a "
                                 f"smaller logprob_start_len.")
        self._check_usable()
        if self.serving_state is not None:
            raise EngineUnavailableError(f"generate: the engine is out of service ({self.serving_state}); "
                                   f"set_serving(True) brings it back")
        # n samples of a prompt, each with the request's sampling params (its seed too), as SGLang's
        rows = [(i, s) for i, s in enumerate(specs) for _ in range(s.n)]
        version = self.weight_version
        results = [{"prompt_index": i, "output_ids": [], "finish_reason": None,
                    "weight_versions": weight_version_spans([], version), "weight_version": version}
                   | ({"output_token_logprobs": []} if return_logprob else {}) for i, _ in rows]
        start = None
        if return_logprob and logprob_start_len is not None and logprob_start_len >= 0:
            start = int(logprob_start_len)
            for r in results:
                r["input_token_logprobs"] = []
            # a row that generates gets them from the scheduler, with its first token's weights;
            # one that generates nothing (a prompt scored alone) here
            idle = sorted({i for i, s in rows if s.max_new_tokens <= 0})
            if idle:
                inputs = self._input_logprobs([prompts[i] for i in idle], start, [loras[i] for i in idle])
                for r in results:
                    if r["prompt_index"] in idle:
                        r["input_token_logprobs"] = inputs[idle.index(r["prompt_index"])]
        call = self._sched.submit([(prompts[i], s, return_logprob, start if s.max_new_tokens > 0 else None)
                                   for i, s in rows], version)
        for r, row in zip(results, call.rows):
            r["request_id"] = row.rid
        tags: list[list[str]] = [[] for _ in rows]
        told, ended = [0] * len(rows), [False] * len(rows)      # as of the last on_step
        try:
            done = False
            while not done:
                event = call.next_event(self.ABORT_POLL_S if should_abort is not None else 1.0)
                if event is not None:
                    kind, payload = event
                    if kind == "error":
                        raise payload
                    if kind == "done":
                        done = True
                    else:
                        self._apply(results, tags, payload)
                        if on_step is not None and self._stream_due(results, rows, told, ended):
                            on_step(results)
                if should_abort is not None and not done:
                    for k, r in enumerate(results):
                        if r["finish_reason"] is None and call.rows[k].abort is None and should_abort(k):
                            self._sched.abort(call, k, "request aborted")
        except BaseException:
            self._sched.cancel(call)
            raise
        return results

    @staticmethod
    def _stream_due(results: list[dict], rows: list, told: list[int], ended: list[bool]) -> bool:
        """Whether a streaming caller is told now (SGLang's ``stream_interval`` rule): some result
        made ``stream_interval`` tokens since it was last told, or ended (an abort may end one
        with no new token). Updates ``told`` (output tokens at the last telling) and ``ended``."""
        due = False
        for k, (r, (_, s)) in enumerate(zip(results, rows)):
            n, done = len(r["output_ids"]), r["finish_reason"] is not None
            if (n > told[k] and (done or n - told[k] >= s.stream_interval)) or (done and not ended[k]):
                due, told[k], ended[k] = True, n, done
        return due

    @staticmethod
    def _apply(results: list[dict], tags: list[list[str]], changes: dict) -> None:
        """One step's changes (`scheduler.Call` events) into the caller's results."""
        for k, ch in changes.items():
            r = results[k]
            r["output_ids"].extend(ch["tokens"])
            if "output_token_logprobs" in r:
                r["output_token_logprobs"].extend([lp, t, None] for lp, t in zip(ch["logprobs"], ch["tokens"]))
            if "input_logprobs" in ch:
                r["input_token_logprobs"] = ch["input_logprobs"]
            tags[k].extend(ch["versions"])
            r["weight_versions"] = weight_version_spans(tags[k], ch["version"])
            r["weight_version"] = r["weight_versions"][-1]["version"]
            if ch["finish"] is not None:
                r["finish_reason"] = ch["finish"]

    # ------------------------------------------------------------------ versions, pause, service
    def get_weight_version(self) -> str:
        """SGLang's weight version of the loaded weights (``"default"`` until one is given)."""
        return self.weight_version

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Call the loaded weights ``new_version`` from the next step on (SGLang's
        ``/update_weight_version``; tokens made before keep their version in ``weight_versions``).
        ``abort_all_requests``: first end every request, as aborted."""
        check_version(new_version, "update_weight_version", optional=False)
        if not isinstance(abort_all_requests, bool):
            raise ValueError(f"update_weight_version: abort_all_requests must be a bool, got "
                             f"{abort_all_requests!r}")
        with self._lock:
            if abort_all_requests:
                self._sched.abort_all(self, "aborted by update_weight_version(abort_all_requests=True)")
            self.weight_version = new_version

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's ``/pause_generation``: ``"abort"`` ends every request now (finish reason
        ``abort``, with the tokens it had); ``"retract"`` frees the running requests' KV and
        recomputes them after `continue_generation` (prompt + tokens so far, with the weights
        loaded then); ``"in_place"`` stops stepping and keeps their KV. New requests queue until
        `continue_generation`; weight updates run at once while paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {', '.join(map(repr, PAUSE_MODES))}, "
                             f"got {mode!r}")
        with self._lock:       # no step in flight
            self._sched.pause(self, mode)

    def continue_generation(self) -> None:
        """SGLang's ``/continue_generation``: steps run again."""
        self._sched.resume()

    @property
    def generation_paused(self) -> str | None:
        """The `pause_generation` mode in force, or None."""
        return self._sched.paused

    def set_serving(self, serving: bool, reason: str = "") -> None:
        """Take the engine out of service (``serving=False``; a fleet's quarantine) or bring it
        back. Out of service, generate refuses with `EngineUnavailableError` naming ``reason`` and the
        requests in flight end as aborted; weight updates and reads still work."""
        if not isinstance(serving, bool):
            raise ValueError(f"set_serving: serving must be a bool, got {serving!r}")
        if not isinstance(reason, str):
            raise ValueError(f"set_serving: reason must be a string, got {reason!r}")
        with self._lock:
            self._sched.set_out_of_service(self, None if serving else (reason or "taken out of service"))

    @property
    def serving_state(self) -> str | None:
        """None while serving; else why the engine is out of service (`set_serving`)."""
        return self._sched.out_of_service

    def _pause_after_steps(self, steps: int) -> None:
        """Test hook: pause generation in place once ``steps`` more steps have run (a point to
        update weights at that does not depend on the machine's speed)."""
        self._sched.pause_after(steps)

    def step_records(self) -> list:
        """The scheduler's last steps (`scheduler.StepRecord`: the requests each prefilled and
        decoded, and their tokens' weight version), oldest first."""
        return self._sched.records()

    def scheduler_stats(self) -> dict:
        """Requests waiting and running, the pause mode, updates waiting, steps run."""
        return self._sched.stats()

    def _check_lora_paths(self, lora_path: Any, n: int) -> list[str | None]:
        """One adapter name (or None) per prompt, each a loaded adapter (SGLang's ``lora_path``)."""
        paths = list(lora_path) if isinstance(lora_path, (list, tuple)) else [lora_path] * n
        if len(paths) != n:
            raise ValueError(f"lora_path has {len(paths)} entries for {n} prompts")
        loaded = getattr(self, "lora_adapters", {})
        for i, p in enumerate(paths):
            if p is not None and p not in loaded:
                raise ValueError(f"lora_path {p!r} (prompt {i}) is not a loaded LoRA adapter; loaded: "
                                 f"{sorted(loaded)} (load_lora_adapter_from_tensors)")
        return paths

    def _input_logprobs(self, prompts: list[list[int]], start: int,
                        loras: Sequence[str | None] = ()) -> list[list]:
        loras = list(loras) or [None] * len(prompts)
        logits: list = [None] * len(prompts)
        for name in dict.fromkeys(loras):     # one forward per adapter (None: the base)
            idx = [i for i, lp in enumerate(loras) if lp == name]
            got = self._call("forward_logits", {"prompts": [prompts[i] for i in idx], "all_positions": True,
                                                "lora": name}, collective=True)[0]
            for i, lg in zip(idx, got):
                logits[i] = lg
        return [input_token_logprobs(p, lg, start) for p, lg in zip(prompts, logits)]

    def forward_logits(self, input_ids: Any, *, all_positions: bool = False, lora_path: str | None = None) -> Any:
        """Logits of the engine dtype: ``[batch, vocab]`` at each prompt's last position, or with
        ``all_positions`` a list of ``[len_i, vocab]`` (``[batch, len, vocab]`` for a tensor input).
        ``lora_path``: a loaded LoRA adapter applied to every prompt."""
        rect = isinstance(input_ids, torch.Tensor)
        prompts = self._check_prompts(input_ids)
        self._check_lora_paths(lora_path, len(prompts))
        out = self._call("forward_logits", {"prompts": prompts, "all_positions": all_positions,
                                            "lora": lora_path}, collective=True)[0]
        if all_positions and rect:
            return torch.stack(out)
        return out

    # ------------------------------------------------------------------ reading weights back
