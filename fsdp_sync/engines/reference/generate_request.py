"""SGLang's ``/generate`` request as `fsdp-sync serve` reads it, and the client connection it answers.

`parse_generate` checks a ``/generate`` body the way an RL client sends it (verl, slime, plain
``requests``): ``input_ids`` (one prompt or a batch), ``sampling_params`` (one dict or one per
prompt; checked by `generation.Sampling`), ``return_logprob`` with ``logprob_start_len``,
``stream``, ``rid`` (with ``n`` > 1 each sample gets an id of its own, `sample_ids`). A field this server cannot honour is refused naming it (400), never ignored;
``lora_path`` (a loaded LoRA adapter's name, or one name or null per prompt); fields SGLang defines
that change nothing at their default value (``image_data: null``, ``lora_id: null``, ...) are
accepted at that value only.

`ClientWatch` is the answering side of one request: it tells whether the client has gone away
(its socket reads EOF: the request is then aborted, as SGLang aborts a disconnected client's
request) and writes SGLang's server-sent events for ``stream`` (``data: {...}`` chunks, each
holding the whole output so far, then ``data: [DONE]``).

Not here: the routes (`serve`), generation itself (`generation`).
"""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .generation import Sampling

__all__ = ["GenerateRequest", "parse_generate", "answer_item", "ClientWatch", "GenerateRefused",
           "generation_config_eos", "sglang_eos", "sample_ids"]

# SGLang GenerateReqInput fields accepted only at a value that changes nothing here
_NEUTRAL = {"image_data": (None,), "video_data": (None,), "audio_data": (None,),
            "lora_id": (None,), "top_logprobs_num": (None, 0),
            "token_ids_logprob": (None,), "return_text_in_logprobs": (None, False),
            "custom_logit_processor": (None,), "return_hidden_states": (None, False),
            "return_routed_experts": (None, False), "session_params": (None,),
            "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
            "data_parallel_rank": (None, 0), "modalities": (None,), "log_metrics": (None, True, False),
            # what sglang-router 0.3 sends in every routed request, at these values
            "background": (None, False), "no_logs": (None, False, True), "return_bytes": (None, False),
            "return_entropy": (None, False)}
_KEYS = ("input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "stream", "rid",
         "model", "lora_path")
# model: the served model's name, which sglang-router adds to every request it routes


class GenerateRefused(ValueError):
    """A ``/generate`` body this server cannot serve (HTTP 400)."""


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    single: bool                      # one prompt (answer a dict, not a list)
    sampling: list[dict]              # per prompt, as given
    n: int                            # samples per prompt
    interval: list[int]               # stream_interval per prompt
    rids: list[str]                   # per prompt
    ids: list[str]                    # per result (prompt-major, ``n`` per prompt): its meta_info id,
                                      # the one ``/abort_request`` ends it by (`sample_ids`)
    return_logprob: bool
    logprob_start_len: int | None
    stream: bool
    lora_path: str | list | None = None   # the adapter (one, or one or None per prompt)


def _ids_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_generate(body: dict) -> GenerateRequest:
    """Check a ``/generate`` body (see the module docstring); raises `GenerateRefused` naming the field."""
    for key, value in body.items():
        if key in _KEYS:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise GenerateRefused(f"field {key!r}={value!r} is not supported by this server "
                                      f"(only {_NEUTRAL[key][0]!r})")
            continue
        raise GenerateRefused(f"field {key!r} is not supported by this server; supported: "
                              f"{', '.join(_KEYS)}")
    if not isinstance(body.get("model"), (str, type(None))):
        raise GenerateRefused(f"field 'model' must be a string (the served model's name), got {body['model']!r}")
    if body.get("text") is not None:
        raise GenerateRefused("field 'text': this server has no tokenizer: send input_ids, not text")
    ids = body.get("input_ids")
    single = _ids_list(ids)
    prompts = [ids] if single else ids
    if not isinstance(prompts, list) or not prompts or not all(_ids_list(p) for p in prompts):
        raise GenerateRefused("field 'input_ids' must be a list of token ids or a non-empty list of "
                              "non-empty lists of token ids")
    sp = body.get("sampling_params")
    if sp is None or isinstance(sp, dict):
        sps = [dict(sp or {}) for _ in prompts]
    elif isinstance(sp, list) and len(sp) == len(prompts) and all(isinstance(x, dict) for x in sp):
        sps = [dict(x) for x in sp]
    else:
        raise GenerateRefused(f"field 'sampling_params' must be an object or a list of "
                              f"{len(prompts)} objects (one per prompt), got {sp!r:.80}")
    try:
        specs = [Sampling.from_sglang(x) for x in sps]
    except ValueError as exc:
        raise GenerateRefused(str(exc)) from None
    ns = {s.n for s in specs}
    if len(ns) != 1:
        raise GenerateRefused(f"sampling_params.n must be the same for every prompt, got {sorted(ns)}")
    flags = {}
    for key in ("return_logprob", "stream"):
        v = body.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise GenerateRefused(f"field {key!r} must be true or false, got {v!r}")
        flags[key] = v
    start = body.get("logprob_start_len")
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < -1):
        raise GenerateRefused(f"field 'logprob_start_len' must be an integer >= -1, got {start!r}")
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif single and isinstance(rid, str) and rid:
        rids = [rid]
    elif not single and isinstance(rid, str) and rid:      # SGLang's ``_normalize_rid``
        rids = [f"{rid}_{i}" for i in range(len(prompts))]
    elif not single and isinstance(rid, list) and len(rid) == len(prompts) and all(
            isinstance(r, str) and r for r in rid) and len(set(rid)) == len(rid):
        rids = list(rid)
    else:
        raise GenerateRefused(f"field 'rid' must be a non-empty string (a batch's: its ids are "
                              f"rid_0, rid_1, ...) or a list of {len(prompts)} distinct strings (a "
                              f"batch), got {rid!r:.80}")
    lora = body.get("lora_path")
    if not (lora is None or (isinstance(lora, str) and lora) or (
            isinstance(lora, list) and len(lora) == len(prompts)
            and all(x is None or (isinstance(x, str) and x) for x in lora))):
        raise GenerateRefused(f"field 'lora_path' must be a loaded LoRA adapter's name, or a list of "
                              f"{len(prompts)} names or nulls (one per prompt), got {lora!r:.80}")
    n = ns.pop()
    return GenerateRequest(prompts=prompts, single=single, sampling=sps, n=n,
                           interval=[s.stream_interval for s in specs], rids=rids,
                           ids=sample_ids(rids, n),
                           return_logprob=flags["return_logprob"],
                           # SGLang reads it only with return_logprob, and ignores it otherwise
                           logprob_start_len=(None if start is None or start < 0 or not flags["return_logprob"]
                                              else start),
                           stream=flags["stream"], lora_path=lora)


