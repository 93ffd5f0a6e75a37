"""Configuration as frozen dataclasses, validated on construction.

`SyncConfig` is what the sharding manager runs by. `SyncConfig.from_verl(cfg)` maps the keys verl
users already write (``actor_rollout_ref.rollout.*``) onto it; `SyncConfig.from_dict` takes a plain
mapping (a YAML recipe loaded with OmegaConf).

Not here: anything that touches a process group, a module or an engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

__all__ = ["SyncConfig", "STRATEGIES", "FSDP1_STATE_DICTS", "METHODS", "DISTRIBUTED_FORMATS",
           "parse_dtype"]

METHODS = ("tensor", "distributed", "disk")
DISTRIBUTED_FORMATS = ("flattened_bucket", "per_tensor")
STRATEGIES = ("per_tensor", "bucketed", "flattened")
FSDP1_STATE_DICTS = ("full", "sharded", "local")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown rollout dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class SyncConfig:
    """How one weight sync runs.

    method: the SGLang update method: ``"tensor"`` (default: colocated, handle tuples through
        ``update_weights_from_tensor``), ``"distributed"`` (disaggregated: a broadcast from trainer
        rank 0 over SGLang's weight-update group, ``update_weights_from_distributed``) or
        ``"disk"`` (a versioned checkpoint, ``update_weights_from_disk``).
    strategy: (tensor method) ``"flattened"`` (default: one handle per bucket), ``"bucketed"`` (one engine call per
        bucket, one handle per tensor) or ``"per_tensor"`` (one parameter, handle and engine call at
        a time: the algorithm verl shipped, kept as the baseline).
    bucket_bytes: byte budget of a bucket (a larger tensor gets a bucket of its own).
    dtype: the rollout dtype parameters are cast to; None keeps the trainer's dtype.
    multi_stage_wake_up: resume weights → sync → offload trainer params → resume kv_cache (on), or
        resume everything, then sync (off).
    free_cache_engine: release the engine's memory on exit and resume it on entry.
    offload_params: move trainer parameters off the accelerator during rollout.
    fsdp1_state_dict: the FSDP1 state-dict type used for export (full / sharded / local).
    seed: generation RNG seed base; dp rank r generates with ``seed + r`` (same on every TP rank).
    share_host_memory: for ``flattened``, when the trainer ranks of the FSDP group share a host and
        hold CPU shards (even dim-0 splits): no all-gather; the ranks write their shards into one
        host-shared buffer that the engine workers open (`export.iter_buckets`). Off, or where it
        does not apply, every rank all-gathers each bucket over the process group.
    memory_probe: what the stage timeline records after each stage: ``"full"`` (RSS, peak RSS,
        anonymous and shared-memory RSS, USS and PSS of the trainer rank and of each engine worker;
        a few ms per process and stage), ``"rss"`` (the /proc status figures only, ~50 µs) or
        ``"off"``. CUDA allocator figures are added whenever CUDA is in use.
    dist_format: (distributed method) ``"flattened_bucket"`` (default: one broadcast per bucket,
        SGLang's tight layout) or ``"per_tensor"`` (``load_format=None``: one broadcast per
        tensor, the baseline).
    dist_master_address / dist_master_port: where trainer rank 0 hosts the update group's store;
        None: trainer rank 0's outward IP address (127.0.0.1 on a host without a network) and a
        free port.
    dist_backend: the update group's backend; None: ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
    dist_group_name: the group's name, the same on both ends (SGLang's default).
    dist_timeout_s: how long trainer rank 0 waits for the engines to join the group or to receive
        a broadcast; a refusal from an engine is reported at once, not after this.
    """

    strategy: str = "flattened"
    bucket_bytes: int = 512 << 20
    dtype: torch.dtype | None = None
    multi_stage_wake_up: bool = True
    free_cache_engine: bool = True
    offload_params: bool = False
    fsdp1_state_dict: str = "full"
    seed: int = 1000
    memory_probe: str = "full"
    share_host_memory: bool = True
    method: str = "tensor"
    dist_format: str = "flattened_bucket"
    dist_master_address: str | None = None
    dist_master_port: int | None = None
    dist_backend: str | None = None
    dist_group_name: str = "weight_update_group"
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.dist_format not in DISTRIBUTED_FORMATS:
            raise ValueError(f"dist_format must be one of {DISTRIBUTED_FORMATS}, got {self.dist_format!r}")
        if self.dist_master_port is not None and not (isinstance(self.dist_master_port, int)
                                                      and 0 < self.dist_master_port < 65536):
            raise ValueError(f"dist_master_port must be a port number (1-65535) or None, "
                             f"got {self.dist_master_port!r}")
        if not self.dist_group_name:
            raise ValueError("dist_group_name must not be empty")
        if not (isinstance(self.dist_timeout_s, (int, float)) and self.dist_timeout_s > 0):
            raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {self.dist_timeout_s!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.fsdp1_state_dict not in FSDP1_STATE_DICTS:
            raise ValueError(f"fsdp1_state_dict must be one of {FSDP1_STATE_DICTS}, "
                             f"got {self.fsdp1_state_dict!r}")
        if self.memory_probe not in ("full", "rss", "off"):
            raise ValueError(f"memory_probe must be 'full', 'rss' or 'off', got {self.memory_probe!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    def replace(self, **changes: Any) -> "SyncConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"] = None if self.dtype is None else str(self.dtype).removeprefix("torch.")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"bucket_mb"})
        if unknown:
            raise ValueError(f"unknown SyncConfig keys {unknown}; known: {sorted(names)}")
        d = dict(d)
        if "bucket_mb" in d:
            d["bucket_bytes"] = int(float(d.pop("bucket_mb")) * 2**20)
        return cls(**d)

    @classmethod
    def from_verl(cls, cfg: Any, **overrides: Any) -> "SyncConfig":
        """Map verl's config (the whole config, ``actor_rollout_ref`` or its ``rollout``) to ours.

        Keys read: ``free_cache_engine``, ``multi_stage_wake_up``, ``dtype``,
        ``checkpoint_engine.update_weights_bucket_megabytes`` (or ``update_weights_bucket_megabytes``),
        and ``actor.fsdp_config.param_offload`` for ``offload_params``.
        """
        def get(node: Any, key: str, default: Any = None) -> Any:
            if node is None:
                return default
            if isinstance(node, Mapping):
                return node.get(key, default)
            return getattr(node, key, default)

        root = cfg
        ref = get(root, "actor_rollout_ref", root)
        rollout = get(ref, "rollout", ref)
        out: dict[str, Any] = {}
        for key in ("free_cache_engine", "multi_stage_wake_up"):
            v = get(rollout, key)
            if v is not None:
                out[key] = bool(v)
        dt = get(rollout, "dtype")
        if dt is not None:
            out["dtype"] = parse_dtype(dt)
        mb = get(get(rollout, "checkpoint_engine"), "update_weights_bucket_megabytes",
                 get(rollout, "update_weights_bucket_megabytes"))
        if mb is not None:
            out["bucket_bytes"] = int(float(mb) * 2**20)
        offload = get(get(get(ref, "actor"), "fsdp_config"), "param_offload")
        if offload is not None:
            out["offload_params"] = bool(offload)
        out.update(overrides)
        return cls(**out)
