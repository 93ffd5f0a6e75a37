"""`fsdp-sync serve`: the reference engine behind SGLang's HTTP endpoints, safe by default.

`EngineServer` puts an engine (normally a `ReferenceEngine`) behind the routes and JSON bodies of
an SGLang 0.5.23 server, so that `fsdp_sync.engines.sglang.SGLangEngine(base_url=...)` and verl's
HTTP client drive it unchanged and a weight sync over HTTP can be run end to end, with real
weights, on a CPU machine:

    GET  /health  /health_generate  /get_model_info  /get_server_info (/server_info)
    POST /generate                     {input_ids | text, sampling_params}
    POST /update_weights_from_tensor   {serialized_named_tensors, load_format, flush_cache}
    POST /begin_weight_update  /end_weight_update
    POST /init_weights_update_group    {master_address, master_port, rank_offset, world_size,
                                        group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache,
                                            load_format}
    POST /destroy_weights_update_group {group_name}
    POST /update_weights_from_disk     {model_path, load_format}
    POST /release_memory_occupation  /resume_memory_occupation  {tags}
    POST /flush_cache
    POST /get_weights_by_name          {name, truncate_size}

Weight updates answer ``{"success": bool, "message": str}`` (HTTP 200, or 400 on a refusal), as
SGLang does. An engine without a method (the distributed and disk ones on an older engine) answers
404 on its route, which `SGLangEngine` reads as "an older server".

Safe by default (none of this is SGLang's behaviour, which binds where it is told and takes any
path): it binds 127.0.0.1 unless given another host; with an API key every request but
``/health`` must carry ``Authorization: Bearer KEY`` (401 otherwise, compared in constant time);
``update_weights_from_disk`` takes only directories inside ``allowed_disk_dirs`` after resolving
symlinks (none allowed: every disk update is refused); request bodies are bounded
(``Content-Length`` required, 413 past ``max_body_bytes``, never read); a request line or body
that stalls times out; malformed JSON and wrong field types get 400 naming the field; at most
``max_concurrent`` requests are served at once (503 beyond); and weight updates run one at a
time: a second one waits up to ``update_wait_s`` for the first to finish, then gets 503, so two
updates never interleave. ``begin_weight_update`` … ``end_weight_update`` is the engine's one
session, as in SGLang: a second ``begin`` while one is open is refused.

HTTP is the standard library's `ThreadingHTTPServer`: the routes are a dozen JSON calls, and a web
framework (fastapi + uvicorn) would be a new dependency of the core package for no gain here.

Not here: the engine (`engines.reference`), the client (`engines.sglang`), TLS (put a proxy in
front, or keep the loopback default), tokenization (``text`` prompts are refused: send
``input_ids``).
"""

from __future__ import annotations

import hmac
import inspect
import json
import logging
import math
import os
import signal
import sys
import threading
from collections import Counter
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["EngineServer", "check_disk_path", "main_serve", "add_serve_parser"]

log = logging.getLogger("fsdp_sync.serve")

DEFAULT_MAX_BODY = 32 << 20


