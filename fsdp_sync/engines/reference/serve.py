"""The reference engine behind SGLang's HTTP endpoints, safe by default (run by `fsdp-sync serve`).

`EngineServer` puts an engine (normally a `ReferenceEngine`) behind the routes and JSON bodies of
an SGLang 0.5.23 server, so that `fsdp_sync.engines.sglang.SGLangEngine(base_url=...)` and verl's
HTTP client drive it unchanged and a weight sync over HTTP can be run end to end, with real
weights, on a CPU machine:

    GET  /health  /health_generate  /ready  /get_model_info  /get_server_info (/server_info)
    GET  /v1/models                    (SGLang's OpenAI-style model list: the served model)
    POST /generate                     {input_ids | text, sampling_params}  (PUT too, as SGLang)
    POST /abort_request                {rid | abort_all}  (200, empty body, as SGLang)
    POST /update_weights_from_tensor  /begin_weight_update  /end_weight_update
    POST /init_weights_update_group  /update_weights_from_distributed  /destroy_weights_update_group
    POST /update_weights_from_disk  /release_memory_occupation  /resume_memory_occupation
                                       (`serve_updates`: one at a time, bounded waits)
    POST /flush_cache [?timeout=S]     (`serve_cache`: only while no request runs or waits, as SGLang)
    POST /get_weights_by_name          {name, truncate_size}
    (these four also on GET, as SGLang takes them)
    POST /fsdp_sync/tensor_checksums   {names}  (fsdp_sync's own: what SyncConfig.verify reads)
    POST /pause_generation  /continue_generation  /update_weight_version  /fsdp_sync/set_serving,
    GET  /get_weight_version           (`serve_control`: pause modes, versions, out of service)
    POST /load_lora_adapter_from_tensors  /load_lora_adapter  /unload_lora_adapter,
         /fsdp_sync/lora_checksums (`serve_lora`: the engine's LoRA adapters; ``/generate`` takes
         ``lora_path``, ``/v1/models`` lists them)

The update routes take SGLang's ``weight_version`` (the engine takes it with the commit), and every
``/generate`` answer's ``meta_info`` (each streamed chunk too) carries SGLang's ``weight_version``
and ``weight_versions`` (spans over the output tokens) from the engine's results. Concurrent
``/generate`` requests are batched by the engine (`scheduler`), each joining the running batch at
the next step.

Weight updates answer ``{"success": bool, "message": str}`` (HTTP 200, or 400 on a refusal), as
SGLang does. An engine without a method (the distributed and disk ones on an older engine) answers
404 on its route, which `SGLangEngine` reads as "an older server".

Statuses say whose fault an error is (`http_fields.error_status`), so clients and routers retry
or mark a server down on 5xx only: 4xx for the client's mistakes (400 a bad field or a call that
does not fit, 401, 403, 404, 405 a method a route does not take, 413, 501 a transfer coding other than chunked), 503
when the engine cannot serve now (a dead worker, shut down at SIGTERM, weights or KV cache
released, out of service, busy past ``update_wait_s``, too many requests), 500 for anything else.
A malformed body or field is 400 as in SGLang 0.5.23 (its validation handler turns FastAPI's 422
into 400), whose body is ``{"object": "error", "message", "type", "code"}``: both carry ``message``.
Every error answer made here carries ``"retryable"`` (true: the same request may succeed later or
on another server), a streamed ``/generate`` error chunk too; every answer is JSON, the standard
library's own refusals (an unknown method, a malformed request line) included; but not
``/flush_cache``'s, SGLang's bare text (`serve_cache`).

Safe by default (none of this is SGLang's behaviour, which binds where it is told and takes any
path): it binds 127.0.0.1 unless given another host; with an API key every request but
``/health`` must carry ``Authorization: Bearer KEY`` (401 otherwise, compared in constant time);
``update_weights_from_disk`` takes only directories inside ``allowed_disk_dirs`` after resolving
symlinks (none allowed: every disk update is refused), and only checkpoints that hold every tensor
the engine serves; request bodies are bounded (413 past ``max_body_bytes``, never read; a request
with neither ``Content-Length`` nor chunked encoding has an empty body, as HTTP/1.1 says); a
request line or body that stalls times out; malformed JSON and wrong field types get 400 naming
the field; at most ``max_concurrent`` generation requests (``/generate``, ``/health_generate``)
are served at once (503 beyond; the health, control and update routes are never refused for
them, and a slot is taken only once the body is read, so stalled uploads hold none); and weight
updates run one at a time: one waits up to ``update_wait_s`` to start, then gets 503 and is never
applied, so two updates never interleave. ``begin_weight_update`` … ``end_weight_update`` is the
engine's one session, as in SGLang: a second ``begin`` while one is open is refused.

HTTP is the standard library's `ThreadingHTTPServer`: the routes are a dozen JSON calls, and a web
framework (fastapi + uvicorn) would be a new dependency of the core package for no gain here.
Connections stay open between requests (HTTP/1.1, ``TCP_NODELAY``: a sync's calls share one);
``close()`` ends the idle ones, and a request read after it is refused (503), not served.

Left as they are, no client reading them (verl's adapters, sglang-router, `SGLangEngine`, the
verl replica): ``/release_memory_occupation`` and ``/resume_memory_occupation`` answer
``{"success": true, "message"}`` where SGLang 0.5.23 answers ``null``; a refusal's body is
``{"success": false, "message", "retryable"}`` where SGLang's is ``{"error": {"message"}}`` or its
validation ``{"object": "error", "message", ...}`` (same statuses); health refusals carry JSON where
SGLang's are empty; ``GET /v1/models/{id}`` is not served (404).

Not here: the command and its flags (`fsdp_sync.cli.serve`), the engine (`engines.reference`), the
client (`engines.sglang`), the field checks and error statuses (`http_fields`), the update routes
(`serve_updates`), the cache flush (`serve_cache`), the control routes and the health answers out of service or paused
(`serve_control`), TLS (put a proxy in front, or keep the loopback default), tokenization
(``text`` prompts are refused: send ``input_ids``).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections import Counter
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence

from .generate_request import (ClientWatch, GenerateRefused, answer_item, generation_config_eos,
                               parse_generate, sglang_eos)
from .http_fields import (Refused, body_field, check_disk_path, error_status, error_text,
                          read_chunked, tags_field, too_big)
from .rollout import sglang_context_length
from .serve_cache import CacheRoutes
from .serve_control import ControlRoutes
from .serve_lora import LoRARoutes
from .serve_updates import UpdateRoutes

__all__ = ["EngineServer", "check_disk_path", "DEFAULT_MAX_BODY",    # check_disk_path: `http_fields`
           "UNKNOWN_PATH"]

log = logging.getLogger("fsdp_sync.engines.reference.serve")

DEFAULT_MAX_BODY = 32 << 20
UNKNOWN_PATH = "<unknown>"
"""The key `EngineServer.hits` counts the requests for a path no route serves under."""


# --------------------------------------------------------------------------- the server

class EngineServer(ControlRoutes, UpdateRoutes, LoRARoutes, CacheRoutes):
    """SGLang's HTTP routes over ``engine`` (see the module docstring). ``start()`` serves in a
    thread; ``close()`` stops serving (the engine is its owner's to shut down)."""

    UPDATES = ("/update_weights_from_tensor", "/update_weights_from_distributed",
               "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update",
               "/release_memory_occupation", "/resume_memory_occupation")

    GET_OR_POST = ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
                   "/get_weights_by_name")
    """Routes SGLang takes on GET as well as POST (verl's HttpServerAdapter flushes with a GET)."""

    PUT_OR_POST = ("/generate",)
    """Routes SGLang takes on PUT as well as POST (``methods=["POST", "PUT"]`` in its server)."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, allowed_disk_dirs: Sequence[str] = (),
                 max_body_bytes: int = DEFAULT_MAX_BODY, max_concurrent: int = 32,
                 update_wait_s: float = 60.0, socket_timeout_s: float = 60.0,
                 model_path: str = "fsdp_sync-reference") -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string or None")
        self.engine = engine
        self.api_key = api_key
        self.allowed_disk_dirs = [str(Path(d).resolve()) for d in allowed_disk_dirs]
        for d in self.allowed_disk_dirs:
            if not Path(d).is_dir():
                raise ValueError(f"allowed disk directory {d!r} does not exist")
        self.max_body_bytes = int(max_body_bytes)
        self.update_wait_s = float(update_wait_s)
        self.model_path = model_path
        self._generation_eos = generation_config_eos(model_path)    # SGLang's eos ids beside the config's
        self.started = time.time()
        self._update_lock = threading.Lock()
        self._live: dict[str, threading.Event] = {}     # rid -> abort flag of a running generate
        self._live_lock = threading.Lock()
        self.max_concurrent = int(max_concurrent)
        self._slots = threading.BoundedSemaphore(self.max_concurrent)
        self._busy = 0                        # requests being answered (`wait_idle`)
        self._busy_cond = threading.Condition()
        self.updates_served = 0
        self.hits: Counter[str] = Counter()   # requests per route (auth refusals included)
        # open connections (HTTP/1.1 keeps them alive) -> whether a request on it is being answered
        self._conns: dict[Any, bool] = {}
        self._conns_lock = threading.Lock()
        self._closed = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout_s          # a stalled request line or body times out
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # noqa: N802 - the stdlib's name
                log.debug("%s " + fmt, self.client_address[0], *args)

            def setup(self):
                super().setup()
                # an answer is two writes (head, body): with Nagle's algorithm on, the body of
                # an answer on a kept-alive connection waits for the client's delayed ACK (40 ms)
                try:
                    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                with outer._conns_lock:
                    outer._conns[self.connection] = False

            def finish(self):
                try:
                    super().finish()
                finally:
                    with outer._conns_lock:
                        outer._conns.pop(self.connection, None)

            def do_GET(self):  # noqa: N802
                outer._handle(self, "GET")

            def do_POST(self):  # noqa: N802
                outer._handle(self, "POST")

            # other methods answer a JSON 405 (known route) or 404, not the stdlib's 501 page
            def do_PUT(self):  # noqa: N802
                outer._handle(self, "PUT")

            def do_DELETE(self):  # noqa: N802
                outer._handle(self, "DELETE")

            def do_PATCH(self):  # noqa: N802
                outer._handle(self, "PATCH")

            def do_OPTIONS(self):  # noqa: N802
                outer._handle(self, "OPTIONS")

            def send_error(self, code, message=None, explain=None):
                """The stdlib's own refusals (a malformed request line, an unknown method such
                as HEAD) in JSON too, not an HTML page."""
                data = json.dumps({"success": False, "message": message or explain or
                                   f"HTTP {int(code)}", "retryable": False}).encode()
                self.send_response(code, message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.close_connection = True
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if getattr(self, "command", None) != "HEAD" and code >= 200 and code not in (204, 304):
                    self.wfile.write(data)

        self._paths = frozenset().union(*self._routes(None))    # what `hits` counts by name
        self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "EngineServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="fsdp_sync-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        """Stop taking connections and requests: idle kept-alive connections are closed, a
        connection whose request is being answered after its answer (`wait_idle` waits for them)."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()
        with self._conns_lock:
            self._closed = True
            idle = [c for c, busy in self._conns.items() if not busy]
        for conn in idle:            # its handler's read ends; it serves nothing more
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no request is being answered (after the engine was shut
        down, so a request in flight gets its 503 before the process exits); True if none is."""
        with self._busy_cond:
            return self._busy_cond.wait_for(lambda: self._busy == 0, timeout=timeout_s)

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ request plumbing
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        with self._conns_lock:
            closed = self._closed
            if not closed:
                self._conns[h.connection] = True
        if closed:                   # read as the server closed: refused, nothing applied
            h.close_connection = True
            self._reply(h, 503, {"success": False, "message": "the server is closed",
                                 "retryable": True})
            return
        try:
            self._handle_one(h, method)
        finally:
            with self._conns_lock:
                if h.connection in self._conns:
                    self._conns[h.connection] = False
                if self._closed:
                    h.close_connection = True

    GENERATION = ("/generate", "/health_generate")
    """The routes ``max_concurrent`` bounds: each holds the engine's scheduler for a rollout."""

    def _handle_one(self, h: BaseHTTPRequestHandler, method: str) -> None:
        with self._busy_cond:
            self._busy += 1
        slot = False
        try:
            h._body_read = False
            headers: dict[str, str] = {}
            path = h.path.split("?", 1)[0]
            # by route: a key per path would grow by one for every path a scanner tries
            self.hits[path if path in self._paths else UNKNOWN_PATH] += 1
            try:
                if self.api_key is not None and path not in ("/health", "/ready"):
                    got = h.headers.get("Authorization", "")
                    if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                        raise Refused(401, "missing or wrong API key "
                                           "(send 'Authorization: Bearer KEY')")
                body = self._read_body(h)
                if path in self.GENERATION:
                    slot = self._slots.acquire(blocking=False)
                    if not slot:
                        raise Refused(503, f"server busy: {self.max_concurrent} generation requests "
                                           f"are being served (--max-concurrent)")
                status, out = self._route(method, path, body, h)
            except Exception as e:  # noqa: BLE001 - an error becomes the answer, not a crash
                # 4xx: the client's mistake; 5xx: the server's (a router retries those elsewhere)
                status, retryable = error_status(e)
                headers = getattr(e, "headers", None) or {}
                text = error_text(e) if isinstance(e, Refused) else f"{type(e).__name__}: {error_text(e)}"
                if not isinstance(e, Refused):
                    (log.warning if status >= 500 else log.info)("%s %s failed: %s", method, h.path, e)
                out = text if getattr(e, "plain", False) else \
                    {"success": False, "message": text, "retryable": retryable}
            # a body left unread (refused before reading) must not be taken for the next request
            unread = not getattr(h, "_body_read", False) and (
                h.headers.get("Content-Length") not in (None, "0") or h.headers.get("Transfer-Encoding"))
            if status is not None:          # None: the route answered itself (a stream)
                self._reply(h, status, out, close=bool(unread) or status in (411, 413),
                            headers=headers)
        finally:
            if slot:
                self._slots.release()
            with self._busy_cond:
                self._busy -= 1
                self._busy_cond.notify_all()

    def _read_body(self, h: BaseHTTPRequestHandler) -> dict:
        coding = h.headers.get("Transfer-Encoding")
        if coding:
            if coding.strip().lower() != "chunked":
                raise Refused(501, f"Transfer-Encoding {coding!r} is not supported: send the body "
                                   f"plain (Content-Length) or chunked")
            raw = read_chunked(h.rfile, self.max_body_bytes)
            h._body_read = True
        else:
            raw = self._read_sized(h)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Refused(400, f"malformed JSON body: {e}") from None
        except RecursionError:
            raise Refused(400, "malformed JSON body: nested too deeply") from None
        if not isinstance(body, dict):
            raise Refused(400, f"the JSON body must be an object, got {type(body).__name__}")
        return body

    def _read_sized(self, h: BaseHTTPRequestHandler) -> bytes:
        raw_len = h.headers.get("Content-Length")
        if raw_len is None:     # HTTP/1.1: neither Content-Length nor chunked is an empty body
            return b""
        try:
            n = int(raw_len)
        except ValueError:
            raise Refused(400, f"bad Content-Length {raw_len!r}") from None
        if n < 0:
            raise Refused(400, f"bad Content-Length {raw_len!r}")
        if n > self.max_body_bytes:
            raise Refused(413, too_big(n, self.max_body_bytes))
        raw = h.rfile.read(n) if n else b""
        h._body_read = True
        if len(raw) != n:
            raise Refused(400, f"body ended after {len(raw)} of {n} bytes")
        return raw

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, out: Any, *, close: bool = False,
               headers: dict[str, str] | None = None) -> None:
        if isinstance(out, str):
            data, ctype = out.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(out).encode(), "application/json"
        try:
            h.send_response(status)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            if close:   # the unread body must not be taken for the next request
                h.send_header("Connection", "close")
                h.close_connection = True
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()
            if close:
                EngineServer._linger(h)
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _linger(h: BaseHTTPRequestHandler, max_bytes: int = 8 << 20, max_s: float = 2.0) -> None:
        """After refusing a body, read and drop what the client is still sending (at most
        ``max_bytes`` / ``max_s``), so a client that writes its whole body before reading gets the
        refusal instead of a reset connection."""
        import socket

        try:
            h.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + max_s
            got = 0
            while got < max_bytes and (left := deadline - time.monotonic()) > 0:
                h.connection.settimeout(min(left, 0.5))
                chunk = h.connection.recv(1 << 16)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass

    # ------------------------------------------------------------------ routes
    def _route(self, method: str, path: str, body: dict,
               h: BaseHTTPRequestHandler | None = None) -> tuple[int | None, Any]:
        get_routes, post_routes = self._routes(h)
        if path not in get_routes and path not in post_routes:
            # SGLang's answer too: FastAPI's own (SGLang's ErrorResponse handler is registered for
            # fastapi's HTTPException, which the router's 404, starlette's, is not)
            return 404, {"detail": "Not Found"}
        dead = self.dead_reason()
        if dead is not None:
            # SGLang's server exits when a scheduler dies; until ours does (`main_serve`), every
            # route, /health and /ready included, says so: a router must stop sending traffic here
            return 503, {"success": False, "message": f"the engine behind this server is dead: {dead}",
                         "retryable": True}
        allowed = (("POST", "PUT") if path in self.PUT_OR_POST else ("GET", "POST") if
                   path not in post_routes or path in self.GET_OR_POST else ("POST",))
        if method not in allowed:
            raise Refused(405, f"{path} takes {' or '.join(allowed)}, not {method}",
                          headers={"Allow": ", ".join(allowed)})
        if path in post_routes and (method == "POST" or path not in get_routes):
            return post_routes[path](body)
        return get_routes[path](body)      # SGLang answers these on POST too

    def _routes(self, h: BaseHTTPRequestHandler | None) -> tuple[dict, dict]:
        """(GET routes, POST routes): path -> handler of the body, answering ``h``'s request."""
        control_gets, control_posts = self.control_routes()
        get_routes: dict[str, Callable[[dict], tuple[int, Any]]] = {
            **control_gets,
            "/get_model_info": self._model_info,
            "/model_info": self._model_info,
            "/get_server_info": self._server_info,
            "/server_info": self._server_info,
            "/v1/models": self._models,
        }
        post_routes: dict[str, Callable[[dict], tuple[int, Any]]] = {
            **control_posts,
            "/generate": lambda b: self._generate(b, h),
            "/abort_request": self._abort_request,
            "/update_weights_from_tensor": self._update_from_tensor,
            "/begin_weight_update": self._begin_weight_update,
            "/end_weight_update": self._end_weight_update,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weights_from_disk": self._update_from_disk,
            "/release_memory_occupation":
                lambda b: self._update("release_memory_occupation", {"tags": tags_field(b)}),
            "/resume_memory_occupation":
                lambda b: self._update("resume_memory_occupation", {"tags": tags_field(b)}),
            "/flush_cache": lambda b: self._flush_cache(b, h.path if h is not None else ""),
            "/get_weights_by_name": self._get_weights_by_name,
            "/fsdp_sync/tensor_checksums": self._tensor_checksums,
            **self.lora_routes(),        # SGLang's LoRA routes (`serve_lora`)
        }
        return get_routes, post_routes

    def dead_reason(self) -> str | None:
        """Why the engine can serve nothing more (a worker died, it was shut down), or None."""
        fn = getattr(self.engine, "dead_reason", None)
        if callable(fn):
            return fn()
        return "the engine was shut down" if getattr(self.engine, "closed", False) is True else None

    def _model_info(self, body: dict) -> tuple[int, Any]:
        cfg = getattr(self.engine, "config", None)
        # SGLang 0.5.23's keys (``served_model_name``: its default, the model path; sglang-router
        # reads it and ``model_path`` to name the worker's model)
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path,
                     "tokenizer_path": None, "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.weight_version,
                     "model_type": getattr(cfg, "model_type", None),
                     "architectures": getattr(cfg, "architectures", None),
                     # fsdp_sync's: the whole HF config, so a trainer checks the math-changing
                     # values against its own at the first sync (SGLang reports only model_path)
                     "hf_config": json.loads(cfg.to_json_string()) if hasattr(cfg, "to_json_string") else None}

    def _models(self, body: dict) -> tuple[int, Any]:
        """SGLang's OpenAI-style ``/v1/models``: the served model, then each loaded LoRA adapter."""
        return 200, {"object": "list", "data": [{
            "id": self.model_path, "object": "model", "created": int(self.started),
            "owned_by": "sglang", "root": self.model_path, "parent": None,
            "max_model_len": self.context_length()},
            *self.lora_cards(self.model_path, int(self.started))]}

    def context_length(self) -> int | None:
        """The engine's context length, as SGLang's ``model_config.context_len`` (what its
        ``/v1/models`` answers as ``max_model_len``): the engine's own where it keeps one
        (`rollout.GenerationCalls.context_length`: ``--context-length``, ``rope_scaling``), else
        derived from its config as SGLang derives it; None for an engine with no config."""
        own = getattr(self.engine, "context_length", None)
        if isinstance(own, int) and not isinstance(own, bool):
            return own
        cfg = getattr(self.engine, "config", None)
        return None if cfg is None else sglang_context_length(cfg)

    def _server_info(self, body: dict) -> tuple[int, Any]:
        return 200, {"tp_size": int(self.engine.tp_size), "dp_size": 1,
                     "model_path": self.model_path, "version": "fsdp_sync-serve",
                     "weight_version": self.weight_version,
                     "quantization": getattr(self.engine, "quantization", None),   # SGLang's server arg
                     "disk_updates": bool(self.allowed_disk_dirs),
                     # fsdp_sync's: /generate requests that reached this server (refused ones too),
                     # so a fleet can check a router stopped sending to a replica out of service
                     "generate_requests": self.hits["/generate"]}

    def _generate(self, body: dict, h: BaseHTTPRequestHandler | None) -> tuple[int | None, Any]:
        try:
            req = parse_generate(body)
        except GenerateRefused as exc:
            raise Refused(400, str(exc)) from None
        if not hasattr(self.engine, "generate_requests"):
            raise Refused(404, "this engine has no generate_requests")
        if self.serving_refusal() is not None:       # a router must route elsewhere
            return self.serving_refusal()
        rids = req.ids          # with n > 1 the samples' own (`sample_ids`), not the request's rid
        events = {rid: threading.Event() for rid in rids}
        with self._live_lock:
            clash = sorted((set(rids) | set(intake_ids(body.get("rid"), req))) & set(self._live))
            if clash:
                raise Refused(400, f"field 'rid': request id(s) {clash} are already running")
            self._live.update(events)
        gone = ClientWatch(h)
        eos = sglang_eos(getattr(self.engine, "config", None), self._generation_eos)
        version = self.weight_version      # for an engine whose results carry none
        t0 = time.monotonic()
        results: list[dict] = []

        def item(k: int, r: dict) -> dict:
            return answer_item(req, k, r, version, t0)

        sent: list[int] = []           # tokens of each result streamed so far
        ended: list[bool] = []         # whether its last chunk (with its finish_reason) went out

        def on_step(rs: list[dict]) -> None:
            if not req.stream:
                return
            if not sent:
                results.extend(rs)
                sent.extend([0] * len(rs))
                ended.extend([False] * len(rs))
            for k, r in enumerate(rs):
                n = len(r["output_ids"])
                done = r["finish_reason"] is not None
                if (n > sent[k] and (done or n - sent[k] >= req.interval[r["prompt_index"]])) or (
                        done and not ended[k]):     # an abort ends a stream with no new token
                    sent[k], ended[k] = n, done
                    gone.send(item(k, r))

        try:
            if req.stream:
                gone.start_stream()
            try:
                rs = self.engine.generate_requests(
                    req.prompts, req.sampling, return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len, on_step=on_step,
                    should_abort=lambda k: gone() or events[rids[k]].is_set(),
                    **({} if req.lora_path is None else {"lora_path": req.lora_path}),
                    **({} if eos is None else {"eos": eos}))
            except Exception as exc:  # noqa: BLE001 - in a stream the error is a chunk, as SGLang's
                if not req.stream:
                    refused = self.serving_refusal()     # taken out of service meanwhile
                    if refused is not None:
                        return refused
                    if isinstance(exc, ValueError):      # SGLang's words, without a type name
                        raise Refused(400, str(exc)) from None
                    raise
                # the 200 went out with the stream: the chunk carries the status the answer had had
                status, retryable = error_status(exc)
                text = str(exc) if isinstance(exc, (ValueError, Refused)) else \
                    f"{type(exc).__name__}: {error_text(exc)}"
                gone.send({"error": {"message": text, "code": status, "retryable": retryable,
                                     "type": "invalid_request_error" if status < 500 else
                                     "service_unavailable" if status == 503 else "server_error"}})
                gone.end_stream()
                return None, None
            if req.stream:
                if not sent:      # max_new_tokens 0: no step ran
                    results.extend(rs)
                    for k, r in enumerate(rs):
                        gone.send(item(k, r))
                gone.end_stream()
                return None, None
            out = [item(k, r) for k, r in enumerate(rs)]
            return 200, out[0] if req.single and req.n == 1 else out
        finally:
            with self._live_lock:
                for rid in rids:
                    self._live.pop(rid, None)

    def _abort_request(self, body: dict) -> tuple[int, Any]:
        """SGLang's ``/abort_request``: ``{"rid": id}`` or ``{"abort_all": true}``; an unknown id is
        ignored, as SGLang ignores it. The request ends at its next decode step with
        ``finish_reason`` ``{"type": "abort"}``. A sample of an ``n`` > 1 request is aborted by its
        own id (its ``meta_info.id``), and the request's ``rid`` aborts none of them, as in SGLang
        (`generate_request.sample_ids`). The answer is SGLang 0.5.23's: 200 with an empty body,
        whether anything was aborted or not (the count goes to the log); a wrong field type is a
        400 naming it (SGLang's validation answers 400 too). Unlike SGLang's scheduler, which ends
        every request whose id *starts with* the one given (a running ``"a"`` aborts ``"ab"``
        too), only the id itself is ended."""
        rid = body_field(body, "rid", (str, type(None)), "") or ""
        abort_all = body_field(body, "abort_all", bool, False)
        with self._live_lock:
            hit = list(self._live) if abort_all else [r for r in self._live if rid and r == rid]
            for r in hit:
                self._live[r].set()
        log.debug("abort_request %r (abort_all %s): %d request(s) aborted", rid, abort_all, len(hit))
        return 200, ""

    def _method(self, name: str) -> Callable:
        fn = getattr(self.engine, name, None)
        if not callable(fn):
            raise Refused(404, f"this engine has no {name}")
        return fn

    def _get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        name = body_field(body, "name", str)
        size = body_field(body, "truncate_size", int, 100)
        if size < 0:
            raise Refused(400, f"truncate_size must be >= 0, got {size}")
        try:
            t = self.engine.get_weights_by_name(name, truncate_size=size)
        except KeyError as e:
            raise Refused(400, error_text(e)) from None
        return 200, t.float().tolist()

    def _tensor_checksums(self, body: dict) -> tuple[int, Any]:
        """fsdp_sync's own route (SGLang has none like it): ``{"names": [...] | null}`` ->
        ``{"checksums": {name: digest}}``, the digests ``SyncConfig.verify`` compares with the
        trainer's (`engines.base.checksum_named_tensors` of each full tensor)."""
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str)
                                                                       for n in names)):
            raise Refused(400, f"field 'names' must be a list of parameter names or null, got "
                               f"{str(names)[:100]!r}")
        try:
            return 200, {"checksums": self.engine.tensor_checksums(names)}
        except KeyError as e:
            raise Refused(400, error_text(e)) from None


def intake_ids(rid: Any, req: Any) -> list[str]:
    """The ids SGLang 0.5.23 holds a ``/generate`` request under while taking it in
    (``GenerateReqInput._normalize_rid``; ``TokenizerManager._init_req_state`` refuses one already
    running: "Duplicate request ID detected"): with ``n`` 1 the request's own (`GenerateRequest.rids`);
    with ``n`` > 1 the body's ``rid`` list, or a string ``rid`` expanded to ``rid_0`` ..
    ``rid_{prompts * n - 1}`` (a single prompt too: ``n`` > 1 makes it a batch), none for no
    ``rid``. SGLang drops these ids once the prefix warm-up is done and runs each sample under a
    fresh one (`generate_request.sample_ids`), so they clash only with requests already running."""
    if req.n == 1:
        return list(req.rids)
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(len(req.prompts) * req.n)]
    return []
