"""fsdp_sync: FSDP → rollout-engine weight sync, bit-exact, bucketed, within a known memory budget.

Public API (everything else is an implementation module you may import at your own risk):

    FSDPShardingManager(module, engine, mesh=..., config=SyncConfig(...))  # `with` it around rollout
    SyncConfig                     # frozen config: strategy, bucket_bytes, dtype, multi_stage_wake_up…
    make_mesh(dp, infer_tp)        # the ("dp", "infer_tp") DeviceMesh the manager runs on
    SyncTopology, SyncError        # who is infer-TP rank 0; the error every rank raises on a failure
    SyncStats                      # what the last sync moved (manager.stats): seconds, bytes, buckets…
    engines.ReferenceEngine        # the built-in TP engine (CPU and CUDA)
    engines.sglang.SGLangEngine    # adapter for an in-process sglang.Engine or an SGLang server

Attributes load lazily so that `import fsdp_sync.weights.handles` stays light.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "FSDPShardingManager": ".manager",
    "SyncStats": ".transport",
    "SyncConfig": ".config",
    "make_mesh": ".topology",
    "SyncTopology": ".topology",
    "SyncError": ".topology",
}

__all__ = sorted(_LAZY) + ["__version__"]
_SUBPACKAGES = ("engines", "weights", "transport")


def __dir__() -> list[str]:
    """The public API (loaded lazily) for dir() and completion, not the loader's helpers."""
    return sorted(set(__all__) | set(_SUBPACKAGES))


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fsdp_sync' has no attribute {name!r}")
