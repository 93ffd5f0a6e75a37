"""SGLangEngine: fsdp_sync's engine protocol (`fsdp_sync.engines.base.Engine`, SGLang's method
names) over an in-process ``sglang.Engine`` object or a running SGLang HTTP server.

It uses ``begin_weight_update`` / ``end_weight_update`` when
the engine has them (known from the release it reports, `versions`, or detected once: a missing
method, HTTP 404; `session_calls`, with what an abort can and cannot undo), refuses by name what that release cannot take, turns the CUDA allocator's
expandable segments off while SGLang holds GPU memory (`allocator`), raises on every
``success=False`` with SGLang's message, and retries only idempotent HTTP calls (`client`).

Memory release and resume by tag (only tags whose state changes, in SGLang's order) come from
`memory_calls`, generation controls (pause/continue, weight versions, ``fsdp-sync serve``'s
out-of-service switch) from `control`, SGLang's LoRA calls (load from tensors, unload, the loaded list) from
`lora`, and what it refuses before a sync sends anything (a loader or release that would get the
sync wrong) from `refusals`.

Not here: the per-rank payloads (`payloads`, with their lifetime rule), starting SGLang (the caller
launches the engine or server), and any import of sglang at import time: sglang is imported lazily,
only for an in-process engine's ``LocalSerializedTensor`` (load formats other than
``"flattened_bucket"`` given `SerializedPerRank` values); a server gets it under the path of the
release it reports, without sglang here (`handles.wire_class`). HTTP uses only the standard library.
"""


from __future__ import annotations

import base64
import os
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

import torch

from ...weights import handles
from ..base import (RELEASE_ORDER, EngineClosedError,
                    SerializedPerRank, ordered_tags)
from .allocator import ExpandableSegments
from .control import GenerationControl
from .memory_calls import MemoryCalls
from .session_calls import SessionCalls
from .lora import LoRAClient
from .client import (HttpClient, InProcessClient, MissingMethod, NotFound, SGLangError, takes_keyword,
                     SGLangHTTPError, SGLangUpdateError, check_answer, json_or_text,
                     lease_answered)
from .payloads import FLATTENED_BUCKET, flattened_bucket_payloads
from .refusals import Refusals
from .served_config import served_config
from . import versions

_UNASKED = object()   # `SGLangEngine.config` not asked yet

__all__ = ["SGLangEngine"]

def _local_serialized_tensor_cls():
    """SGLang's ``LocalSerializedTensor`` (its unpickler accepts it; it would reject ours)."""
    for module in ("sglang.srt.model_executor.model_runner_components.weight_updater",
                   "sglang.srt.model_executor.model_runner"):
        try:
            mod = __import__(module, fromlist=["LocalSerializedTensor"])
        except ImportError:
            continue
        cls = getattr(mod, "LocalSerializedTensor", None)
        if cls is not None:
            return cls
    raise SGLangError("SerializedPerRank values need sglang's LocalSerializedTensor, but sglang "
                      "cannot be imported here; use load_format='flattened_bucket' instead",
                      call="update_weights_from_tensor")


# --------------------------------------------------------------------------- the adapter

