"""The cache flush after a verl sync, retried as verl's own server adapter retries it.

An engine refuses ``flush_cache`` while requests run or wait (SGLang answers 400 "Flush cache
failed"; the reference engine and ``fsdp-sync serve`` refuse alike). The adapter's update calls
ask for no flush of their own (one flush after the last bucket, not one per call), so this one is
the only one: tried ``ATTEMPTS`` times ``DELAY_S`` apart (verl 0.9's ``AsyncHttpServerAdapter``
counts), and past them the sync fails (`SyncError`). verl's own adapter only logs there, but its
every ``update_weights_from_tensor`` call flushed too (SGLang's default, the call failing when the
flush is refused); here a refusal logged and passed over would leave a prefix cache of KV computed
with the previous weights for later requests to reuse: a wrong result, never an error.

Only a refusal is tried again here: a failure the HTTP client already retried by its own bounds
(no answer within its ``timeout_s``, HTTP 429/5xx: `SGLangEngine` marks ``/flush_cache``
idempotent, and a flush done twice drops nothing more) fails the sync at once. Retried here too,
a silent server cost ``ATTEMPTS`` x the client's ``(1 + max_retries) x timeout_s`` (about 8 h
with `SGLangEngine`'s defaults; verl's own adapter gives up within 12 x 60 s).

Not here: the flush inside an update (`transport.tensor`), the engines' refusal rule.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..topology import SyncError

__all__ = ["ATTEMPTS", "DELAY_S", "flush_after_sync"]

log = logging.getLogger("fsdp_sync")

ATTEMPTS = 12
"""verl 0.9's: ``DEFAULT_MAX_ATTEMPTS`` (3) x 4, as its async adapter's flush."""
DELAY_S = 2.0
"""verl 0.9's ``DEFAULT_RETRY_DELAY``."""


def flush_after_sync(engine: Any, *, attempts: int = ATTEMPTS, delay_s: float = DELAY_S,
                     sleep: Callable[[float], None] = time.sleep) -> None:
    """``engine.flush_cache()``, tried up to ``attempts`` times ``delay_s`` apart; raises
    `SyncError` when every attempt was refused (the weights are in, the cache may not be). An
    interrupt is never swallowed."""
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            engine.flush_cache()
            return
        except Exception as exc:  # noqa: BLE001 - verl retries whatever the flush raised
            last = exc
            if _retried_by_client(exc):
                raise SyncError(
                    f"flush_cache after the sync failed ({type(exc).__name__}: {exc}); the HTTP "
                    f"client's own retries are spent, so it is not tried again: the new weights "
                    f"are loaded, but whether the engine's prefix cache (KV computed with the "
                    f"previous weights) was dropped is unknown. Check the server (hung, or "
                    f"restarted: then it holds its launch weights), and flush the cache (POST "
                    f"/flush_cache) before generating") from exc
            log.warning("fsdp_sync: flush_cache after the sync refused (attempt %d of %d): %s: %s",
                        attempt, attempts, type(exc).__name__, exc)
        if attempt < attempts:
            sleep(delay_s)
    raise SyncError(
        f"flush_cache after the sync was refused {attempts} times, {delay_s:g} s apart (last: "
        f"{type(last).__name__}: {last}): the new weights are loaded, but the engine's prefix cache "
        f"may still hold KV computed with the previous ones, which later requests would reuse. "
        f"Requests kept running through the sync (verl's rollout modes send none then): stop "
        f"what sends them, and flush the cache (POST /flush_cache) before generating") from last


def _retried_by_client(exc: BaseException) -> bool:
    """Whether ``exc`` is an HTTP failure `SGLangEngine`'s client retries itself for an idempotent
    call (no answer, or HTTP 429/5xx) rather than a refusal (HTTP 400: requests still run)."""
    from ..engines.sglang.client import RETRY_STATUS, SGLangHTTPError   # loaded where one is raised
    return isinstance(exc, SGLangHTTPError) and (exc.status is None or exc.status in RETRY_STATUS)
