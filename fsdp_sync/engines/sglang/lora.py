"""SGLang's LoRA calls through `SGLangEngine`: load an adapter from tensors, unload it, list the
loaded ones, and (``fsdp-sync serve`` only) digests of an adapter as the engine holds it. A mixin
of `adapter.SGLangEngine` (it provides ``_http``, ``_local``, ``_check_open``, ``tp_size`` and
``where``).

Over HTTP the body is what the server's release takes (`versions`: its ``lora_tensors_field``):
``lora_name``, ``config_dict`` (a peft ``LoraConfig`` dict, enums as strings) and the tensors as
the whole ``{name: tensor}`` dict (SGLang shards it itself) in base64 payloads: from 0.5.20 on
``serialized_named_tensors``, one payload per TP rank (what verl's ``AsyncHttpServerAdapter
.load_lora_adapter_from_tensor`` sends); in 0.5.12 (verl 0.9.1's pin) ``serialized_tensors``, ONE
payload that every TP worker deserializes. The tensors are copied into one shared buffer first, so
the payloads point at one segment, kept until the server answered; the lease counts one reference
per TP rank either way (each opening gives one back). ``pinned`` and ``added_tokens_config`` are
fields of both releases' request. A release between 0.5.12 and 0.5.20 (not read) is refused.
``unload_lora_adapter`` is ``/unload_lora_adapter {lora_name}``; ``available_models`` is
``GET /v1/models`` (SGLang lists each adapter as a card under its name). In process,
``available_models`` builds the same cards from what that route reads, the tokenizer manager's
LoRA registry (``sglang.Engine`` has no method for it), and the load / unload ``sglang.Engine``
methods of those names are called with the tensors themselves, as a dict:
``Engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=None)`` in
0.5.12 and 0.5.23 (it serializes the dict itself) takes no ``pinned`` / ``added_tokens_config``:
given to such an engine they are refused by name, not dropped.

`lora_refusal` (asked by `lora_sync.check_engine` before any engine is paused, unloaded or
loaded, and by the verl adapter before a LoRA run's base is sent, `verl_lora.engine_refusal`;
`load_lora_adapter_from_tensors` asks it too, before sending) says what SGLang's load
would refuse, read from the server's launch arguments (``get_server_info``: the first answer,
then, over HTTP, the one every sync's ``begin_weight_update`` reads, `follow_lora_args`): LoRA not
enabled (``enable_lora`` false: "LoRA is not enabled", 0.5.12 and 0.5.23), and an adapter rank
``r`` over ``max_lora_rank`` (``--max-lora-rank``: the LoRA memory pool's buffers are that wide;
``LoRAManager.validate_new_adapter`` answers success=False "... with rank r is incompatible with
the current LoRA memory pool configuration" without naming the limit, and only after a sync has
paused generation and unloaded the adapter SGLang served under that name), and target modules
outside ``--lora-target-modules`` (``lora_target_modules``; the same late refusal: the pool holds
buffers for those modules only), compared as SGLang compares them, both sides normalized by its
``get_normalized_target_modules`` (`peft_names.sglang_targets`: ``q_proj`` / ``k_proj`` /
``v_proj`` are ``qkv_proj``, ...; an adapter on ``"all-linear"`` passes SGLang's check, but its
tensors on modules outside would be skipped at the load, a wrong result: refused too), naming the
adapter's modules outside and the flag to launch with. A server that does not report
them (``fsdp-sync serve``, whose engine checks its own), ``max_lora_rank`` None (SGLang then sizes
the pool for the largest rank of its ``--lora-paths``, which it does not report), or target modules
``all`` or none (sized for what SGLang found in the base model or its ``--lora-paths``), is not
checked here: SGLang's own refusal stands.

A server restarted at the same URL with other LoRA arguments (a smaller ``--max-lora-rank``, fewer
``--lora-target-modules``) answers the next sync's server info with them (`session_calls
.check_tp_size`, no request of its own): `follow_lora_args` keeps them and asks `lora_refusal`
again of the adapter it was last asked about, so the sync's ``begin_weight_update`` is refused
before the base is sent, not the adapter's load after it (SGLang's late refusal, with the adapter
it served under that name unloaded); the next syncs' checks read the new arguments.

``lora_checksums`` reads ``POST /fsdp_sync/lora_checksums``, which only ``fsdp-sync serve`` has:
SGLang cannot hand an adapter back, so against it the call raises, naming what to set instead.

Not here: which adapter to send and when (`fsdp_sync.lora_sync`, the verl adapter), the server's
side (`engines.reference.serve_lora`).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from ...weights import handles
from ...weights.peft_names import sglang_targets
from . import versions
from .client import (NotFound, SGLangError, SGLangUpdateError, check_answer, lease_answered,
                     takes_keyword)

__all__ = ["LoRAClient"]

# the server args `lora_refusal` reads
_LORA_ARGS = ("enable_lora", "max_lora_rank", "lora_paths", "lora_target_modules")


def _with_message(answer: Any) -> Any:
    """SGLang answers LoRA calls with ``LoRAUpdateOutput`` (``success``, ``error_message``), which
    `check_answer` reads as ``message``."""
    if isinstance(answer, dict):
        if answer.get("error_message") and not answer.get("message"):
            return dict(answer, message=answer["error_message"])
        return answer
    error = getattr(answer, "error_message", None)
    if error and isinstance(getattr(answer, "success", None), bool):
        return {"success": answer.success, "message": error}
    return answer


def shared_copy(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``tensors`` as views of one shared-memory buffer (one segment for the whole adapter)."""
    total = sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in tensors)
    buf = handles.empty_shared(max(total, 1))
    out, off = {}, 0
    for name, t in tensors:
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        view = buf[off:off + n].view(t.dtype).view(t.shape)
        view.copy_(t.cpu())
        out[name] = view
        off += -(-n // 64) * 64
    return out


class LoRAClient:
    """`SGLangEngine`'s LoRA methods (see the module docstring)."""

    _lora_args: dict | None = None       # the server's LoRA launch arguments, as last read
    # (as the server resolved them: enable_lora is True where --lora-paths were given)
    _lora_asked: tuple | None = None     # (config_dict, metas): the adapter `lora_refusal` last read

    def lora_server_args(self) -> dict:
        """``{"enable_lora", "max_lora_rank", "lora_paths", "lora_target_modules"}`` as the
        server reports them (its launch arguments: ``get_server_info``, or an in-process engine's
        ``server_args``); a key the server does not report is left out. Asked once; over HTTP
        each sync's server-info answer keeps them current (`follow_lora_args`: a server restarted
        at the same URL may have been launched with others)."""
        if self._lora_args is None:
            info: Any = None
            if self._http:
                try:
                    info = self.server_info()
                except SGLangError as e:
                    if e.status != 404:          # unreachable: the load would fail too
                        raise
            else:
                info = self._local.server_info
                if info is None and self._local.has("get_server_info"):
                    info = self._local.call("get_server_info")
                if not isinstance(info, dict):
                    args = getattr(self._local.engine, "server_args", None)
                    info = {k: getattr(args, k) for k in _LORA_ARGS if hasattr(args, k)}
            if self._lora_args is None:          # (`server_info` above notes them itself)
                self.note_lora_args(info if isinstance(info, dict) else {})
        return dict(self._lora_args)

    def note_lora_args(self, info: dict) -> None:
        """Keep the LoRA launch arguments of a server-info answer (the first one read)."""
        if self._lora_args is None:
            self._lora_args = {k: info[k] for k in _LORA_ARGS if k in info}

    def follow_lora_args(self, info: dict) -> str | None:
        """Keep the LoRA launch arguments of ``info``, a server-info answer read at a sync's start
        (`check_tp_size`), and say why the adapter `lora_refusal` was last asked about would now
        be refused (None: the arguments did not change, no adapter was asked about, or it would
        be taken). Arguments as they were cost a comparison: nothing is asked of the server."""
        now = {k: info[k] for k in _LORA_ARGS if k in info}
        before = self._lora_args
        if before is None or now == before:
            self._lora_args = now
            return None
        self._lora_args = now
        if self._lora_asked is None:
            return None
        why = self.lora_refusal(*self._lora_asked)
        if why is None:
            return None
        changed = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in _LORA_ARGS
                            if before.get(k) != now.get(k))
        cfg = self._lora_asked[0]
        return (f"{self.features.label}{self.where} now reports other LoRA launch arguments than "
                f"this SGLangEngine read before ({changed}: restarted?), and the adapter last "
                f"checked against it (r={cfg.get('r')!r}, target_modules="
                f"{cfg.get('target_modules')!r}) would be refused: {why}")

    def lora_refusal(self, config_dict: Any, metas: Any = ()) -> str | None:
        """Why SGLang would refuse to load an adapter of ``config_dict`` (peft's dict), said
        without sending it (None: not known to be refused; see the module docstring). ``metas``:
        the adapter's tensors, ``[(peft name, dtype, shape)]`` (`lora_sync.check_engine` passes
        them; read for an adapter on "all", `_skipped_refusal`)."""
        self._check_open("lora_refusal")
        if isinstance(config_dict, Mapping):     # what `follow_lora_args` asks again
            self._lora_asked = (dict(config_dict), list(metas or ()))
        args = self.lora_server_args()
        if "enable_lora" in args and not args["enable_lora"]:
            return (f"{self.features.label}{self.where} was started without LoRA (its server args "
                    f"say enable_lora={args['enable_lora']!r}), so it answers every adapter load "
                    f"'LoRA is not enabled'; restart it with --enable-lora --max-lora-rank <r> "
                    f"--lora-target-modules ...")
        r = config_dict.get("r") if isinstance(config_dict, Mapping) else None
        limit = args.get("max_lora_rank")
        if isinstance(r, int) and isinstance(limit, int) and not isinstance(limit, bool) and r > limit:
            return (f"its rank r={r} exceeds {self.features.label}{self.where}'s --max-lora-rank "
                    f"{limit} (server args max_lora_rank={limit}: its LoRA memory pool is {limit} "
                    f"wide, so SGLang would answer the load 'incompatible with the current LoRA "
                    f"memory pool configuration'); restart SGLang with --max-lora-rank >= {r}, or "
                    f"train the adapter with r <= {limit}")
        if isinstance(config_dict, Mapping) and args.get("lora_target_modules"):
            return self._target_refusal(config_dict.get("target_modules"), args["lora_target_modules"],
                                        metas)
        return None

    def _target_refusal(self, targets: Any, served: Any, metas: Any = ()) -> str | None:
        """`lora_refusal`'s target modules: SGLang's ``LoRAMemoryPool.can_support`` (0.5.12 and
        0.5.23), asked by ``validate_new_adapter`` at the load, takes an adapter whose normalized
        targets include "all" or lie inside the pool's, which a server launched with
        ``--lora-target-modules`` (reported as ``lora_target_modules``) sizes for exactly those,
        normalized (``LoRAManager.init_lora_shapes``). A server launched with ``all`` (sized for
        what it found in the base model) or without the flag (sized for its ``--lora-paths``)
        says not which: not checked here. An adapter whose targets are "all" passes that check
        whatever its tensors; SGLang's memory pool then loads only the tensors whose name holds one
        of its modules (``get_target_module_name``) and skips the others with a warning (a
        ValueError under ``--lora-strict-loading``): served without them, another model than the
        trainer's. Such tensors (``metas``, ``[(peft name, dtype, shape)]``) are refused too."""
        label = f"{self.features.label}{self.where}"
        version = versions.parse(self.features.version)
        listed = sorted(str(m) for m in served) \
            if isinstance(served, (list, tuple, set, frozenset)) else None
        pool = sglang_targets(listed, version) if listed else None
        if pool is None or "all" in pool:
            return None
        if isinstance(targets, str) and sglang_targets(targets) is None:
            return (f"its target_modules={targets!r} is a string other than 'all' / 'all-linear', "
                    f"which {label} refuses at the load ('Only 'all' or 'all-linear' can be used as "
                    f"the string for target module'); give the adapter a list of module names")
        wanted = sglang_targets(targets, version)
        if wanted is not None and "all" in wanted:
            return self._skipped_refusal(targets, listed, pool, metas, version)
        if wanted is None or wanted <= pool:
            return None
        outside = sorted({str(m) for m in targets}
                         - {str(m) for m in targets if sglang_targets([m], version) <= pool})
        need = sorted(set(listed) | set(outside))
        return (f"its target_modules {outside} lie outside {label}'s --lora-target-modules "
                f"{listed} (server args lora_target_modules; SGLang's LoRA weights "
                f"{sorted(wanted - pool)} are not among {sorted(pool)}), so SGLang would answer the "
                f"load 'incompatible with the current LoRA memory pool configuration'; restart "
                f"SGLang with --lora-target-modules {' '.join(need)} (or all), or train the adapter "
                f"on target_modules within {listed}")

    def _skipped_refusal(self, targets: Any, listed: list, pool: set, metas: Any,
                         version: tuple[int, ...] | None) -> str | None:
        """`_target_refusal` of an adapter on "all": its tensors on modules SGLang's pool has no
        buffers for (their module's name normalized as SGLang stacks it; a tensor whose name
        then holds none of the pool's modules is skipped at the load)."""
        skipped: set[str] = set()
        for meta in metas or ():
            name = str(meta[0])
            head, sep, _ = name.partition(".lora_")
            if not sep:
                continue
            prefix, _, module = head.rpartition(".")
            stacked = next(iter(sglang_targets([module], version)))
            if not any(t in f"{prefix}.{stacked}" for t in pool):
                skipped.add(module)
        if not skipped:
            return None
        label = f"{self.features.label}{self.where}"
        need = sorted(set(listed) | skipped)
        return (f"its target_modules={targets!r} pass {label}'s check, but its tensors on "
                f"{sorted(skipped)} lie outside its --lora-target-modules {listed} (server args "
                f"lora_target_modules): SGLang would load the adapter without them (its memory pool "
                f"skips them with a warning), serving another model than the trainer's; restart "
                f"SGLang with --lora-target-modules {' '.join(need)} (or all), or give the adapter "
                f"target_modules within {listed}")

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       load_format: str | None = None, pinned: bool = False,
                                       added_tokens_config: Any = None) -> dict:
        """Load adapter ``lora_name`` from full tensors (``[(name, tensor)]`` or a dict, peft's
        names) with ``config_dict``; raises `SGLangUpdateError` with the server's message, and
        `SGLangError` before sending anything where the engine cannot take what was given."""
        self._check_open("load_lora_adapter_from_tensors")
        call = f"load_lora_adapter_from_tensors({lora_name!r})"
        if load_format == "flattened_bucket":
            # SGLang reads such payloads as {flattened_tensor, metadata}; this call sends tensors
            raise ValueError("load_format='flattened_bucket' takes pre-serialized bucket payloads; "
                             "SGLangEngine.load_lora_adapter_from_tensors sends named tensors: "
                             "leave load_format None")
        named = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        why = self.lora_refusal(config_dict, [(n, t.dtype, tuple(t.shape)) for n, t in named])
        if why is not None:
            raise SGLangError(f"{call}: {why}; nothing was sent", call="load_lora_adapter_from_tensors")
        if self._local:
            kwargs = {}
            for param, value, given in (("pinned", pinned, bool(pinned)),
                                        ("added_tokens_config", added_tokens_config,
                                         added_tokens_config is not None)):
                if not given:
                    continue
                if not takes_keyword(self._local.engine, "load_lora_adapter_from_tensors", param):
                    raise SGLangError(
                        f"{param}={value!r}: the in-process engine "
                        f"({type(self._local.engine).__name__}, {self.features.label}) has "
                        f"load_lora_adapter_from_tensors(lora_name, tensors, config_dict, "
                        f"load_format) without {param} (sglang.Engine 0.5.12 to 0.5.23; SGLang's "
                        f"HTTP request takes it); leave {param} out or serve SGLang over HTTP",
                        call="load_lora_adapter_from_tensors")
                kwargs[param] = value
            # sglang.Engine serializes ``tensors`` itself and its workers read a {name: tensor} dict
            answer = self._local.call("load_lora_adapter_from_tensors", lora_name=lora_name,
                                      tensors=dict(named), config_dict=dict(config_dict),
                                      load_format=load_format, **kwargs)
            check_answer(call, _with_message(answer), error=SGLangUpdateError)
            return answer if isinstance(answer, dict) else {"success": True}
        feats = self.features
        if feats.lora_tensors_field is None:
            raise SGLangError(f"{feats.label}{self.where}: its /load_lora_adapter_from_tensors was "
                              f"not read (fsdp_sync knows 0.5.12's one payload, serialized_tensors, "
                              f"and 0.5.20 on, serialized_named_tensors per TP rank); nothing was "
                              f"sent: upgrade SGLang", call="load_lora_adapter_from_tensors")
        # one reference per TP rank that opens a payload: with one payload for all ranks (0.5.12)
        # each rank still opens it once, giving one back, so the lease takes tp_size of them
        lease = handles.make_payloads(shared_copy(named), self.tp_size, output_str=True, tagged=False)
        wire = lease.payloads if feats.lora_tensors_per_rank else lease.payloads[0]
        body = {"lora_name": lora_name, "config_dict": dict(config_dict),
                feats.lora_tensors_field: wire}
        if load_format is not None:
            body["load_format"] = load_format
        if pinned:
            body["pinned"] = True
        if added_tokens_config is not None:
            body["added_tokens_config"] = added_tokens_config
        with lease_answered(lease):
            try:
                answer = self._http.json("POST", "/load_lora_adapter_from_tensors", body,
                                         error=SGLangUpdateError)
            except NotFound as e:        # no such route: nothing was opened
                e.error.opened = False
                raise e.error from None
            check_answer(call, _with_message(answer), error=SGLangUpdateError, where=self.where)
        return answer if isinstance(answer, dict) else {"success": True}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Drop adapter ``lora_name``; raises `SGLangUpdateError` with the server's message."""
        self._check_open("unload_lora_adapter")
        call = f"unload_lora_adapter({lora_name!r})"
        if self._local:
            answer = self._local.call("unload_lora_adapter", lora_name=lora_name)
        else:
            try:
                answer = self._http.json("POST", "/unload_lora_adapter", {"lora_name": lora_name},
                                         error=SGLangUpdateError)
            except NotFound as e:
                raise e.error from None
        check_answer(call, _with_message(answer), error=SGLangUpdateError, where=self.where)
        return answer if isinstance(answer, dict) else {"success": True}

    def available_models(self) -> dict:
        """SGLang's ``/v1/models``: ``{"object": "list", "data": [{"id": ...}, ...]}``, the served
        model and each loaded LoRA adapter.

        In process, the same cards built from what that route reads (0.5.12 and 0.5.23 alike):
        ``Engine.tokenizer_manager.lora_registry.get_all_adapters()`` (``{name: LoRARef}``, a copy),
        the registry the Engine's own load / unload calls register into once every TP worker
        loaded an adapter and unregister from before the workers drop it, and the tokenizer
        manager's ``served_model_name``. An engine without that registry is refused by name: an
        empty list would read as "nothing loaded" (`lora_sync.load_adapter` would then load over
        an adapter it holds and fail with SGLang's "already loaded")."""
        self._check_open("available_models")
        if self._local:
            return self._local_models()
        try:
            return self._http.json("GET", "/v1/models", idempotent=True)
        except NotFound as e:
            raise e.error from None

    def _local_models(self) -> dict:
        """`available_models` of an in-process ``sglang.Engine`` (SGLang's ``available_models``
        route in http_server.py, card for card)."""
        engine = self._local.engine
        tm = getattr(engine, "tokenizer_manager", None)
        registry = getattr(tm, "lora_registry", None)
        if not callable(getattr(registry, "get_all_adapters", None)):
            raise SGLangError(
                f"the in-process engine ({type(engine).__name__}, {self.features.label}) has no "
                f"tokenizer_manager.lora_registry.get_all_adapters() (sglang.Engine 0.5.12 to "
                f"0.5.23 has, and /v1/models reads it): its loaded LoRA adapters cannot be listed",
                call="available_models")
        served = getattr(tm, "served_model_name", None)
        context = getattr(getattr(tm, "model_config", None), "context_len", None)
        now = int(time.time())
        cards = [{"id": served, "object": "model", "created": now, "owned_by": "sglang",
                  "root": served, "parent": None,
                  "max_model_len": context if isinstance(context, int) else None}]
        cards += [{"id": ref.lora_name, "object": "model", "created": now, "owned_by": "sglang",
                   "root": ref.lora_path, "parent": served, "max_model_len": None}
                  for ref in registry.get_all_adapters().values()]
        return {"object": "list", "data": cards}

    def lora_checksums(self, lora_name: str) -> tuple[dict[str, str], str]:
        """``({name: digest}, dtype)`` of adapter ``lora_name`` as ``fsdp-sync serve`` holds it
        (names without ``base_model.model.``; `verify.tensor_digest`)."""
        self._check_open("lora_checksums")
        if not self._http:
            raise SGLangError("an in-process SGLang engine cannot hand its LoRA adapter back; set "
                              "verify=off for adapter syncs into it", call="lora_checksums")
        try:
            answer = self._http.json("POST", "/fsdp_sync/lora_checksums", {"lora_name": lora_name},
                                     idempotent=True)
        except NotFound:
            raise SGLangError(f"SGLang{self.where} cannot hand its LoRA adapter back (no "
                              f"/fsdp_sync/lora_checksums: fsdp-sync serve's route); set "
                              f"verify=off for adapter syncs into SGLang", call="lora_checksums") from None
        check_answer("lora_checksums", answer, where=self.where)
        sums = answer.get("checksums") if isinstance(answer, dict) else None
        if not isinstance(sums, dict):
            raise SGLangError(f"/fsdp_sync/lora_checksums{self.where} answered {str(answer)[:200]!r}",
                              call="lora_checksums")
        return {str(k): str(v) for k, v in sums.items()}, str(answer.get("dtype"))
