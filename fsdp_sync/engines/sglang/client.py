"""How the adapter reaches SGLang: its errors, the answer check, and two backends with one
``call`` surface: an in-process ``sglang.Engine`` (`InProcessClient`) and JSON over HTTP with
bounded retries of idempotent calls (`HttpClient`, standard library only).

Not here: what each call means and when to make it (`adapter.SGLangEngine`).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from ..base import EngineError

__all__ = ["SGLangError", "SGLangHTTPError", "SGLangUpdateError", "NO_SESSION_MARK", "check_answer",
           "MissingMethod", "InProcessClient", "HttpClient", "NotFound", "json_or_text", "RETRY_STATUS"]

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


def check_answer(call: str, answer: Any, *, error=SGLangError, where: str = "") -> Any:
    """Raise ``error`` with SGLang's message if ``answer`` says ``success=False``."""
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
            opened = False if message and NO_SESSION_MARK in str(message) else None
            raise SGLangUpdateError(text, opened=opened, call=call, body=message)
        raise error(text, call=call, body=message)
    return answer


# --------------------------------------------------------------------------- backends

class MissingMethod(Exception):
    """The engine has no such method (older SGLang)."""


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


class HttpClient:
    """JSON over HTTP to an SGLang server (standard library only), with bounded retries.

    Only calls marked idempotent are retried: on a connection error, a timeout, or HTTP 429/5xx,
    after ``backoff_s * 2**attempt`` seconds (at most ``backoff_max_s``). Every error carries the
    server's response text. No proxy is used unless ``proxies`` are given.
    """

    def __init__(self, base_url: str, *, api_key: str | None, timeout_s: float, max_retries: int,
                 backoff_s: float, backoff_max_s: float, proxies: dict | None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.where = f" at {self.base_url}"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies or {}))
        self.attempts: Counter[str] = Counter()

    def request(self, method: str, path: str, body: Any = None, *, idempotent: bool = False,
                timeout_s: float | None = None, error=SGLangHTTPError) -> tuple[int, str]:
        """``(status, text)`` of a 2xx answer; raises ``error`` on anything else."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        tries = 1 + (self.max_retries if idempotent else 0)
        for attempt in range(tries):
            self.attempts[path] += 1
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with self.opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                    return resp.status, resp.read().decode("utf-8", errors="replace")
            except urllib.error.HTTPError as e:
                status = e.code
                try:
                    text = e.read().decode("utf-8", errors="replace")
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
                    http.client.HTTPException) as e:
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
            # request, and whether it opened the payloads depends on where it failed; 401/403
            # (API key), 411/413 (body refused) come before any handler reads the payloads
            kw["opened"] = False if reached is False or status in (401, 403, 411, 413) else (
                False if NO_SESSION_MARK in text else None)
        return error(msg, **kw)

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, text = self.request(method, path, body, **kw)
        return json_or_text(text)


class NotFound(Exception):
    def __init__(self, error: SGLangError) -> None:
        super().__init__(str(error))
        self.error = error


def json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text
