"""The built-in reference engine: a tensor-parallel rollout engine that speaks SGLang's API.

Holds the engine client (`engine`), the worker process it starts per TP rank (`worker`) and the
worker's collaborators (`staging`: weight updates; `regions`: memory release/resume), the TP model
(`tp_model`), process start (`procs`), generation (`generation`), the request scheduler
(`scheduler`: continuous batching, pause modes, weight versions) and the SGLang-compatible HTTP
server (`serve`, `serve_control`, `http_fields`, `generate_request`).
Not here: the `Engine` protocol (`engines.base`), the SGLang adapter (`engines.sglang`), the
`fsdp-sync serve` command and its flags (`fsdp_sync.cli.serve`).

`ReferenceEngine` is imported lazily so that a worker process importing
``fsdp_sync.engines.reference.worker`` does not load the client.
"""

from importlib import import_module

__all__ = ["ReferenceEngine"]


def __getattr__(name: str):
    if name == "ReferenceEngine":
        return import_module(".engine", __name__).ReferenceEngine
    raise AttributeError(f"module 'fsdp_sync.engines.reference' has no attribute {name!r}")
