"""The cache flush after a verl sync, retried as verl's own server adapter retries it.

An engine refuses ``flush_cache`` while requests run or wait (SGLang answers 400 "Flush cache
failed"; the reference engine and ``fsdp-sync serve`` refuse alike). The sync's last update call
already asked for the flush; the one after it is verl's belt and braces, and verl 0.9's
``AsyncHttpServerAdapter.flush_cache`` (what its SGLang rollout awaits after an update) tries it
``max_attempts * 4`` times with ``retry_delay`` between, then logs an error and goes on: the weights
are in, only a prefix cache may outlive them. The verl
adapter does the same here (`flush_after_sync`), where it used to fail the whole step on the first
refusal after every byte had been applied.

Not here: the flush inside an update (`transport.tensor`), the engines' refusal rule.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

__all__ = ["ATTEMPTS", "DELAY_S", "flush_after_sync"]

log = logging.getLogger("fsdp_sync")

ATTEMPTS = 12
"""verl 0.9's: ``DEFAULT_MAX_ATTEMPTS`` (3) x 4, as its async adapter's flush."""
DELAY_S = 2.0
"""verl 0.9's ``DEFAULT_RETRY_DELAY``."""


def flush_after_sync(engine: Any, *, attempts: int = ATTEMPTS, delay_s: float = DELAY_S,
                     sleep: Callable[[float], None] = time.sleep) -> bool:
    """``engine.flush_cache()``, tried up to ``attempts`` times ``delay_s`` apart; True once it
    went through, False (logged as an error, as verl does) when every attempt was refused. An
    interrupt is never swallowed."""
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            engine.flush_cache()
            return True
        except Exception as exc:  # noqa: BLE001 - verl retries whatever the flush raised
            last = exc
            log.warning("fsdp_sync: flush_cache after the sync refused (attempt %d of %d): %s: %s",
                        attempt, attempts, type(exc).__name__, exc)
        if attempt < attempts:
            sleep(delay_s)
    log.error("fsdp_sync: flush_cache after the sync was refused %d times (last: %s: %s); the "
              "weights are updated, a prefix cache of requests that were running may outlive them "
              "(verl's own adapter goes on the same way)", attempts, type(last).__name__, last)
    return False