def sample_ids(rids: list[str], n: int) -> list[str]:
    """The id of each of the ``n`` samples of each prompt: with ``n`` 1 the prompt's own; with
    ``n`` > 1 a fresh uuid4 hex each, as SGLang 0.5.23's ``TokenizerManager._handle_batch_request``
    gives every sample (``GenerateReqInput.regenerate_rid``) after dropping the prompt's own id from
    ``rid_to_state``: a sample answers its own id in ``meta_info.id`` and is aborted by it alone,
    and ``/abort_request`` with the request's ``rid`` finds nothing (``abort_request`` returns at
    an unknown id)."""
    return list(rids) if n == 1 else [uuid.uuid4().hex for _ in range(len(rids) * n)]


def answer_item(req: GenerateRequest, k: int, r: dict, version: str, t0: float) -> dict:
    """SGLang's answer for result ``k`` of ``req`` (an engine result ``r``), ``req.ids[k]`` its id:
    ``text`` (empty: no tokenizer), ``output_ids`` and ``meta_info``; with ``return_logprob``
    both ``input_token_logprobs`` (empty when ``logprob_start_len`` is -1, as SGLang's) and
    ``output_token_logprobs`` with ``output_token_logprobs_length``; in a stream of a batch (or
    of ``n`` > 1 samples: SGLang answers those as a batch) the chunk's ``index``. ``version``:
    the weight version for an engine whose results carry none; ``t0``: when the request began."""
    n_out = len(r["output_ids"])
    meta = {"id": req.ids[k],
            "finish_reason": r["finish_reason"], "prompt_tokens": len(req.prompts[r["prompt_index"]]),
            "completion_tokens": n_out, "cached_tokens": 0,
            "weight_version": r.get("weight_version", version),
            "weight_versions": [dict(v) for v in r.get("weight_versions") or
                                [{"version": version, "start": 0, "end": n_out}]],
            "e2e_latency": time.monotonic() - t0}
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in r:
            meta[key] = list(r[key])
    if req.return_logprob:
        meta.setdefault("input_token_logprobs", [])
        meta.setdefault("output_token_logprobs", [])
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    out = {"text": "", "output_ids": list(r["output_ids"]), "meta_info": meta}
    if req.stream and not (req.single and req.n == 1):
        out["index"] = k
    return out


def generation_config_eos(model_path: str) -> list[int]:
    """The ``eos_token_id`` of the ``generation_config.json`` beside a served checkpoint (the
    directory ``model_path``, or the folder of its ``config.json``), which SGLang 0.5.23 adds to
    the config's eos ids (``ModelConfig._get_hf_eos_token_id``: a request ends at either); [] when
    there is none. A file that does not read is refused (ValueError naming it): serving without
    its eos ids would run requests past where SGLang ends them."""
    from pathlib import Path

    p = Path(model_path)
    folder = p if p.is_dir() else p.parent if p.name == "config.json" else None
    if folder is None or not (folder / "generation_config.json").is_file():
        return []
    path = folder / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} does not read as a generation config ({type(exc).__name__}: "
                         f"{exc}); SGLang takes its eos_token_id as stop tokens") from None
    if not eos:                     # SGLang's test: an eos id 0 or [] adds nothing
        return []
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r:.60}")
    return ids


def sglang_eos(config: Any, extra: list[int]) -> list[int] | None:
    """The eos ids SGLang stops at (the config's and ``extra``, `generation_config_eos`'s), or
    None when ``extra`` adds none (the engine's own, the config's, then apply)."""
    eos = getattr(config, "eos_token_id", None)
    own = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    return None if not extra else sorted(set(own) | set(extra))


class ClientWatch:
    """Whether one request's client went away, and its server-sent events (module docstring)."""

    CHECK_EVERY_S = 0.02

    def __init__(self, handler: Any) -> None:
        self.h = handler
        self.gone = False
        self._checked = 0.0

    def __call__(self) -> bool:
        if self.gone or self.h is None:
            return self.gone
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S:
            return False
        self._checked = now
        sock = self.h.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            # readable with nothing to read: the client closed its end
            if readable and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                self.gone = True
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            self.gone = True
        return self.gone

    def start_stream(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")     # the body ends when the connection does
        h.end_headers()
        h.close_connection = True
        h.wfile.flush()

    def send(self, obj: Any) -> None:
        self._write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def end_stream(self) -> None:
        self._write(b"data: [DONE]\n\n")

    def _write(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            self.h.wfile.write(data)
            self.h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.gone = True
