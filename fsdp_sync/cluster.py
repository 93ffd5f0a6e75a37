"""The machines a sync is planned for (`Cluster`): GPUs per node, memory per GPU, the bandwidth of
each link, per-call overheads and the costs that bytes do not explain; the presets (`CLUSTERS`:
H100 and H200 nodes, spec-sheet figures) and `load_cluster` (a preset, a JSON file or a mapping).

Not here: planning a sync on one (`fsdp_sync.plan`), measuring this machine (``fsdp-sync plan
--cluster this-machine``, `fsdp_sync.cli.plan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "CLUSTERS", "load_cluster"]


@dataclass(frozen=True)
class Cluster:
    """What the estimate needs to know of the machines. Bandwidths in GB/s (1e9 bytes) per GPU,
    one direction; ``d2d_gbps``: one copy on one device (it reads and writes each byte);
    ``call_s``: one engine call's overhead; ``collective_s``: one collective's latency (a small
    object gathered to one rank, as the tensor method gathers its handles).

    Costs a GPU cluster does not have, measured on a CPU host and 0 (not priced) elsewhere:
    ``cores``: the host's CPUs, shared by every trainer rank and engine worker (0: each has a
    device of its own): with more processes than cores a pipelined method's phases cannot
    overlap. ``touch_gbps``: the rate at which fresh memory becomes resident on first touch (the
    sync's buffers, made each sync and freed after it; CUDA's caching allocator hands out memory
    that is already mapped). ``map_gbps``: the rate at which a process maps the pages of a buffer
    another process shared with it (an engine worker opening a bucket's handle).
    ``collective_gbps``: what a rank receives per second in the trainer's gather, all-gather and
    all-to-all (0: the link's rate; gloo's all-gather runs far below a point-to-point send).

    What bytes do not explain, measured by real syncs (``--cluster this-machine``, on its CPU or
    its GPU) and 0 (not priced) in the presets, which have no such measurement: ``tensor_s``:
    each tensor of a sync (its packing on the trainer, its load in the engine: host work and,
    on a GPU, kernel launches); ``bucket_s``: each bucket's engine call of the tensor method
    (handles made and gathered, opened, loaded, acknowledged, agreed; 0: ``call_s`` + 2
    collectives); ``sync_s``: each sync once (the engine's update bracket, the layout agreed);
    ``quantize_gbps`` and ``quantize_tensor_s``: the FP8 bucket quantizer on the trainer's device,
    bytes of the rollout dtype through it per second and each quantized tensor's own cost (its
    kernels' launches), priced for rows with ``quantization``."""

    name: str
    device: str                    # "cuda" or "cpu" (this machine: one host, shards in host memory)
    gpus_per_node: int
    memory_per_gpu: int            # bytes
    d2d_gbps: float
    intra_gbps: float              # between GPUs of one node (NVLink), per GPU
    inter_gbps: float              # between nodes (one NIC per GPU), per GPU
    disk_write_gbps: float         # one node's checkpoint disk, write + fsync
    disk_read_gbps: float
    call_s: float
    collective_s: float
    source: str = ""               # where each figure comes from
    cores: int = 0
    touch_gbps: float = 0.0
    map_gbps: float = 0.0
    collective_gbps: float = 0.0
    tensor_s: float = 0.0
    bucket_s: float = 0.0
    sync_s: float = 0.0
    quantize_gbps: float = 0.0
    quantize_tensor_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in (str, "str"):
                if not isinstance(v, str):
                    raise ValueError(f"cluster {f.name} must be a string, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"cluster {f.name} must be a finite number, got {v!r}")
            elif f.type in (int, "int"):
                if v != int(v):          # JSON's 80e9 is a float: a whole one is the integer
                    raise ValueError(f"cluster {f.name} must be a whole number, got {v!r}")
                object.__setattr__(self, f.name, int(v))
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"cluster device must be cuda or cpu, got {self.device!r}")
        for f in ("gpus_per_node", "memory_per_gpu", "d2d_gbps", "intra_gbps", "inter_gbps",
                  "disk_write_gbps", "disk_read_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"cluster {f} must be > 0, got {getattr(self, f)!r}")
        for f in ("cores", "touch_gbps", "map_gbps", "collective_gbps", "tensor_s", "bucket_s", "sync_s",
                  "quantize_gbps", "quantize_tensor_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"cluster {f} must be >= 0 (0: not priced), got {getattr(self, f)!r}")
        if self.call_s < 0 or self.collective_s < 0:
            raise ValueError(f"cluster call_s and collective_s must be >= 0, got {self.call_s}, "
                             f"{self.collective_s}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SPEC = ("nominal spec-sheet figures, not measured: HBM {hbm} TB/s (a copy reads and writes: "
         "d2d = HBM / 2), NVLink 4 900 GB/s both ways (450 GB/s one way per GPU), one 400 Gb/s "
         "InfiniBand NIC per GPU (50 GB/s); assumed: a node-local NVMe checkpoint disk of "
         "5 GB/s write and 10 GB/s read, 2 ms per engine call (an SGLang HTTP/RPC round trip), "
         "30 us per collective")
# memory per GPU: what torch reports (``total_memory``, what SGLang's --mem-fraction-static is a
# fraction of and what ``--cluster this-machine`` stores), not the "80 GB" / "141 GB" of the spec
# sheets read as 10**9 bytes (74.5 and 131.3 GiB: 5 and 8.5 GiB short, and buckets that fit were
# refused). H100 80GB HBM3: 81,082 MiB, the least torch reports (81,082-81,090 MiB across
# drivers), 79.2 GiB; H200: 150,109,880,320 bytes, 139.8 GiB, measured here
# (docs/data/issue35-h200/run1/this_machine.json)
_MEMORY = "; memory per GPU: torch's total_memory of the card ({gib} GiB)"
CLUSTERS: dict[str, Cluster] = {
    "h100-node": Cluster("h100-node", "cuda", 8, 81_082 * 2**20, 3350 / 2, 450.0, 50.0, 5.0, 10.0,
                         2e-3, 30e-6, _SPEC.format(hbm=3.35) + _MEMORY.format(gib=79.2)),
    "h200-node": Cluster("h200-node", "cuda", 8, 150_109_880_320, 4800 / 2, 450.0, 50.0, 5.0, 10.0,
                         2e-3, 30e-6, _SPEC.format(hbm=4.8) + _MEMORY.format(gib=139.8)),
}
"""Presets. ``this-machine`` is measured by the CLI (`fsdp_sync.cli.plan`), not stored here."""


def load_cluster(spec: str | Path | dict | Cluster) -> Cluster:
    """A `Cluster` from a preset name, a JSON file (the fields of `Cluster`, or a plan's JSON
    whose ``cluster`` holds them) or a mapping. ValueError says what is wrong, naming the field
    and the value (the caller names the file): not JSON, no mapping, a field missing, unknown or
    of the wrong type (``"memory_per_gpu": "80e9"``)."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, dict):
        d = spec
    elif str(spec) in CLUSTERS:
        return CLUSTERS[str(spec)]
    elif Path(spec).is_file():
        try:
            d = json.loads(Path(spec).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a cluster JSON file: {exc}") from None
        if isinstance(d, dict) and isinstance(d.get("cluster"), dict):
            d = d["cluster"]
    else:
        raise ValueError(f"unknown cluster {str(spec)!r}: expected one of {sorted(CLUSTERS)}, "
                         f"this-machine, or a JSON file with the fields of Cluster")
    if not isinstance(d, dict):
        raise ValueError(f"expected a mapping of the fields of Cluster, got a {type(d).__name__}")
    fields = dataclasses.fields(Cluster)
    unknown = sorted(set(d) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"unknown cluster fields {unknown}; known: {sorted(f.name for f in fields)}")
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in d]
    if missing:
        raise ValueError(f"cluster fields missing: {missing} (each is required)")
    return Cluster(**d)
