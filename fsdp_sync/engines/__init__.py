"""Rollout engines: the `Engine` protocol (`base`) and the built-in TP `ReferenceEngine`.

`ReferenceEngine` is imported lazily so that ``import fsdp_sync.engines.base`` stays light; the
SGLang adapter lives in `fsdp_sync.engines.sglang` and is never imported from here.
"""

from importlib import import_module

from .base import (Engine, EngineClosedError, EngineError, EngineStateError, EngineUnavailableError,
                   SerializedPerRank, WeightUpdateError, WorkerDiedError, checksum_named_tensors)

__all__ = ["Engine", "ReferenceEngine", "SerializedPerRank", "EngineError", "WeightUpdateError",
           "WorkerDiedError", "EngineStateError", "EngineUnavailableError", "EngineClosedError",
           "checksum_named_tensors"]


def __getattr__(name: str):
    if name == "ReferenceEngine":
        return import_module(".reference.engine", __name__).ReferenceEngine
    raise AttributeError(f"module 'fsdp_sync.engines' has no attribute {name!r}")
