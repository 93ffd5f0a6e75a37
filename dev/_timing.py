"""The one helper dev/'s profilers share: time every call of a function by wrapping it in place."""

from __future__ import annotations

import time
from typing import Any


def timed(acc: dict, owner: Any, name: str, key: str | None = None) -> None:
    """Replace ``owner.name`` with a wrapper that adds each call's seconds to ``acc[key or name]``
    (``acc`` a ``defaultdict(float)``); one clock read on each side of the call."""
    fn = getattr(owner, name)

    def run(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            acc[key or name] += time.perf_counter() - t0
    setattr(owner, name, run)