class SGLangEngine(MemoryCalls, SessionCalls, GenerationControl, LoRAClient, Refusals):
    """fsdp_sync's engine protocol over SGLang: an in-process ``sglang.Engine`` or an HTTP server.

    ``SGLangEngine(engine)`` wraps an ``sglang.Engine`` (any object with its methods);
    ``SGLangEngine("http://host:port")`` or ``SGLangEngine(base_url=...)`` talks to a server.
    ``tp_size`` is asked of the engine (``get_server_info``) at construction when not given.
    HTTP options: ``api_key`` (sent as a bearer token), ``timeout_s`` per request,
    ``max_retries`` and ``retry_backoff_s`` for idempotent calls (``get_weights_by_name``,
    ``flush_cache``, server info, health), ``proxies`` (none by default).

    ``released_tags``: the memory tags SGLang had already released when this wrapper was made
    (default none: a launched engine holds everything). SGLang's scheduler dies on a resume of a
    tag it holds (a ``set.remove`` of it), so `resume_memory_occupation` sends only the tags
    released since, `release_memory_occupation` only those held, and neither calls SGLang when
    nothing is left to do (`memory_skipped` records those tags). ``track_memory=False``: another
    client also releases and resumes this SGLang (verl's replicas do), so no state is kept here
    and the tags go to SGLang as given (None: SGLang's all), as that client's own calls would.

    ``rank_bucket_loader=True``: the server was started with ``--custom-weight-loader
    fsdp_sync.engines.sglang.loader.load_rank_buckets``, so it takes per-rank buckets
    (`load_rank_bucket`, `SyncConfig.layout` "engine"/"auto"). Off (default), "auto" sends full
    tensors. ``update_weights_from_distributed`` always broadcasts full tensors to every rank.

    Only infer-TP rank 0 holds an `SGLangEngine`; every call blocks until SGLang answered.
    """

    accepts_tagged_payloads = False
    accepts_distributed_rank_buckets = False
    """SGLang's ``update_weights_from_distributed`` broadcasts the same full tensors to every TP
    rank and has no per-rank load_format: method distributed with ``layout="engine"`` is refused
    for it before anything is sent, "auto" sends it full tensors."""
    rank_bucket_payload = "tensor"   # per-rank payloads open to the flat buffer (the loader's input)

    def __init__(self, engine: Any = None, *, base_url: str | None = None,
                 tp_size: int | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 3, retry_backoff_s: float = 0.5,
                 retry_backoff_max_s: float = 8.0, proxies: dict | None = None,
                 manage_expandable_segments: bool = True, rank_bucket_loader: bool = False,
                 released_tags: Sequence[str] = (), track_memory: bool = True) -> None:
        if isinstance(engine, str):
            engine, base_url = None, engine
        if (engine is None) == (base_url is None):
            raise ValueError("give exactly one of engine (an sglang.Engine) or base_url "
                             "(an SGLang server)")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._http: HttpClient | None = None
        self._local: InProcessClient | None = None
        if base_url is not None:
            self._http = HttpClient(base_url, api_key=api_key, timeout_s=timeout_s,
                               max_retries=max_retries, backoff_s=retry_backoff_s,
                               backoff_max_s=retry_backoff_max_s, proxies=proxies)
        else:
            self._local = InProcessClient(engine)
        self.session_api: bool | None = None   # has begin/end_weight_update; None = not yet known
        # per-rank buckets need fsdp_sync's loader inside SGLang; SGLang cannot tell us it is
        # there, so the caller says so (`SyncConfig.layout` "auto" reads this)
        self.accepts_rank_buckets = bool(rank_bucket_loader)
        self.allocator = ExpandableSegments(manage_expandable_segments)
        # what SGLang holds: everything once launched, less what was released before this wrapper
        if released_tags:
            if not track_memory:
                raise ValueError("released_tags is SGLang's state at construction, kept by this "
                                 "wrapper: it needs track_memory=True")
            self.allocator.held -= set(ordered_tags(list(released_tags), RELEASE_ORDER))
        self.track_memory = bool(track_memory)
        self.memory_skipped: list[tuple[str, list[str]]] = []   # (call, tags SGLang was already in)
        self.closed = False
        self._fsdp_sync_route: bool | None = None   # fsdp-sync serve's checksum route, asked once
        self._config: Any = _UNASKED
        self._version: Any = _UNASKED     # the release SGLang reports (`sglang_version`)
        self._quant: Any = _UNASKED       # its --quantization (`quantization`)
        self._info: Any = None            # the first server info answer (launch arguments)
        if tp_size is not None and tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        # asked now, not on first use: a protocol isinstance check reads the attribute
        self.tp_size: int = int(tp_size) if tp_size is not None else self._ask_tp_size()

    # ---------------------------------------------------------------- basics

    @property
    def reads_may_outlast_answer(self) -> bool:
        """True at TP > 1: SGLang's TP ranks queue their copies out of a call's payloads, meet at a
        CPU barrier, and each frees the payloads (torch then waits for its copies) only after it;
        rank 0 answers then, possibly before another rank's copies ran. The answer to the next call
        shows every rank done with this one, so a trainer reuses a buffer only after that."""
        return self.tp_size > 1

    @property
    def is_http(self) -> bool:
        return self._http is not None

    @property
    def where(self) -> str:
        return (self._http or self._local).where

    @property
    def config(self) -> Any:
        """The served model's config where the server reports it (`served_config`: ``fsdp-sync
        serve``, or SGLang started from a local directory), else None; asked once."""
        if self._config is _UNASKED:
            info = None
            if self._http is not None:
                try:
                    info = self._http.json("GET", "/get_model_info", idempotent=True)
                except NotFound:          # a server without the route: not checked
                    info = None
            else:     # sglang.Engine: its tokenizer manager holds the ModelConfig it loaded
                tm = getattr(self._local.engine, "tokenizer_manager", None)
                hf = getattr(getattr(tm, "model_config", None), "hf_config", None)
                info = {"hf_config": hf.to_dict()} if hasattr(hf, "to_dict") else None
            self._config = served_config(info)
        return self._config

    @property
    def sglang_version(self) -> str | None:
        """SGLang's release (``get_server_info``'s ``version``), asked once; None if unsaid."""
        if self._version is _UNASKED:
            try:
                self.server_info()            # records the version
            except (SGLangError, NotFound):
                self._version = None
        return self._version

    @property
    def quantization(self) -> str:
        """SGLang's ``--quantization`` where it was launched with one (e.g. ``"fp8"``), which
        `config_check.check_engine` holds against `SyncConfig.quantization` before the first sync;
        else ``"unknown"``: SGLang reports None also for a checkpoint that carries its own
        ``quantization_config``, so None says nothing. Asked once (the launch arguments)."""
        if self._quant is _UNASKED:
            try:
                info = self._info if isinstance(self._info, dict) else self.server_info()
            except (SGLangError, NotFound, MissingMethod):
                info = None
            q = info.get("quantization") if isinstance(info, dict) else None
            self._quant = q if isinstance(q, str) and q and q != "unknown" else "unknown"
        return self._quant

    @property
    def features(self) -> versions.SGLangFeatures:
        return versions.features(self.sglang_version)

    @property
    def takes_weight_version(self) -> bool:
        """Whether `end_weight_update` can name the committed weights: over HTTP always (with
        ``/update_weight_version`` after it where the server does not take it in the body); in
        process only an engine with ``end_weight_update(weight_version=)`` or
        ``update_weight_version``. The fleet commits, and the disk method loads, without a version
        where it cannot."""
        if self._local is None:
            return True
        return (takes_keyword(self._local.engine, "end_weight_update", "weight_version")
                or self._local.has("update_weight_version"))

    @property
    def http_attempts(self) -> Counter:
        """HTTP requests sent per path, retries included (empty in process)."""
        return self._http.attempts if self._http else Counter()

    def __repr__(self) -> str:
        target = self._http.base_url if self._http else type(self._local.engine).__name__
        return f"SGLangEngine({target}, tp_size={self.tp_size})"

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise EngineClosedError(f"{call} on a shut down SGLangEngine{self.where}")

    def _ask_tp_size(self) -> int:
        tp = self._local.tp_size() if self._local else self.server_info().get("tp_size")
        if self._local and self._local.server_info is not None:
            self._version = versions.reported(self._local.server_info)
            self._info = self._local.server_info
        if not tp:
            raise SGLangError(f"cannot tell SGLang's tp_size{self.where}; pass tp_size=",
                              call="get_server_info")
        return int(tp)

    def server_info(self, *, retries: int | None = None) -> dict:
        """SGLang's server info (``get_server_info``): launch arguments and internal states.
        ``retries``: over HTTP, instead of ``max_retries`` (0: one attempt)."""
        self._check_open("server_info")
        if self._http:
            # /server_info first: SGLang has it since before `versions.OLDEST` (0.5.12), and 0.5.23
            # logs a deprecation warning at each /get_server_info, which a sync asks every time
            # (its TP size and release, `session_calls.check_tp_size`); the old name for a server
            # without the new one
            try:
                info = self._http.json("GET", "/server_info", idempotent=True, retries=retries)
            except NotFound:
                try:
                    info = self._http.json("GET", "/get_server_info", idempotent=True, retries=retries)
                except NotFound as e:
                    raise e.error from None
        else:
            try:
                info = self._local.call("get_server_info")
            except MissingMethod:
                raise SGLangError("this engine has no get_server_info",
                                  call="get_server_info") from None
        if not isinstance(info, dict):
            raise SGLangError(f"get_server_info{self.where} answered {info!r}, not a dict",
                              call="get_server_info")
        if self._version is _UNASKED:
            self._version = versions.reported(info)
        if self._info is None:
            self._info = info
        self.note_lora_args(info)
        return info

    def health(self) -> bool:
        """True when the server answers ``/health`` (HTTP); an in-process engine is always up."""
        if self._local:
            return not self.closed
        try:
            self._http.request("GET", "/health", idempotent=True)
            return True
        except (SGLangError, NotFound):
            return False

    # ---------------------------------------------------------------- weights

    def update_weights_from_tensor(self, named_tensors: list, load_format: str | None = None,
                                   flush_cache: bool = True) -> None:
        """Load weights. ``"flattened_bucket"``: ``named_tensors`` are per-rank payloads (see
        `flattened_bucket_payloads`; bytes are base64-encoded for HTTP). Otherwise
        ``[(name, tensor or SerializedPerRank), ...]`` as SGLang takes them. Raises
        `SGLangUpdateError` with SGLang's message on ``success=False``."""
        self._check_open("update_weights_from_tensor")
        call = f"update_weights_from_tensor(load_format={load_format!r})"
        if load_format == FLATTENED_BUCKET:
            payloads = list(named_tensors)
            if len(payloads) != self.tp_size:
                raise ValueError(f"expected {self.tp_size} flattened-bucket payloads (one per TP "
                                 f"rank), got {len(payloads)}")
            bad = [i for i, p in enumerate(payloads) if not isinstance(p, (bytes, bytearray, str))]
            if bad:
                raise TypeError(f"flattened-bucket payloads are bytes or base64 text; elements "
                                f"{bad} are {type(payloads[bad[0]]).__name__}")
            if self._http:
                wire = [p if isinstance(p, str) else base64.b64encode(p).decode("ascii")
                        for p in payloads]
                self._http_update(call, wire, load_format, flush_cache)
            else:
                self._local_update(call, payloads, load_format, flush_cache)
            return
        named = [(n, self._to_sglang(v)) for n, v in named_tensors]
        if self._local:
            self._local_update(call, named, load_format, flush_cache)
            return
        # over HTTP SGLang takes one serialized copy of the whole list per TP rank
        lease = handles.make_payloads(named, self.tp_size, output_str=True, tagged=False)
        with lease_answered(lease):
            self._http_update(call, lease.payloads, load_format, flush_cache)

    def _to_sglang(self, value: Any) -> Any:
        """`SerializedPerRank` as SGLang's ``LocalSerializedTensor``: in process the installed
        class; for a server, the path of the release it reports (`versions`), so a trainer with
        another release, or none, sends what the server's unpickler resolves."""
        if not isinstance(value, SerializedPerRank):
            return value
        if self._local:
            return _local_serialized_tensor_cls()(values=list(value.values))
        module = self.features.local_serialized_tensor_module
        if module is None:
            raise SGLangError(f"{self.features.label}{self.where}: where it keeps "
                              f"LocalSerializedTensor was not read (0.5.12: model_runner; 0.5.20 on: "
                              f"model_runner_components.weight_updater); nothing was sent: use "
                              f"load_format='flattened_bucket' or upgrade SGLang",
                              call="update_weights_from_tensor")
        return handles.wire_class(module, "LocalSerializedTensor")(values=list(value.values))

    def load_rank_bucket(self, bucket: Any, payloads: list, *, flush_cache: bool = True) -> None:
        """One per-rank bucket through fsdp_sync's custom weight loader: ONE named tensor whose
        name carries the bucket's entries and whose value is TP rank i's payload for rank i."""
        from .loader import LOADER, bucket_name

        if not self.accepts_rank_buckets:
            raise SGLangError("per-rank buckets need a server started with --custom-weight-loader "
                              f"{LOADER}; construct SGLangEngine(..., rank_bucket_loader=True) "
                              "for one, or use SyncConfig(layout='full')",
                              call="update_weights_from_tensor")
        if len(payloads) != self.tp_size:
            raise ValueError(f"expected {self.tp_size} per-rank payloads (one per TP rank), got "
                             f"{len(payloads)}")
        self.update_weights_from_tensor([(bucket_name(bucket), SerializedPerRank(values=list(payloads)))],
                                        load_format=LOADER, flush_cache=flush_cache)

    def _local_update(self, call: str, named: list, load_format: str | None,
                      flush_cache: bool) -> None:
        answer = self._local.call("update_weights_from_tensor", named_tensors=named,
                                  load_format=load_format, flush_cache=flush_cache)
        check_answer(call, answer, error=SGLangUpdateError)

    def _http_update(self, call: str, payloads: list, load_format: str | None,
                     flush_cache: bool) -> None:
        body = {"serialized_named_tensors": payloads, "load_format": load_format,
                "flush_cache": flush_cache}
        try:
            answer = self._http.json("POST", "/update_weights_from_tensor", body,
                                     error=SGLangUpdateError)
        except NotFound as e:
            raise e.error from None
        check_answer(call, answer, error=SGLangUpdateError, where=self.where, require_success=True)

    def disk_option_refusal(self, *, flush_cache: bool = True,
                            abort_all_requests: bool = False) -> str | None:
        """Why `update_weights_from_disk` cannot do as these options say, or None. A server takes
        them all (SGLang's ``UpdateWeightFromDiskReqInput``, 0.5.12 and 0.5.23); an in-process
        ``sglang.Engine`` (0.5.12 to 0.5.23) takes only ``model_path`` and ``load_format``: it
        always flushes the cache and never aborts the requests in flight."""
        if self._http:
            return None
        asked = {"flush_cache": bool(flush_cache) is not True,
                 "abort_all_requests": bool(abort_all_requests) is not False}
        missing = [k for k, changed in asked.items()
                   if changed and not takes_keyword(self._local.engine, "update_weights_from_disk", k)]
        if not missing:
            return None
        return (f"the in-process {type(self._local.engine).__name__}.update_weights_from_disk takes "
                f"no {' nor '.join(missing)} (sglang.Engine's takes only model_path and load_format: "
                f"it always flushes the cache and never aborts the requests in flight)")

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, *,
                                 flush_cache: bool = True, abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> None:
        """SGLang reloads the tensors of a checkpoint directory (``update_weights_from_disk``).

        ``model_path`` must be a path the SGLang process can read (on its machine); no weight-update
        session is needed. Over HTTP the body is SGLang's ``UpdateWeightFromDiskReqInput``
        (``model_path``, ``load_format``, ``flush_cache``, ``abort_all_requests``, and
        ``weight_version`` when given). In process, an option the engine's method does not take
        (``sglang.Engine``'s takes only ``model_path`` and ``load_format``) is refused before
        loading when it asks for more than that method does (`disk_option_refusal`), and
        ``weight_version`` is set after the load with its ``update_weight_version`` (refused where
        it has none: `takes_weight_version`), never dropped without a word. Raises
        `SGLangUpdateError` with SGLang's message on ``success=False``. SGLang 0.5.23 loads
        in place: after a failure past its pre-checks its weights may be partly updated, so hand it
        only complete, published directories (`fsdp_sync.transport.disk` does)."""
        self._check_open("update_weights_from_disk")
        path = os.fspath(model_path)
        call = f"update_weights_from_disk({path!r})"
        if self._http:
            body: dict[str, Any] = {"model_path": path, "load_format": load_format,
                                    "flush_cache": bool(flush_cache),
                                    "abort_all_requests": bool(abort_all_requests)}
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            try:
                answer = self._http.json("POST", "/update_weights_from_disk", body,
                                         error=SGLangUpdateError)
            except NotFound as e:
                raise e.error from None
            except SGLangUpdateError as e:
                # SGLang answers a refusal with HTTP 400 and {"success": false, "message": ...}
                msg = json_or_text(e.body or "")
                if isinstance(msg, dict) and "message" in msg:
                    raise SGLangUpdateError(f"SGLang refused {call}{self.where}: {msg['message']}",
                                            call=call, status=e.status, body=e.body) from e
                raise
            check_answer(call, answer, error=SGLangUpdateError, where=self.where, require_success=True)
            return
        engine, kw = self._local.engine, {}
        refusal = self.disk_option_refusal(flush_cache=flush_cache, abort_all_requests=abort_all_requests)
        if refusal is None and weight_version is not None:
            if takes_keyword(engine, "update_weights_from_disk", "weight_version"):
                kw["weight_version"] = str(weight_version)
            elif not self._local.has("update_weight_version"):
                refusal = (f"the in-process {type(engine).__name__} can take no weight_version (no "
                           f"update_weights_from_disk(weight_version=) nor update_weight_version)")
        if refusal is not None:
            raise SGLangError(f"{call}: {refusal}; nothing was loaded", call=call)
        for k, v, default in (("flush_cache", bool(flush_cache), True),
                              ("abort_all_requests", bool(abort_all_requests), False)):
            if v != default:            # taken (else refused above); sglang.Engine's own does the default
                kw[k] = v
        try:
            answer = self._local.call("update_weights_from_disk", model_path=path,
                                      load_format=load_format, **kw)
        except MissingMethod:
            raise SGLangError("this engine has no update_weights_from_disk", call=call) from None
        check_answer(call, answer, error=SGLangUpdateError)
        if weight_version is not None and "weight_version" not in kw:
            self.update_weight_version(str(weight_version), abort_all_requests=False)

    def update_weights_from_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                                   | Mapping[str, torch.Tensor], flush_cache: bool = True) -> None:
        """Flatten ``named_tensors`` into one bucket, load it, and free the buffer when SGLang
        answered. Call between `begin_weight_update` and `end_weight_update`."""
        self._check_open("update_weights_from_bucket")
        with flattened_bucket_payloads(named_tensors, self.tp_size,
                                       output_str=self.is_http) as payloads:
            self.update_weights_from_tensor(payloads, load_format=FLATTENED_BUCKET,
                                            flush_cache=flush_cache)

    # ---------------------------------------------------------------- update_weights_from_distributed

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        """SGLang joins its TP workers to the weight-update group (ranks ``rank_offset + tp_rank``);
        blocks until every rank, the trainer (rank 0) included, has joined."""
        body = {"master_address": master_address, "master_port": int(master_port),
                "rank_offset": int(rank_offset), "world_size": int(world_size),
                "group_name": group_name, "backend": backend}
        self._distributed_call("init_weights_update_group", body)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list,
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        load_format: str | None = None) -> None:
        """SGLang receives the broadcast of ``names`` (dtypes as torch attribute names, e.g.
        ``"bfloat16"``) from rank 0 of ``group_name`` and loads it. ``load_format``: None (one
        broadcast per tensor) or ``"flattened_bucket"`` (one tightly packed broadcast). Call
        between `begin_weight_update` and `end_weight_update`; send the broadcast while this runs."""
        bad = [d for d in dtypes if not isinstance(d, str) or d.startswith("torch.")]
        if bad:
            raise ValueError(f"dtypes travel as torch attribute names such as 'bfloat16' (SGLang "
                             f"resolves them with getattr(torch, name)), got {bad[:3]}")
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": bool(flush_cache), "load_format": load_format}
        self._distributed_call("update_weights_from_distributed", body, error=SGLangUpdateError)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """SGLang leaves the group; an unknown name is refused."""
        self._distributed_call("destroy_weights_update_group", {"group_name": group_name})

    def _distributed_call(self, name: str, body: dict, *, error=SGLangError) -> None:
        self._check_open(name)
        try:
            if self._http:
                answer = self._http.json("POST", f"/{name}", body, error=error)
            else:
                answer = self._local.call(name, **body)
        except MissingMethod:
            raise SGLangError(f"this SGLang engine has no {name} (needs a version with "
                              f"update_weights_from_distributed)", call=name) from None
        except NotFound as e:
            raise e.error from None
        check_answer(name, answer, error=error, where=self.where,
                     require_success=self.is_http and error is SGLangUpdateError)

    def get_weights_by_name(self, name: str, truncate_size: int | None = None) -> torch.Tensor:
        """SGLang's copy of a parameter, as float32 (SGLang converts), its first ``truncate_size``
        rows (None: all). With TP > 1 SGLang returns rank 0's shard for most parameters."""
        self._check_open("get_weights_by_name")
        size = 2 ** 31 - 1 if truncate_size is None else int(truncate_size)
        detail = ""
        if self._http:
            try:
                value = self._http.json("POST", "/get_weights_by_name",
                                        {"name": name, "truncate_size": size}, idempotent=True)
            except NotFound as e:
                raise e.error from None
            except SGLangHTTPError as e:
                if e.status != 400:     # SGLang answers 400 when it has no such parameter
                    raise
                value, detail = None, f" ({e})"
        else:
            value = self._local.call("get_weights_by_name", name=name, truncate_size=size)
        if value is None or (isinstance(value, dict) and "error" in value):
            detail = detail or (f": {value['error']}" if isinstance(value, dict) else "")
            raise SGLangError(f"SGLang has no parameter {name!r} (or cannot read it)"
                              f"{self.where}{detail}", call="get_weights_by_name")
        return torch.tensor(value, dtype=torch.float32)

    def flush_cache(self) -> None:
        """Drop SGLang's prefix cache; raises if SGLang refused (requests still running)."""
        self._check_open("flush_cache")
        if self._http:
            try:
                self._http.request("POST", "/flush_cache", idempotent=True)
            except NotFound as e:
                raise e.error from None
            return
        check_answer("flush_cache", self._local.call("flush_cache"))

    # ---------------------------------------------------------------- generation

    def generate(self, input_ids: list[list[int]], max_new_tokens: int = 16,
                 temperature: float = 0.0) -> list[list[int]]:
        """New token ids per prompt (``output_ids`` of each of SGLang's answers)."""
        self._check_open("generate")
        prompts = [list(map(int, p)) for p in input_ids]
        params = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature)}
        if self._http:
            try:
                out = self._http.json("POST", "/generate",
                                      {"input_ids": prompts, "sampling_params": params})
            except NotFound as e:
                raise e.error from None
        else:
            out = self._local.call("generate", input_ids=prompts, sampling_params=params)
        outs = out if isinstance(out, list) else [out]
        if len(outs) != len(prompts) or not all(isinstance(o, dict) and "output_ids" in o
                                                for o in outs):
            raise SGLangError(f"generate{self.where} answered {str(out)[:300]!r}; expected "
                              f"{len(prompts)} results with output_ids", call="generate")
        return [list(o["output_ids"]) for o in outs]

    # ---------------------------------------------------------------- protocol extras

    def weights_checksum(self) -> str:
        raise SGLangError("SGLang has no whole-model checksum comparable to fsdp_sync's; compare "
                          "parameters with get_weights_by_name", call="weights_checksum")

    def weights_checker(self, action: str = "checksum", *,
                        skip_tensor_list: Sequence[str] | None = None) -> dict:
        """SGLang's ``POST /weights_checker`` (HTTP only; ``action`` snapshot / reset_tensors /
        compare / checksum; ``skip_tensor_list`` from 0.5.21, refused before sending to an older
        release, which drops it: `versions`). The checksum answer is ``{success, message, ranks:
        [{checksums: {sglang_name: hash}, per_gpu_checksum, parallelism_info}, ...],
        per_engine_checksum}`` (0.5.12: no per_*_checksum), one entry per TP rank, over SGLang's
        own (fused, sharded) parameters. No route: `SGLangError` with ``status=404``."""
        self._check_open("weights_checker")
        if not self._http:
            raise SGLangError("an in-process sglang.Engine has no weights checker call (SGLang "
                              "0.5.12 to 0.5.23 serve it only over HTTP, POST /weights_checker)",
                              call="weights_checker")
        body: dict[str, Any] = {"action": str(action)}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = [str(x) for x in skip_tensor_list]
            refusal = self.features.refuse_checker_fields(set(body))
            if refusal:
                raise SGLangError(f"{refusal}{self.where}", call="weights_checker")
        try:
            answer = self._http.json("POST", "/weights_checker", body)
        except NotFound as e:
            raise SGLangError(f"this SGLang server{self.where} has no /weights_checker (SGLang "
                              f"0.5.12 and later serve it; fsdp-sync serve answers "
                              f"/fsdp_sync/tensor_checksums instead): {e.error}",
                              call="weights_checker", status=404) from None
        check_answer("weights_checker", answer, where=self.where)
        if not isinstance(answer, dict):
            raise SGLangError(f"weights_checker{self.where} answered {str(answer)[:200]!r}, not "
                              f"an object", call="weights_checker")
        return answer

    def serves_tensor_checksums(self) -> bool:
        """Whether the server is ``fsdp-sync serve`` (it answers ``/fsdp_sync/tensor_checksums``:
        full-tensor digests), as opposed to SGLang (``/weights_checker``: per-TP-rank hashes);
        asked once. False for an in-process engine."""
        if not self._http:
            return False
        if self._fsdp_sync_route is None:
            try:
                answer = self._http.json("POST", "/fsdp_sync/tensor_checksums", {"names": []},
                                         idempotent=True)
            except NotFound:
                self._fsdp_sync_route = False
            else:
                check_answer("tensor_checksums", answer, where=self.where)
                self._fsdp_sync_route = True
        return self._fsdp_sync_route

    def tensor_checksums(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """``{name: digest of the full tensor}`` (`verify.tensor_digest`), which ``fsdp-sync serve``
        answers (``POST /fsdp_sync/tensor_checksums``). SGLang cannot: it hashes its own
        parameters (see `weight_checksums`), so against SGLang this raises, saying so."""
        self._check_open("tensor_checksums")
        if self.serves_tensor_checksums():
            answer = self._http.json("POST", "/fsdp_sync/tensor_checksums",
                                     {"names": None if names is None else list(names)},
                                     idempotent=True)
            check_answer("tensor_checksums", answer, where=self.where)
            sums = answer.get("checksums") if isinstance(answer, dict) else None
            if not isinstance(sums, dict):
                raise SGLangError(f"/fsdp_sync/tensor_checksums{self.where} answered "
                                  f"{str(answer)[:200]!r}", call="tensor_checksums")
            return {str(k): str(v) for k, v in sums.items()}
        raise SGLangError(f"SGLang{self.where} hashes each TP rank's own parameters (fused, "
                          f"sharded), not full Hugging Face tensors: compare with weight_checksums "
                          f"(SyncConfig.verify does)", call="tensor_checksums")

    def weight_checksums(self) -> dict | None:
        """What `SyncConfig.verify` compares against SGLang: ``{"answer": the /weights_checker
        checksum answer, "algorithm": "cpu" | "gpu" (the server's --device), "ep_size": its
        --ep-size}``, recomputed on the trainer by `checksums.Checker`. None when the server is
        ``fsdp-sync serve`` (its `tensor_checksums` is the check). Raises where SGLang cannot
        answer (an in-process engine, a server without the route)."""
        self._check_open("weight_checksums")
        if self.serves_tensor_checksums():
            return None
        answer = self.weights_checker("checksum")
        info = self.server_info()
        device = str(info.get("device") or "cuda")
        return {"answer": answer, "algorithm": "cpu" if device == "cpu" else "gpu",
                "ep_size": int(info.get("ep_size") or 1)}

    def forward_logits(self, input_ids: Any) -> Any:
        raise SGLangError("SGLang does not return logits; use generate (or its logprobs)",
                          call="forward_logits")

    def memory_stats(self) -> dict:
        """What this adapter knows (tags SGLang holds, allocator decisions) and, if SGLang reports
        it, each scheduler's ``memory_usage`` (GB of weights, KV cache, CUDA graphs)."""
        self._check_open("memory_stats")
        stats: dict[str, Any] = {"engine": "sglang", "held_tags": sorted(self.allocator.held),
                                 "allocator_events": list(self.allocator.events)}
        try:
            states = self.server_info().get("internal_states") or []
            stats["workers"] = [s.get("memory_usage") for s in states if isinstance(s, dict)]
        except (SGLangError, MissingMethod, NotFound):
            stats["workers"] = []
        return stats

    def shutdown(self) -> None:
        """Shut an in-process engine down (a server is left running: its owner stops it) and
        restore the allocator setting. Later calls raise `EngineClosedError`."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._local and self._local.has("shutdown"):
                self._local.engine.shutdown()
            if self._http is not None:
                self._http.close()          # its kept-alive connections
        finally:
            self.allocator.restore("shutdown")
