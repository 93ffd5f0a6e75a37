"""``/flush_cache`` of `fsdp-sync serve`, as SGLang 0.5.23 answers it; a mixin of `serve.EngineServer`:

    GET|POST /flush_cache[?timeout=SECONDS]

Done only while no request runs or waits (the engine's ``flush_cache``, `scheduler.Scheduler.idle`):
200 with SGLang's text (`FLUSHED`); otherwise refused at once, 400 with SGLang's bare text,
``Flush cache failed.`` and a newline. SGLang's ``timeout`` query parameter (seconds, >= 0, default
0) waits up to that long for the engine to be idle (400 ``Timed out waiting for idle state.`` past
it; a second such flush while one waits: 400 ``Another flush_cache is already in progress.``).
Neither holds new ``/generate`` requests back while it waits: they are admitted as SGLang admits
them. The three refusals' bodies and statuses are SGLang's (``http_server.flush_cache``: the
scheduler's message, or ``Flush cache failed.``), so a client that reads SGLang's answer reads
serve's; why this engine refused (the requests running, paused in place, ...) is in the
`DETAIL_HEADER` header and the log, not the body. Its wait for the engine itself (an update
holding it) ends at ``update_wait_s`` past the timeout: 503 JSON, nothing done (SGLang has no such
wait); a bad ``timeout`` is a 400 JSON naming it (SGLang 0.5.23's validation answers 400 too, its
FastAPI 422 turned into 400, in its ``{"object": "error", "message", "code"}`` shape).

Not here: the server and its error statuses (`serve`, `http_fields`), the engine's side
(`memory_calls`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..base import DETAIL_HEADER, EngineStateError, EngineUnavailableError
from .http_fields import Refused, accepted_kwargs

__all__ = ["CacheRoutes", "FLUSHED", "REFUSED", "sglang_refusal"]

log = logging.getLogger("fsdp_sync.engines.reference.serve")

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
           "waiting requests, the operation will not be performed.)\n")
"""The body of a flush done: SGLang 0.5.23's (``http_server.flush_cache``), status 200."""

REFUSED = "Flush cache failed.\n"
"""The body of a flush refused because requests run or wait: SGLang's, status 400."""

_SCHEDULER_WORDS = ("Another flush_cache is already in progress.", "Timed out waiting for idle state.")
"""SGLang's scheduler's refusals (``SchedulerFlushWrapper``), which its server answers as the body."""


def sglang_refusal(message: str) -> str:
    """SGLang's body for a flush the engine refused with ``message`` (`scheduler.Scheduler.idle`'s
    words): the scheduler's own sentence where it has one, else `REFUSED`."""
    for words in _SCHEDULER_WORDS:
        if words.rstrip(".") in message:
            return words
    return REFUSED


def timeout_param(path: str) -> float:
    """SGLang's ``timeout`` query parameter of ``path`` (a float >= 0, 0 when absent); 400 naming
    it otherwise (as SGLang 0.5.23, whose validation handler answers 400 where FastAPI's is 422)."""
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
        except EngineStateError as exc:         # requests run or wait: SGLang's 400, its text
            detail = " ".join(str(exc).split())
            log.info("flush_cache refused: %s", detail)
            raise Refused(400, sglang_refusal(detail), headers={
                DETAIL_HEADER: detail.encode("latin-1", "replace").decode("latin-1")[:2000]},
                plain=True) from None
        return 200, FLUSHED