class _Refused(Exception):
    """A request refused with ``status`` and a ``{success: false, message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_disk_path(path: Any, allowed: Sequence[str | os.PathLike]) -> Path:
    """``path`` resolved (symlinks followed) if it lies inside one of ``allowed``; else `_Refused`.

    A path that does not exist is refused too (SGLang would take it for a Hub repo id and try to
    download it)."""
    if not isinstance(path, str) or not path:
        raise _Refused(400, f"model_path must be a non-empty string, got {type(path).__name__}")
    if not allowed:
        raise _Refused(403, "update_weights_from_disk is disabled: the server was started without "
                            "--allowed-disk-dir")
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):
        raise _Refused(400, f"model_path {path!r} is not an existing local path") from None
    for root in allowed:
        root = Path(root).resolve()
        if real == root or root in real.parents:
            return real
    raise _Refused(403, f"model_path {path!r} (resolved {str(real)!r}) is outside the allowed "
                        f"directories {[str(Path(r).resolve()) for r in allowed]}")


# --------------------------------------------------------------------------- field checks

def _field(body: dict, key: str, types: type | tuple, default: Any = ..., *, optional=False) -> Any:
    if key not in body or (optional and body[key] is None):
        if default is ...:
            raise _Refused(400, f"missing field {key!r}")
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _Refused(400, f"field {key!r} must be {_tname(types)}, got bool")
    if not isinstance(v, types):
        raise _Refused(400, f"field {key!r} must be {_tname(types)}, got {type(v).__name__}")
    return v


def _tname(types: type | tuple) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _str_list(body: dict, key: str) -> list[str]:
    v = _field(body, key, list)
    if not all(isinstance(x, str) for x in v):
        raise _Refused(400, f"field {key!r} must be a list of strings")
    return v


def _tags(body: dict) -> list[str] | None:
    tags = _field(body, "tags", (list, type(None)), None)
    if tags is not None and not all(isinstance(t, str) for t in tags):
        raise _Refused(400, "field 'tags' must be a list of strings or null")
    return tags


# --------------------------------------------------------------------------- the server

class EngineServer:
    """SGLang's HTTP routes over ``engine`` (see the module docstring). ``start()`` serves in a
    thread; ``close()`` stops serving (the engine is its owner's to shut down)."""

    UPDATES = ("/update_weights_from_tensor", "/update_weights_from_distributed",
               "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update",
               "/release_memory_occupation", "/resume_memory_occupation")

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
        self.weight_version = "default"
        self._update_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.updates_served = 0
        self.hits: Counter[str] = Counter()   # requests per path (auth refusals included)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout_s          # a stalled request line or body times out
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # noqa: N802 - the stdlib's name
                log.debug("%s " + fmt, self.client_address[0], *args)

            def do_GET(self):  # noqa: N802
                outer._handle(self, "GET")

            def do_POST(self):  # noqa: N802
                outer._handle(self, "POST")

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
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ request plumbing
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if not self._slots.acquire(blocking=False):
            self._reply(h, 503, {"success": False, "message": "server busy: too many requests"},
                        close=True)
            return
        try:
            h._body_read = False
            path = h.path.split("?", 1)[0]
            self.hits[path] += 1
            try:
                if self.api_key is not None and path != "/health":
                    got = h.headers.get("Authorization", "")
                    if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                        raise _Refused(401, "missing or wrong API key "
                                            "(send 'Authorization: Bearer KEY')")
                body = self._read_body(h, method)
                status, out = self._route(method, path, body)
            except _Refused as e:
                status, out = e.status, {"success": False, "message": str(e)}
            except Exception as e:  # noqa: BLE001 - an engine error becomes the answer, not a crash
                log.warning("%s %s failed: %s", method, h.path, e)
                status, out = 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
            # a body left unread (refused before reading) must not be taken for the next request
            unread = not getattr(h, "_body_read", False) and (
                h.headers.get("Content-Length") not in (None, "0") or h.headers.get("Transfer-Encoding"))
            self._reply(h, status, out, close=bool(unread) or status in (411, 413))
        finally:
            self._slots.release()

    def _read_body(self, h: BaseHTTPRequestHandler, method: str) -> dict:
        if h.headers.get("Transfer-Encoding"):
            raise _Refused(411, "chunked bodies are not accepted; send Content-Length")
        raw_len = h.headers.get("Content-Length")
        if raw_len is None:
            if method == "POST":
                raise _Refused(411, "POST needs a Content-Length header")
            return {}
        try:
            n = int(raw_len)
        except ValueError:
            raise _Refused(400, f"bad Content-Length {raw_len!r}") from None
        if n < 0:
            raise _Refused(400, f"bad Content-Length {raw_len!r}")
        if n > self.max_body_bytes:
            raise _Refused(413, f"request body of {n} bytes is over this server's limit of "
                                f"{self.max_body_bytes} (--max-body-mb)")
        raw = h.rfile.read(n) if n else b""
        h._body_read = True
        if len(raw) != n:
            raise _Refused(400, f"body ended after {len(raw)} of {n} bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Refused(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise _Refused(400, f"the JSON body must be an object, got {type(body).__name__}")
        return body

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, out: Any, *, close: bool = False) -> None:
        if isinstance(out, str):
            data, ctype = out.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(out).encode(), "application/json"
        try:
            h.send_response(status)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(data)))
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
    def _route(self, method: str, path: str, body: dict) -> tuple[int, Any]:
        get_routes: dict[str, Callable[[dict], tuple[int, Any]]] = {
            "/health": lambda b: (200, ""),
            "/health_generate": self._health_generate,
            "/get_model_info": self._model_info,
            "/model_info": self._model_info,
            "/get_server_info": self._server_info,
            "/server_info": self._server_info,
        }
        post_routes: dict[str, Callable[[dict], tuple[int, Any]]] = {
            "/generate": self._generate,
            "/update_weights_from_tensor": self._update_from_tensor,
            "/begin_weight_update": lambda b: self._update("begin_weight_update", {}),
            "/end_weight_update": lambda b: self._update("end_weight_update", {}),
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weights_from_disk": self._update_from_disk,
            "/release_memory_occupation":
                lambda b: self._update("release_memory_occupation", {"tags": _tags(b)}),
            "/resume_memory_occupation":
                lambda b: self._update("resume_memory_occupation", {"tags": _tags(b)}),
            "/flush_cache": self._flush_cache,
            "/get_weights_by_name": self._get_weights_by_name,
        }
        if method == "GET" and path in get_routes:
            return get_routes[path](body)
        if path in post_routes:
            if method != "POST":
                return 405, {"success": False, "message": f"{path} takes POST"}
            return post_routes[path](body)
        if path in get_routes:   # SGLang answers these on POST too
            return get_routes[path](body)
        return 404, {"detail": "Not Found"}

    def _health_generate(self, body: dict) -> tuple[int, Any]:
        self.engine.generate([[0]], max_new_tokens=1)
        return 200, ""

    def _model_info(self, body: dict) -> tuple[int, Any]:
        return 200, {"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                     "weight_version": self.weight_version,
                     "model_type": getattr(getattr(self.engine, "config", None), "model_type", None)}

    def _server_info(self, body: dict) -> tuple[int, Any]:
        return 200, {"tp_size": int(self.engine.tp_size), "dp_size": 1,
                     "model_path": self.model_path, "version": "fsdp_sync-serve",
                     "weight_version": self.weight_version,
                     "disk_updates": bool(self.allowed_disk_dirs)}

    def _generate(self, body: dict) -> tuple[int, Any]:
        if body.get("text") is not None and body.get("input_ids") is None:
            raise _Refused(400, "this server has no tokenizer: send input_ids, not text")
        ids = _field(body, "input_ids", list)
        single = bool(ids) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        prompts = [ids] if single else ids
        if not prompts or not all(isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts):
            raise _Refused(400, "field 'input_ids' must be a list of token ids or a non-empty list "
                                "of non-empty lists of token ids")
        sp = _field(body, "sampling_params", (dict, type(None)), None) or {}
        params = {}
        for key, typ in (("max_new_tokens", int), ("temperature", (int, float)),
                         ("stop_token_ids", (list, type(None))), ("ignore_eos", bool)):
            if key in sp:
                params[key] = _field(sp, key, typ)
        unknown = sorted(set(sp) - set(params))
        if unknown:
            raise _Refused(400, f"unsupported sampling_params {unknown}; supported: max_new_tokens, "
                                f"temperature, stop_token_ids, ignore_eos")
        if "temperature" in params and not math.isfinite(params["temperature"]):
            raise _Refused(400, "temperature must be finite")
        if not 0 <= params.get("max_new_tokens", 16) <= 1 << 16:
            raise _Refused(400, f"max_new_tokens must be in [0, 65536], got {params['max_new_tokens']}")
        outs = self.engine.generate(prompts, sampling_params=params)
        res = [{"text": "", "output_ids": list(o),
                "meta_info": {"prompt_tokens": len(p), "completion_tokens": len(o),
                              "weight_version": self.weight_version}}
               for p, o in zip(prompts, outs)]
        return 200, res[0] if single else res

    # ---- updates: one at a time
    def _locked(self, what: str, fn: Callable[[], Any]) -> tuple[int, Any]:
        if not self._update_lock.acquire(timeout=self.update_wait_s):
            raise _Refused(503, f"{what}: another weight update is running; waited "
                                f"{self.update_wait_s:.0f}s, try again")
        try:
            answer = fn()
            self.updates_served += 1
        finally:
            self._update_lock.release()
        if isinstance(answer, tuple) and len(answer) >= 2 and isinstance(answer[0], bool):
            ok, msg = answer[0], str(answer[1])
            return (200 if ok else 400), {"success": ok, "message": msg}
        return 200, {"success": True, "message": f"{what}: ok"}

    def _update(self, method: str, kwargs: dict) -> tuple[int, Any]:
        fn = self._method(method)
        return self._locked(method, lambda: fn(**kwargs))

    def _method(self, name: str) -> Callable:
        fn = getattr(self.engine, name, None)
        if not callable(fn):
            raise _Refused(404, f"this engine has no {name}")
        return fn

    def _update_from_tensor(self, body: dict) -> tuple[int, Any]:
        from .weights import handles

        payloads = _field(body, "serialized_named_tensors", list)
        load_format = _field(body, "load_format", (str, type(None)), None)
        flush = _field(body, "flush_cache", bool, True)
        tp = int(self.engine.tp_size)
        if len(payloads) != tp or not all(isinstance(p, str) for p in payloads):
            raise _Refused(400, f"serialized_named_tensors must be {tp} base64 strings (one per TP "
                                f"rank), got {len(payloads)} item(s)")
        if load_format == "flattened_bucket":
            call = lambda: self.engine.update_weights_from_tensor(   # noqa: E731
                payloads, load_format=load_format, flush_cache=flush)
            return self._locked("update_weights_from_tensor", call)
        if load_format not in (None, "direct"):
            raise _Refused(400, f"unknown load_format {load_format!r}; expected null, "
                                f"'flattened_bucket' or 'direct'")

        # Each payload opens, in this process, to TP rank i's list of (name, tensor): the server
        # plays SGLang's TP workers here. Every payload is opened (each holds a shared-memory
        # reference the sender counted on its consumer to take).
        def call() -> Any:
            per_rank = []
            try:
                for i, p in enumerate(payloads):
                    per_rank.append(handles.open_payload(p))
                lists = [r.value for r in per_rank]
                for i, lst in enumerate(lists):
                    if not isinstance(lst, list) or not all(
                            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
                            for x in lst):
                        raise _Refused(400, f"payload {i} is not a list of (name, tensor) pairs")
                names = [n for n, _ in lists[0]]
                for i, lst in enumerate(lists[1:], 1):
                    if [n for n, _ in lst] != names:
                        raise _Refused(400, f"payload {i} names other tensors than payload 0")
                if load_format is None:
                    named = list(lists[0])
                else:
                    named = [(n, [lst[j][1] for lst in lists]) for j, n in enumerate(names)]
                return self.engine.update_weights_from_tensor(named, load_format=load_format,
                                                              flush_cache=flush)
            finally:
                for r in per_rank:
                    r.ack()

        return self._locked("update_weights_from_tensor", call)

    def _init_group(self, body: dict) -> tuple[int, Any]:
        kwargs = {"master_address": _field(body, "master_address", str),
                  "master_port": _field(body, "master_port", int),
                  "rank_offset": _field(body, "rank_offset", int),
                  "world_size": _field(body, "world_size", int),
                  "group_name": _field(body, "group_name", str, "weight_update_group"),
                  "backend": _field(body, "backend", str, "gloo")}
        if not 0 < kwargs["master_port"] < 65536:
            raise _Refused(400, f"master_port must be in 1..65535, got {kwargs['master_port']}")
        fn = self._method("init_weights_update_group")
        return self._answer("init_weights_update_group", fn(**_accepted(fn, kwargs)))

    def _destroy_group(self, body: dict) -> tuple[int, Any]:
        fn = self._method("destroy_weights_update_group")
        kwargs = {"group_name": _field(body, "group_name", str, "weight_update_group")}
        return self._answer("destroy_weights_update_group", fn(**_accepted(fn, kwargs)))

    def _update_from_distributed(self, body: dict) -> tuple[int, Any]:
        names = _str_list(body, "names")
        dtypes = _str_list(body, "dtypes")
        shapes = _field(body, "shapes", list)
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                               and d >= 0 for d in s) for s in shapes):
            raise _Refused(400, "field 'shapes' must be a list of lists of non-negative ints")
        if not len(names) == len(dtypes) == len(shapes):
            raise _Refused(400, f"names, dtypes and shapes differ in length: {len(names)}, "
                                f"{len(dtypes)}, {len(shapes)}")
        kwargs = {"names": names, "dtypes": dtypes, "shapes": shapes,
                  "group_name": _field(body, "group_name", str, "weight_update_group"),
                  "flush_cache": _field(body, "flush_cache", bool, True),
                  "load_format": _field(body, "load_format", (str, type(None)), None)}
        fn = self._method("update_weights_from_distributed")
        return self._locked("update_weights_from_distributed", lambda: fn(**_accepted(fn, kwargs)))

    def _update_from_disk(self, body: dict) -> tuple[int, Any]:
        real = check_disk_path(body.get("model_path"), self.allowed_disk_dirs)
        kwargs = {"model_path": str(real),
                  "load_format": _field(body, "load_format", (str, type(None)), None)}
        fn = self._method("update_weights_from_disk")
        status, out = self._locked("update_weights_from_disk", lambda: fn(**_accepted(fn, kwargs)))
        if status == 200 and isinstance(body.get("weight_version"), str):
            self.weight_version = body["weight_version"]
        out.setdefault("num_paused_requests", 0)
        return status, out

    @staticmethod
    def _answer(what: str, answer: Any) -> tuple[int, Any]:
        if isinstance(answer, tuple) and len(answer) >= 2 and isinstance(answer[0], bool):
            return (200 if answer[0] else 400), {"success": answer[0], "message": str(answer[1])}
        return 200, {"success": True, "message": f"{what}: ok"}

    def _flush_cache(self, body: dict) -> tuple[int, Any]:
        self.engine.flush_cache()
        return 200, "Cache flushed.\n"

    def _get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        name = _field(body, "name", str)
        size = _field(body, "truncate_size", int, 100)
        if size < 0:
            raise _Refused(400, f"truncate_size must be >= 0, got {size}")
        try:
            t = self.engine.get_weights_by_name(name, truncate_size=size)
        except KeyError as e:
            raise _Refused(400, str(e)) from None
        return 200, t.float().tolist()


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` less the keys ``fn`` does not take (SGLang's bodies carry more than some engines
    accept; the keys dropped are optional ones with defaults)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# --------------------------------------------------------------------------- the command

def add_serve_parser(sub) -> None:
    import argparse

    p = sub.add_parser(
        "serve", help="serve the reference engine behind SGLang's HTTP endpoints",
        description="Start the reference engine (TP worker processes on this machine) behind "
                    "SGLang's HTTP routes, so SGLangEngine(base_url=...) or verl's SGLang client "
                    "can drive it. Binds 127.0.0.1 unless --host says otherwise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help="a recipe name, YAML recipe or HF config.json")
    p.add_argument("--tp", type=int, default=1, help="engine tensor-parallel size")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial random weights")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--weights-cpu-backup", action="store_true",
                   help="keep weights' contents across a release (SGLang's --enable-weights-cpu-backup)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=30000, help="port (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("FSDP_SYNC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request but /health "
                        "(default: $FSDP_SYNC_API_KEY)")
    p.add_argument("--allowed-disk-dir", action="append", default=[], metavar="DIR",
                   help="a directory update_weights_from_disk may read from (repeatable); "
                        "without one, disk updates are refused")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / 2**20,
                   help="largest request body accepted")
    p.add_argument("--max-concurrent", type=int, default=32, help="requests served at once")
    p.add_argument("--update-wait-s", type=float, default=60.0,
                   help="how long a weight update waits for a running one before it gets 503")


def main_serve(args) -> int:
    import torch

    from .config import parse_dtype
    from .engines.reference import ReferenceEngine

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this "
              f"address can replace the weights", file=sys.stderr, flush=True)
    engine = ReferenceEngine(args.model, tp_size=args.tp, device=args.device,
                             dtype=parse_dtype(args.dtype) or torch.float32,
                             kv_cache_tokens=args.kv_cache_tokens, seed=args.seed,
                             weights_cpu_backup=args.weights_cpu_backup)
    server = None
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = EngineServer(engine, host=args.host, port=args.port, api_key=args.api_key,
                              allowed_disk_dirs=args.allowed_disk_dir,
                              max_body_bytes=int(args.max_body_mb * 2**20),
                              max_concurrent=args.max_concurrent, update_wait_s=args.update_wait_s,
                              model_path=str(args.model)).start()
        print(f"fsdp-sync serve: {engine!r} on {server.url} (api key "
              f"{'required' if args.api_key else 'off'}, disk dirs {server.allowed_disk_dirs})",
              flush=True)
        while not stop.wait(0.5):
            if engine.closed:
                break
    finally:
        if server is not None:
            server.close()
        engine.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
    print("fsdp-sync serve: stopped", flush=True)
    return 0
