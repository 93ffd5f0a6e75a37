"""``/flush_cache`` of `fsdp-sync serve`, as SGLang 0.5.23 answers it; a mixin of `serve.EngineServer`:

    GET|POST /flush_cache[?timeout=SECONDS]

Done only while no request runs or waits (the engine's ``flush_cache``, `scheduler.Scheduler.idle`):
200 ``Cache flushed.``; otherwise refused at once, 400 with SGLang's "Flush cache failed" in the
message. SGLang's ``timeout`` query parameter (seconds, >= 0, default 0) waits up to that long for
the engine to be idle (400 "Timed out waiting for idle state" past it; a second such flush while
one waits: 400 "Another flush_cache is already in progress"). Neither holds new ``/generate``
requests back while it waits: they are admitted as SGLang admits them. Its wait for the engine
itself (an update holding it) ends at ``update_wait_s`` past the timeout: 503, nothing done.

A refusal is JSON ``{"success": false, "message", "retryable": true}`` (the same flush may succeed
once the requests end), where SGLang answers the bare text; its status is SGLang's.

Not here: the server and its error statuses (`serve`, `http_fields`), the engine's side
(`memory_calls`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..base import EngineStateError, EngineUnavailableError
from .http_fields import Refused, accepted_kwargs

__all__ = ["CacheRoutes", "FLUSHED"]

FLUSHED = "Cache flushed.\n"
"""The body of a flush done (SGLang's first line)."""


def timeout_param(path: str) -> float:
    """SGLang's ``timeout`` query parameter of ``path`` (a float >= 0, 0 when absent); 400 naming
    it otherwise (FastAPI answers 422 there)."""
    values = parse_qs(urlsplit(path).query, keep_blank_values=True).get("timeout")
    if not values:
        return 0.0
    if len(values) > 1:
        raise Refused(400, f"query parameter 'timeout' given {len(values)} times; give it once")
    try:
        t = float(values[0])
    except ValueError:
        t = math.nan
    if not 0 <= t < math.inf:
        raise Refused(400, f"query parameter 'timeout' must be a number of seconds >= 0, got "
                           f"{values[0][:40]!r}")
    return t


class CacheRoutes:
    """`EngineServer`'s ``/flush_cache`` (it provides ``engine``, ``_method`` and ``update_wait_s``)."""

    def _flush_cache(self, body: dict, path: str) -> tuple[int, Any]:
        timeout = timeout_param(path)
        fn = self._method("flush_cache")
        kwargs = accepted_kwargs(fn, {"timeout_s": timeout})
        if timeout > 0 and not kwargs:
            raise Refused(400, f"query parameter 'timeout': this engine ({type(self.engine).__name__})"
                               f" cannot wait for idle; flush without it")
        limit = getattr(self.engine, "wait_limit", None)
        try:
            with limit(self.update_wait_s + timeout) if callable(limit) else contextlib.nullcontext():
                fn(**kwargs)
        except EngineUnavailableError:
            raise                               # busy past the limit, out of service: 503
        except EngineStateError as exc:         # requests run or wait: SGLang's 400
            return 400, {"success": False, "message": str(exc), "retryable": True}
        return 200, FLUSHED
