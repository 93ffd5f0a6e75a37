"""The fault hook: `fault_point`, which ``FSDP_SYNC_FAULT`` turns on (tests and tooling only).

``FSDP_SYNC_FAULT="<side>:<rank>:<point>:<kind>"`` in a
process's environment makes `fault_point(side, rank, point)` act once, the first time it is reached:

    side   ``trainer`` (the manager's stage runner: every entry and exit stage, e.g. ``sync_weights``,
           ``restore_rng``) or ``worker`` (a reference-engine worker, on a command: ``stage``,
           ``stage_broadcast``, ``commit``, ``resume:weights``, ``resume:kv_cache``, ``release`` …;
           a point given without ``:tags`` matches every tag list)
    rank   the trainer's global rank, or the worker's TP rank
    kind   ``kill`` (SIGKILL itself), ``raise`` (`InjectedFault` at that point), ``stall`` (sleep
           ``FSDP_SYNC_FAULT_STALL_S``, default 3600 s: only timeouts get the others out)

``FSDP_SYNC_FAULT_AFTER=<n>``: the point is passed the first ``n`` times it is reached (default 0),
so a fault can land in a later sync than the first.
``FSDP_SYNC_FAULT_LOG=<path>``: the wall time and pid are appended there just before it acts.
Without ``FSDP_SYNC_FAULT`` the hook is one dict lookup. Nothing of torch is patched.

The manager's stage runner and the reference engine's worker call it; the matrix that sets it
(``fsdp-sync faults``) lives in `fsdp_sync.cli.faults`, not here.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["fault_point", "InjectedFault", "FAULT_ENV"]

FAULT_ENV = "FSDP_SYNC_FAULT"
_fired: set[str] = set()
_passed: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def fault_point(side: str, rank: int, point: str) -> None:
    """Act on ``FSDP_SYNC_FAULT`` if it names this side, rank and point (once per process)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or spec in _fired:
        return
    try:
        s_side, s_rank, rest = spec.split(":", 2)
        s_point, kind = rest.rsplit(":", 1)
        s_rank = int(s_rank)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected '<trainer|worker>:<rank>:<point>:<kill|raise|stall>'")
    if s_side != side or s_rank != rank or not (point == s_point or point.startswith(s_point + ":")):
        return
    after = os.environ.get("FSDP_SYNC_FAULT_AFTER", "0")
    if not after.isdigit():
        raise ValueError(f"FSDP_SYNC_FAULT_AFTER={after!r}: expected a count of passes (0, 1, ...)")
    if _passed.get(spec, 0) < int(after):
        _passed[spec] = _passed.get(spec, 0) + 1
        return
    _fired.add(spec)
    log = os.environ.get("FSDP_SYNC_FAULT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{time.time()} {os.getpid()} {kind}\n")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise InjectedFault(f"injected fault: {side} {rank} at {point}")
    elif kind == "stall":
        time.sleep(float(os.environ.get("FSDP_SYNC_FAULT_STALL_S", "3600")))
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault kind {kind!r} (kill, raise, stall)")
