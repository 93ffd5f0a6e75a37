"""The error a reference worker reports to its engine, with its kind (update / state / unavailable /
other): the engine raises `WeightUpdateError`, `EngineStateError`, `EngineUnavailableError` (the
rank holds no weights or KV cache to serve with) or `EngineError` for them.

Not here: how the engine turns it into `EngineError` subclasses (`engine`).
"""

from __future__ import annotations

__all__ = ["WorkerError", "KIND_UPDATE", "KIND_STATE", "KIND_UNAVAILABLE", "KIND_OTHER", "NOTHING_APPLIED"]

KIND_UPDATE, KIND_STATE, KIND_UNAVAILABLE, KIND_OTHER = "update", "state", "unavailable", "other"

NOTHING_APPLIED = "nothing was applied on this rank"
"""Said by a commit that failed while it copied a staging transaction's update aside: the rank's
weights are as they were, so the engine aborts the transaction instead of calling itself broken."""


class WorkerError(Exception):
    """An error to report to the engine with its kind (update / state / unavailable / other)."""

    def __init__(self, kind: str, message: str, name: str | None = None):
        super().__init__(message)
        self.kind, self.name = kind, name
