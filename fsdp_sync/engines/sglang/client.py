"""How the adapter reaches SGLang: its errors, the answer check, and two backends with one
``call`` surface: an in-process ``sglang.Engine`` (`InProcessClient`) and JSON over HTTP with
bounded retries of idempotent calls and kept-alive connections (`HttpClient`, standard library
only).

Not here: what each call means and when to make it (`adapter.SGLangEngine`).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

from ..base import DETAIL_HEADER, UNOPENED_MARK, EngineError

__all__ = ["SGLangError", "SGLangHTTPError", "SGLangUpdateError", "NO_SESSION_MARK", "UNOPENED_STATUS", "validation_refusal",
           "check_answer", "lease_answered",
           "MissingMethod", "InProcessClient", "HttpClient", "NotFound", "json_or_text", "RETRY_STATUS",
           "takes_keyword"]

class SGLangError(EngineError):
    """An SGLang call failed. ``call`` names it; ``body`` is the server's response text (HTTP)."""

    def __init__(self, message: str, *, call: str = "", status: int | None = None,
                 body: str | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.status = status
        self.body = body


class SGLangHTTPError(SGLangError):
    """The server answered with an HTTP error status, or could not be reached."""


class SGLangUpdateError(SGLangError):
    """SGLang answered a weight update with ``success=False`` (or an HTTP error).

    SGLang does not promise all-or-nothing: after a failed load its weights may be partly updated.
    ``opened`` is False when SGLang certainly did not open the payloads (it refused the call before
    loading, or the request never reached it), True when it did, None when unknown.
    """

    def __init__(self, message: str, *, opened: bool | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.opened = opened


# SGLang's answer when an update comes outside begin/end (0.5.21+): it did not deserialize.
NO_SESSION_MARK = "must run between begin_weight_update"
UNOPENED_STATUS = frozenset({401, 403, 404, 405, 411, 413, 422})
"""HTTP statuses answered before any handler reads a request's payloads: the API key (401, 403),
no such route or method (404: a URL without the route, e.g. a router's or an older server's;
405), the body refused (411, 413) or failing the request model's validation (422; FastAPI checks
it before calling the handler). An update answered with one certainly opened nothing, so its
payloads' shared-memory references are given back (`lease_answered`, `BucketPayloads`)."""


def validation_refusal(status: int | None, text: str) -> bool:
    """Whether an answer is SGLang's refusal of a body that failed its request model (0.5.12 to
    0.5.23 turn FastAPI's 422 into a 400 ``ErrorResponse``: ``{"object": "error", "type": "Bad
    Request", "code": 400, ...}``), given before any handler ran: no payload was opened. A
    handler's own 400 is ``{"success": false, ...}`` or ``{"error": {...}}``, never this shape."""
    if status != 400:
        return False
    body = json_or_text(text)
    return (isinstance(body, dict) and body.get("object") == "error"
            and body.get("type") == "Bad Request" and body.get("code") == 400)


def check_answer(call: str, answer: Any, *, error=SGLangError, where: str = "",
                 require_success: bool = False) -> Any:
    """Raise ``error`` with SGLang's message if ``answer`` says ``success=False``.
    ``require_success``: an answer without a boolean ``success`` raises too (a weight update over
    HTTP: SGLang 0.5.12 to 0.5.23 and ``fsdp-sync serve`` always send it; another server at the URL
    answering 2xx must not be read as weights loaded)."""
    if require_success and not (isinstance(answer, dict) and isinstance(answer.get("success"), bool)):
        text = (f"{call}{where} answered {str(answer)[:200]!r}, not SGLang's {{success, message}}: "
                f"is the URL an SGLang server? Whether it loaded anything is unknown")
        raise error(text, call=call, body=str(answer)[:2000])
    success, message = True, None
    if isinstance(answer, tuple) and len(answer) >= 2 and isinstance(answer[0], bool):
        success, message = answer[0], answer[1]
    elif isinstance(answer, dict) and "success" in answer:
        success, message = bool(answer["success"]), answer.get("message")
    elif hasattr(answer, "success") and isinstance(getattr(answer, "success"), bool):
        success, message = answer.success, getattr(answer, "message", None)
    elif isinstance(answer, bool):
        success = answer
    if not success:
        text = f"SGLang refused {call}{where}: {message or '(no message)'}"
        if error is SGLangUpdateError:
            opened = False if message and (NO_SESSION_MARK in str(message) or UNOPENED_MARK in str(message)) \
                else None
            raise SGLangUpdateError(text, opened=opened, call=call, body=message)
        raise error(text, call=call, body=message)
    return answer


# --------------------------------------------------------------------------- backends

class MissingMethod(Exception):
    """The engine has no such method (older SGLang)."""


def takes_keyword(obj: Any, method: str, param: str) -> bool:
    """Whether ``obj.method`` takes the keyword ``param`` (an in-process engine's release)."""
    import inspect

    try:
        params = inspect.signature(getattr(obj, method)).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return param in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class InProcessClient:
    """Calls on an ``sglang.Engine`` object in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.where = ""
        self.server_info: dict | None = None    # the answer `tp_size` read, if any

    def call(self, method: str, /, **kwargs: Any) -> Any:
        fn = getattr(self.engine, method, None)
        if not callable(fn):
            raise MissingMethod(method)
        return fn(**kwargs)

    def has(self, name: str) -> bool:
        return callable(getattr(self.engine, name, None))

    def tp_size(self) -> int | None:
        if self.has("get_server_info"):
            try:
                info = self.engine.get_server_info()
                self.server_info = info if isinstance(info, dict) else None
                if isinstance(info, dict) and info.get("tp_size"):
                    return int(info["tp_size"])
            except Exception:   # noqa: BLE001 - fall back to server_args below
                pass
        args = getattr(self.engine, "server_args", None)
        tp = getattr(args, "tp_size", None)
        return int(tp) if tp else None


RETRY_STATUS = (429, 500, 502, 503, 504)


KEEPALIVE_S = 2.0
"""How long an idle connection is reused: under uvicorn's 5 s keep-alive (SGLang's server) and
``fsdp-sync serve``'s socket timeout, so a server never closes one the client is about to use."""


class HttpClient:
    """JSON over HTTP to an SGLang server (standard library only), with bounded retries.

    Only calls marked idempotent are retried: on a connection error, a timeout, or HTTP 429/5xx,
    after ``backoff_s * 2**attempt`` seconds (at most ``backoff_max_s``). Every error carries the
    server's response text. No proxy is used unless ``proxies`` are given.

    Connections are kept alive (HTTP/1.1) and reused while idle for less than ``keepalive_s``: a
    sync's calls (begin, one per bucket, end, flush) share one connection instead of a TCP
    handshake and a server thread each. An idle connection the server closed, or one idle longer,
    is closed and a fresh one made before the request is sent, so no request is sent twice. Each
    thread takes its own connection from a small pool (`close` ends them). With ``proxies`` every
    request goes through urllib, one connection each, as before. ``connections`` counts the
    connections made (tests, figures).
    """

    def __init__(self, base_url: str, *, api_key: str | None, timeout_s: float, max_retries: int,
                 backoff_s: float, backoff_max_s: float, proxies: dict | None,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if keepalive_s < 0:
            raise ValueError(f"keepalive_s must be >= 0 (0: a connection per request), got {keepalive_s!r}")
        # 0 would make every socket non-blocking (each call failing "no answer: BlockingIOError"),
        # None wait forever on a hung server, a negative one fail inside every call
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        for name, value in (("max_retries", max_retries), ("retry_backoff_s", backoff_s),
                            ("retry_backoff_max_s", backoff_max_s)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        self.base_url = base_url.rstrip("/")
        self.where = f" at {self.base_url}"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies or {}))
        self.attempts: Counter[str] = Counter()
        self.keepalive_s = float(keepalive_s) if not proxies else 0.0
        url = urllib.parse.urlsplit(self.base_url)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "", url.port
        self._prefix = url.path.rstrip("/")
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []   # (connection, idle since)
        self._lock = threading.Lock()
        self.connections = 0

    # ------------------------------------------------------------------ kept-alive connections
    def _take(self, timeout: float) -> http.client.HTTPConnection:
        """An idle connection still open and idle under ``keepalive_s``, or a new one."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if now - since < self.keepalive_s and not _dropped(conn):
                    conn.timeout = timeout
                    if conn.sock is not None:
                        conn.sock.settimeout(timeout)
                    return conn
                conn.close()
            self.connections += 1
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append((conn, time.monotonic()))

    def close(self) -> None:
        """Close the idle connections (one in use is closed by its request)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _exchange(self, method: str, path: str, data: bytes | None, headers: dict,
                  timeout: float) -> tuple[int, str]:
        """One request on a kept-alive connection: ``(status, text)``, any status; raises
        `http.client` / socket errors as urllib would (the caller maps both)."""
        conn = self._take(timeout)
        try:
            if conn.sock is None:
                conn.connect()
                # as the server's answers: no write of a request waits for a delayed ACK
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            text = with_detail(resp.read().decode("utf-8", errors="replace"), resp.status,
                               resp.getheader(DETAIL_HEADER))
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return resp.status, text

    def request(self, method: str, path: str, body: Any = None, *, idempotent: bool = False,
                timeout_s: float | None = None, error=SGLangHTTPError,
                retries: int | None = None) -> tuple[int, str]:
        """``(status, text)`` of a 2xx answer; raises ``error`` on anything else. ``retries``: of
        an idempotent call, instead of ``max_retries`` (0: one attempt)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        tries = 1 + ((self.max_retries if retries is None else max(0, retries)) if idempotent else 0)
        for attempt in range(tries):
            self.attempts[path] += 1
            try:
                if self.keepalive_s > 0:
                    status, text = self._exchange(method, path, data, headers,
                                                  timeout_s or self.timeout_s)
                    if 200 <= status < 300:
                        return status, text
                    raise _Status(status, text)
                req = urllib.request.Request(url, data=data, headers=headers, method=method)
                with self.opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                    return resp.status, resp.read().decode("utf-8", errors="replace")
            except _Status as e:
                status, text = e.status, e.text
                exc = self._error(error, method, path, status, text, reached=True)
                if status == 404:
                    raise NotFound(exc) from None
                if not (idempotent and status in RETRY_STATUS):
                    raise exc from None
            except urllib.error.HTTPError as e:
                status = e.code
                try:
                    text = with_detail(e.read().decode("utf-8", errors="replace"), status,
                                       e.headers.get(DETAIL_HEADER) if e.headers else None)
                except Exception:   # noqa: BLE001 - the body is best effort
                    text = ""
                finally:
                    e.close()
                exc = self._error(error, method, path, status, text, reached=True)
                if status == 404:
                    raise NotFound(exc) from None
                if not (idempotent and status in RETRY_STATUS):
                    raise exc from None
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                    http.client.HTTPException, OSError) as e:
                reason = getattr(e, "reason", e)
                refused = isinstance(reason, ConnectionRefusedError)
                exc = self._error(error, method, path, None, f"{type(reason).__name__}: {reason}",
                                  reached=False if refused else None)
                if not idempotent:
                    raise exc from e
            if attempt + 1 < tries:
                time.sleep(min(self.backoff_s * 2 ** attempt, self.backoff_max_s))
        exc.args = (f"{exc.args[0]} (gave up after {tries} attempts)",)
        raise exc

    def _error(self, error, method: str, path: str, status: int | None, text: str,
               reached: bool | None):
        head = f"HTTP {status}" if status is not None else "no answer"
        msg = f"{method} {self.base_url}{path}: {head}: {text.strip() or '(empty body)'}"
        kw: dict[str, Any] = {"call": path.lstrip("/"), "status": status, "body": text}
        if error is SGLangUpdateError:
            # a refused connection never reached SGLang; an error status came after it read the
            # request, and whether it opened the payloads depends on where it failed
            # (`UNOPENED_STATUS` come before any handler reads them; a 500 may come after)
            kw["opened"] = False if reached is False or status in UNOPENED_STATUS else (
                False if NO_SESSION_MARK in text or UNOPENED_MARK in text or validation_refusal(status, text)
                else None)
        return error(msg, **kw)

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, text = self.request(method, path, body, **kw)
        return json_or_text(text)


def with_detail(text: str, status: int, detail: str | None) -> str:
    """An error answer's body with the server's reason beside it (`DETAIL_HEADER`), so the error
    raised says why; a 2xx body, or one without the header (SGLang's own), as it came."""
    if detail and not 200 <= status < 300:
        return f"{text.rstrip()} ({detail})"
    return text


class _Status(Exception):
    """A non-2xx answer on a kept-alive connection (urllib's ``HTTPError``, for `request`)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(status)
        self.status, self.text = status, text


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection is unusable: never connected is fine; readable while idle means
    the server closed it (or sent what nobody asked for)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@contextmanager
def lease_answered(lease: Any) -> Iterator[None]:
    """Around one HTTP call that carries ``lease``'s untagged payloads (`handles.make_payloads`):
    the lease is released when the call ends, its payloads counted as unopened only where the
    call's `SGLangUpdateError` says SGLang certainly did not open them (``opened`` False);
    untagged payloads cannot say so themselves."""
    opened: bool | None = True
    try:
        yield
    except SGLangUpdateError as e:
        opened = e.opened
        raise
    finally:
        lease.release(require_ack=False, unopened=range(len(lease.payloads)) if opened is False else ())


class NotFound(Exception):
    def __init__(self, error: SGLangError) -> None:
        super().__init__(str(error))
        self.error = error


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text
