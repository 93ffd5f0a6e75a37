"""The error a reference worker reports to its engine, with its kind (update / state / other).

Not here: how the engine turns it into `EngineError` subclasses (`engine`).
"""

from __future__ import annotations

__all__ = ["WorkerError", "KIND_UPDATE", "KIND_STATE", "KIND_OTHER"]

KIND_UPDATE, KIND_STATE, KIND_OTHER = "update", "state", "other"


class WorkerError(Exception):
    """An error to report to the engine with its kind (update / state / other)."""

    def __init__(self, kind: str, message: str, name: str | None = None):
        super().__init__(message)
        self.kind, self.name = kind, name
