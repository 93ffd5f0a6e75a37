"""Generation on a reference engine, from the client's side: checking prompts, SGLang's
``generate`` and the per-request `generate_requests` (sampling, EOS, aborts, input logprobs), and
``forward_logits``. A mixin of `ReferenceEngine`: it speaks to the workers through the engine's
``_call``.

Not here: the decode loop and sampling math (`generation`, run in each worker), the HTTP fields
(`generate_request`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .generation import Sampling

__all__ = ["GenerationCalls"]


class GenerationCalls:
    """`ReferenceEngine`'s generation methods (it provides ``_call``, ``_lock``, ``spec``, ``config``)."""

    def _check_prompts(self, input_ids: Any) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            input_ids = input_ids.tolist()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise ValueError("input_ids is a non-empty list of token-id lists")
        if all(isinstance(t, int) for t in input_ids):
            input_ids = [list(input_ids)]
        prompts = []
        V = self.spec.vocab_size
        for i, p in enumerate(input_ids):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {V})")
            prompts.append(p)
        return prompts

    def generate(self, input_ids: Any = None, max_new_tokens: int = 16, temperature: float = 0.0, *,
                 sampling_params: dict | None = None, stop_token_ids: Sequence[int] | None = None,
                 ignore_eos: bool = False) -> list[list[int]]:
        """New token ids for each prompt (greedy when ``temperature`` is 0). Prompts may differ in
        length. ``sampling_params`` are SGLang's (`generation.Sampling`; they override the
        keywords); they stop at the config's eos (unless ``ignore_eos``) and at their
        ``stop_token_ids``. The ``stop_token_ids`` keyword instead replaces the eos."""
        sp = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
        sp.update(sampling_params or {})
        eos = None
        if stop_token_ids is not None:
            sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
            eos = []
        return [r["output_ids"] for r in self.generate_requests(input_ids, sp, eos=eos)]

    def _eos(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(t) for t in eos])

    ABORT_STEPS = 4
    """Decode steps per worker round trip while a caller watches for aborts (`generate_requests`)."""

    def generate_requests(self, input_ids: Any, sampling_params: dict | Sequence[dict] | None = None, *,
                          return_logprob: bool = False, logprob_start_len: int | None = None,
                          on_step: Callable[[list[dict]], None] | None = None,
                          should_abort: Callable[[int], bool] | None = None,
                          eos: Sequence[int] | None = None) -> list[dict]:
        """SGLang's ``/generate`` on this engine. One result per prompt and sample (``n`` samples of
        a prompt are consecutive): ``output_ids``, ``finish_reason`` (SGLang's ``{"type": "stop",
        "matched": id}`` / ``{"type": "length", "length": n}`` / ``{"type": "abort", ...}``),
        ``prompt_index``, and with ``return_logprob`` SGLang's ``output_token_logprobs``
        (``[logprob, token_id, None]`` each, the temperature-scaled distribution's) and, when
        ``logprob_start_len >= 0``, ``input_token_logprobs`` from that position (position 0 has
        no logprob). ``sampling_params``: one dict for all prompts or one per prompt.

        ``on_step(results)`` runs after each decode step (streaming); ``should_abort(row)`` is asked
        every `ABORT_STEPS` steps and an aborted row ends there. The engine is held for the whole
        call."""
        prompts = self._check_prompts(input_ids)
        sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        eos = self._eos() if eos is None else [int(t) for t in eos]
        specs = [Sampling.from_sglang(sp, eos=eos, vocab=self.spec.vocab_size) for sp in sps]
        ctx = getattr(self.config, "max_position_embeddings", None)
        for p, s in zip(prompts, specs):
            if ctx is not None and len(p) + s.max_new_tokens > ctx:   # SGLang's words
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} "
                    f"tokens. You requested a total of {len(p) + s.max_new_tokens} tokens: {len(p)} "
                    f"tokens from the input messages and {s.max_new_tokens} tokens for the "
                    f"completion. Please reduce the number of tokens in the input messages or the "
                    f"completion to fit within the limit.")
        if logprob_start_len is not None and logprob_start_len >= 0 and not return_logprob:
            raise ValueError("logprob_start_len needs return_logprob=True")
        rows = [(i, s) for i, (p, s) in enumerate(zip(prompts, specs)) for _ in range(s.n)]
        # decode steps per worker round trip: one when every token is streamed; a few when only
        # aborts are watched (an abort then lands within that many steps); many otherwise
        steps = 1 if on_step is not None else (self.ABORT_STEPS if should_abort is not None else 64)
        results = [{"prompt_index": i, "output_ids": [], "finish_reason": None}
                   | ({"output_token_logprobs": []} if return_logprob else {}) for i, _ in rows]
        with self._lock:
            if return_logprob and logprob_start_len is not None and logprob_start_len >= 0:
                inputs = self._input_logprobs(prompts, int(logprob_start_len))
                for r in results:
                    r["input_token_logprobs"] = inputs[r["prompt_index"]]
            self._call("gen_begin", {"prompts": [prompts[i] for i, _ in rows],
                                     "rows": [s for _, s in rows], "logprobs": return_logprob},
                       what="generate", collective=True)
            try:
                finished = False
                while not finished:
                    drop = [k for k, r in enumerate(results) if r["finish_reason"] is None
                            and should_abort is not None and should_abort(k)]
                    for k in drop:
                        results[k]["finish_reason"] = {"type": "abort", "message": "request aborted"}
                    out = self._call("gen_step", {"drop": drop, "steps": steps}, what="generate",
                                     collective=True)[0]
                    for k, ts in out["tokens"].items():
                        r = results[k]
                        r["output_ids"].extend(ts)
                        if return_logprob:
                            r["output_token_logprobs"].extend(
                                [lp, t, None] for lp, t in zip(out["logprobs"][k], ts))
                    for k, why in out["ended"].items():
                        r = results[k]
                        r["finish_reason"] = ({"type": "stop", "matched": r["output_ids"][-1]}
                                              if why == "stop" else
                                              {"type": "length", "length": len(r["output_ids"])})
                    finished = out["finished"]
                    if on_step is not None:
                        on_step(results)
            finally:
                if self.dead_reason() is None:
                    self._call("gen_end", what="generate")
        for r, (_, s) in zip(results, rows):
            if r["finish_reason"] is None:     # max_new_tokens 0
                r["finish_reason"] = {"type": "length", "length": 0}
        return results

    def _input_logprobs(self, prompts: list[list[int]], start: int) -> list[list]:
        logits = self._call("forward_logits", {"prompts": prompts, "all_positions": True},
                            collective=True)[0]
        out = []
        for p, lg in zip(prompts, logits):
            lps = torch.log_softmax(lg.float(), dim=-1)
            out.append([[None if j == 0 else float(lps[j - 1, p[j]]), p[j], None]
                        for j in range(min(start, len(p)), len(p))])
        return out

    def forward_logits(self, input_ids: Any, *, all_positions: bool = False) -> Any:
        """Logits of the engine dtype: ``[batch, vocab]`` at each prompt's last position, or with
        ``all_positions`` a list of ``[len_i, vocab]`` (``[batch, len, vocab]`` for a tensor input)."""
        rect = isinstance(input_ids, torch.Tensor)
        prompts = self._check_prompts(input_ids)
        out = self._call("forward_logits", {"prompts": prompts, "all_positions": all_positions},
                         collective=True)[0]
        if all_positions and rect:
            return torch.stack(out)
        return out

    # ------------------------------------------------------------------ reading weights back
