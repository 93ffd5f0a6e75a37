"""Configuration as frozen dataclasses, validated on construction.

`SyncConfig` is what the sharding manager runs by. `SyncConfig.from_verl(cfg)` maps the keys verl
users already write (``actor_rollout_ref.rollout.*``) onto it; `SyncConfig.from_dict` takes a plain
mapping (a YAML recipe loaded with OmegaConf).

Not here: anything that touches a process group, a module or an engine.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from .weights.fp8 import QUANTIZATIONS
from .weights.hf_checkpoint import DEFAULT_HASH, HASHES as DISK_HASHES

__all__ = ["SyncConfig", "STRATEGIES", "LAYOUTS", "REPLICA_FAILURE_MODES", "PAUSE_MODES", "FSDP1_STATE_DICTS", "METHODS", "DISTRIBUTED_FORMATS",
           "VERIFY_MODES", "DISK_HASHES", "QUANTIZATIONS", "parse_dtype", "auto_dtype", "parse_bool",
           "mib_to_bytes"]

METHODS = ("tensor", "distributed", "disk")
DIST_BACKENDS = ("gloo", "nccl")
DISTRIBUTED_FORMATS = ("flattened_bucket", "per_tensor")
VERIFY_MODES = ("off", "sample", "full")
LORA_MODES = ("off", "adapter")
STRATEGIES = ("per_tensor", "bucketed", "flattened")
LAYOUTS = ("auto", "full", "engine")
REPLICA_FAILURE_MODES = ("abort", "quarantine")
PAUSE_MODES = (None, "abort", "retract", "in_place")
FSDP1_STATE_DICTS = ("full", "sharded", "local")
MIN_TIMEOUT_S = 1.0     # dist_timeout_s's least: see SyncConfig.__post_init__
MAX_TIMEOUT_S = 1e9     # dist_timeout_s's most: ~31 years; a socket's or lock's timeout overflows past ~9.2e9
VERL_BUCKET_MB = 2048   # verl 0.9's checkpoint_engine.update_weights_bucket_megabytes default
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# SGLang's names for a model config's dtype (model_config._STR_DTYPE_TO_TORCH_DTYPE)
_SGLANG_DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32,
                  "float32": torch.float32, "bfloat16": torch.bfloat16}
_SUB_CONFIGS = ("text_config", "llm_config", "language_config", "thinker_config")


_TRUE, _FALSE = ("true", "yes", "on", "1", "y", "t"), ("false", "no", "off", "0", "n", "f")


def parse_dtype(value: Any, field: str = "dtype", *, hf_config: Any = None) -> torch.dtype | None:
    """A rollout dtype (float32, bfloat16, float16, by dtype or name, SGLang's ``half`` and
    ``float`` too); None keeps the trainer's. ``"auto"`` is the dtype SGLang serves the model in
    (`auto_dtype` of ``hf_config``, the model's Hugging Face config), refused without one."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"{field}: unsupported rollout dtype {value}; expected one of "
                             f"float32, bfloat16, float16 (or None to keep the trainer's)")
        return value
    key = str(value).removeprefix("torch.").lower()
    if key == "auto":
        if hf_config is None:
            raise ValueError(f"{field}='auto' is the dtype SGLang reads from the model's config, "
                             f"which is not at hand here; set {field} to the dtype the engine "
                             f"serves: bfloat16, float16 or float32")
        return parse_dtype(auto_dtype(hf_config, field), field)
    if key not in _DTYPES:
        raise ValueError(f"{field}: unknown rollout dtype {value!r}; expected one of "
                         f"{sorted(_DTYPES) + ['auto']}")
    return _DTYPES[key]


def auto_dtype(hf_config: Any, field: str = "dtype") -> torch.dtype:
    """The dtype SGLang serves a model in under ``--dtype auto`` (SGLang 0.5.x,
    ``configs/hf_config._get_and_verify_dtype``): the config's ``dtype`` (transformers 4:
    ``torch_dtype``; a name SGLang does not know, or none, counts as float32), except that a
    float32 model is served in float16 (bfloat16 for a Gemma); a ``Llava*ForCausalLM`` in float16.
    A config with a language sub-config (a multimodal model: ``text_config`` ...) is refused:
    SGLang reads the dtype from the sub-config by rules that differ between its releases."""
    subs = [k for k in _SUB_CONFIGS if getattr(hf_config, k, None) is not None]
    if subs:
        raise ValueError(f"{field}='auto' for a model whose config has {subs[0]}: SGLang takes "
                         f"that sub-config's dtype by rules that differ between its releases; set "
                         f"{field} to the dtype the engine serves: bfloat16, float16 or float32")
    arch = (getattr(hf_config, "architectures", None) or [""])[0] or ""
    if arch.startswith("Llava") and arch.endswith("ForCausalLM"):
        return torch.float16
    dt = getattr(hf_config, "dtype", None)
    if dt is None:                 # transformers 4 (read without its v5 deprecation warning)
        dt = getattr(hf_config, "__dict__", {}).get("torch_dtype")
    if isinstance(dt, str):
        dt = _SGLANG_DTYPES.get(dt)
    if dt is None:
        dt = torch.float32
    if dt == torch.float32:
        model_type = str(getattr(hf_config, "model_type", "") or "")
        return torch.bfloat16 if model_type.startswith("gemma") else torch.float16
    return dt


def parse_bool(value: Any, field: str) -> bool:
    """A real bool, or a YAML/verl spelling of one (true/false, yes/no, on/off, 1/0); anything
    else is refused with the field named (``bool("no")`` is True: never coerce)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{field} must be a bool (or true/false, yes/no, on/off, 1/0), got {value!r}")


def mib_to_bytes(value: Any, field: str) -> int:
    """``value`` MiB (a number, or its text: YAML and verl spell it either way) as whole bytes, at
    least 1: a bool, text that is no number, NaN, infinity, 0, a negative size or one under a
    byte (``int(1e-7 * 2**20)`` is 0) is refused naming ``field``."""
    try:
        mb = float(value) if not isinstance(value, bool) else float("nan")
    except OverflowError:             # an int past float's range (10**400): no size a buffer has
        mb = float("inf")
    except (TypeError, ValueError):
        mb = float("nan")
    if not 0 < mb < float("inf"):
        raise ValueError(f"{field} must be a positive number of MiB, got {value!r}")
    if int(mb * 2**20) < 1:
        raise ValueError(f"{field} must be at least 1 byte ({1 / 2**20:.3g} MiB), got {value!r} MiB "
                         f"(0 bytes)")
    return int(mb * 2**20)


_OPTIONAL = ("dtype", "quantization", "pause_mode", "dist_master_address", "dist_master_port", "dist_backend", "disk_dir")


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
    seed: generation RNG seed base; dp rank r generates with ``seed + r`` (same on every TP rank);
        a 64-bit int, in [-2**63, 2**63).
    share_host_memory: for ``flattened``, when the trainer ranks of the FSDP group share a host and
        hold CPU shards (even dim-0 splits): no all-gather; the ranks write their shards into one
        host-shared buffer that the engine workers open (`export.iter_buckets`). Off, or where it
        does not apply, every rank all-gathers each bucket over the process group.
    memory_probe: what the stage timeline records after each stage: ``"rss"`` (the default: RSS,
        peak RSS, anonymous and shared-memory RSS of the trainer rank and of each engine worker,
        from /proc/<pid>/status, ~50 µs each), ``"full"`` (USS and PSS too, from
        /proc/<pid>/smaps_rollup: a few ms per process and stage in a torch process, 18 reads a
        sync; ask for it when you study memory) or ``"off"``. CUDA allocator figures are added
        whenever CUDA is in use.
    dist_format: (distributed method) ``"flattened_bucket"`` (default: one broadcast per bucket,
        SGLang's tight layout) or ``"per_tensor"`` (``load_format=None``: one broadcast per
        tensor, the baseline).
    dist_master_address / dist_master_port: where trainer rank 0 hosts the update group's store;
        None: trainer rank 0's outward IP address (127.0.0.1 on a host without a network) and a
        port the OS picks, listened on before any engine is told it.
    dist_backend: the update group's backend; None: ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
    dist_group_name: the group's name, the same on both ends (SGLang's default).
    dist_timeout_s: how long trainer rank 0 waits for the engines to join the group or to receive
        a broadcast; a refusal from an engine is reported at once, not after this. A failed
        opening of the group, its call-off included, ends within this (plus a second where the
        rendezvous used it all). At least 1 s (trainer rank 0's own connection to the group's
        store can take milliseconds), at most 1e9 s (a longer one overflows the waits it is used in).
    disk_dir: the disk method's directory: each sync publishes ``disk_dir/step_<N>/`` (a Hugging
        Face checkpoint) there. Required when ``method == "disk"``.
    disk_keep: how many of the newest versions the disk method keeps (>= 1; the one the engine
        loaded last is never removed).
    disk_hash: the digest of every file in the disk method's manifest, taken while the file is
        written and checked while the engine reads it: ``"xxh3_128"`` (default: XXH3-128, ~7x
        sha256 on a CPU, against torn files and flipped bits) or ``"sha256"`` (a cryptographic
        digest, for users who want one in the manifest). The manifest names the hash; a reader
        verifies with the one it names.
    verify: after each sync, compare what the engine now serves with the trainer's tensors
        (`fsdp_sync.verify`): ``"off"`` (default: it costs another export and a read-back),
        ``"sample"`` (a rotating eighth of the tensors per sync, every tensor within 8 syncs) or
        ``"full"`` (every tensor). A mismatch raises `SyncError` on every rank naming the tensor.
    layout: (tensor method, ``strategy="flattened"``) ``"engine"``: per-rank buckets
        (`fsdp_sync.weights.reshard`): each engine TP rank is handed only its own shard, in the engine's
        layout (``load_format="direct"``); the engine must accept them (``accepts_rank_buckets``:
        the reference engine; an `SGLangEngine` made with ``rank_bucket_loader=True`` for a server
        started with fsdp_sync's custom weight loader). ``"full"``: every engine rank gets every
        full tensor and cuts out its part (SGLang's default). ``"auto"`` (default): ``"engine"``
        where the engine accepts it, else ``"full"`` (the sync's stats say which ran). Method
        distributed (``dist_format="flattened_bucket"``): trainer rank 0 sends each engine TP
        rank only its own shard, point to point over the update group
        (``load_format="per_rank_bucket"``), where every engine accepts that
        (``accepts_distributed_rank_buckets``: the reference engine; not SGLang, whose
        ``update_weights_from_distributed`` broadcasts full tensors to every rank: ``"engine"``
        is refused there on every trainer rank before anything moves). The disk
        method with ``"engine"`` writes one file per engine TP rank (and bucket) holding only
        that rank's shard in the engine's layout, and each engine worker reads only its own
        (`transport.disk`); the engines must load such checkpoints (``accepts_rank_checkpoints``:
        the reference engine; SGLang 0.5.23 cannot, so ``"engine"`` is refused against an
        `SGLangEngine` on every rank before anything is written and ``"auto"`` writes a Hugging
        Face checkpoint there).
    quantization: the rollout's weight format, named as SGLang's ``--quantization``: None (default:
        every tensor in ``dtype``) or ``"fp8"``: block-wise FP8 as SGLang loads a block-FP8
        checkpoint (``weight_block_size`` [128, 128]): each linear weight SGLang quantizes travels
        as ``weight`` (float8_e4m3fn) plus ``weight_scale_inv`` (float32, one per 128x128 block),
        quantized on the trainer after the gather, bucket by bucket, for every method and layout
        (`fsdp_sync.weights.quantize`); norms, embeddings, the lm_head, biases and router gates stay
        in ``dtype``. The engine must serve the same format (the reference engine's and SGLang's
        ``quantization="fp8"``), and the model's TP split must not cut a 128 block.
    pipelined: with per-rank buckets, two buffers per TP rank: the trainer makes bucket k+1
        while the engine loads bucket k (tensor: on infer-TP rank 0 the engine call runs on a
        thread; distributed: while bucket k's sends are on the wire).
        Ignored where per-rank buckets do not run (the sync's stats say ``pipelined`` False).
    on_replica_failure: with several engines (rollout replicas; ``distributed`` and ``disk``), what
        a replica that fails during a sync does to the others (`fsdp_sync.fleet`). ``"abort"``
        (default): no replica commits the version; every trainer rank raises the same `SyncError`
        naming the replica; every replica keeps the previous version. ``"quarantine"``: the
        replica is marked out of service (its ``/health`` answers 503, so a router stops sending
        to it) and the sync is run again for the healthy replicas, which commit; the next sync or
        ``manager.recover(engine)`` brings it back at the current version.
    pause_mode: None (default: an update waits for running requests, as SGLang's does) or SGLang's
        ``/pause_generation`` mode, ``"abort"``, ``"retract"`` or ``"in_place"``: every replica is
        paused before the update and continued after it (``in_place``: requests started on
        version k finish on version k+1, their ``weight_versions`` spans say which tokens came from
        which; no update flushes the cache then, as SGLang refuses that flush while requests are
        held: 0.5.23 fails the update, its weights loaded, and 0.5.12's server dies. The disk
        method with an in-process ``sglang.Engine``, whose disk load always flushes, is refused;
        ``retract``: against SGLang before 0.5.21, whose flush fails while the retracted requests
        wait and whose scheduler then dies, refused before the pause and before any weights are sent).
    lora: ``"off"`` (default: a module holding LoRA tensors is refused) or ``"adapter"``: a
        peft-wrapped model (or one with peft-named ``base_layer`` / ``lora_A`` / ``lora_B``
        parameters) is synced as SGLang serves LoRA: the base weights once (``.base_layer.``
        and ``base_model.model.`` dropped from the names, ``lora_`` tensors left out), and again
        whenever ``manager.base_sync_done`` is set False; every other sync sends only the adapter
        (`fsdp_sync.lora_sync`) through the engine's ``load_lora_adapter_from_tensors``.
    lora_name: the adapter's name in the engine (requests pass it as ``lora_path``).
    """

    strategy: str = "flattened"
    bucket_bytes: int = 512 << 20
    dtype: torch.dtype | None = None
    multi_stage_wake_up: bool = True
    free_cache_engine: bool = True
    offload_params: bool = False
    fsdp1_state_dict: str = "full"
    seed: int = 1000
    memory_probe: str = "rss"
    share_host_memory: bool = True
    method: str = "tensor"
    dist_format: str = "flattened_bucket"
    dist_master_address: str | None = None
    dist_master_port: int | None = None
    dist_backend: str | None = None
    dist_group_name: str = "weight_update_group"
    dist_timeout_s: float = 600.0
    disk_dir: str | None = None
    disk_keep: int = 2
    disk_hash: str = DEFAULT_HASH
    verify: str = "off"
    layout: str = "auto"
    pipelined: bool = True
    quantization: str | None = None
    on_replica_failure: str = "abort"
    pause_mode: str | None = None
    lora: str = "off"
    lora_name: str = "fsdp_sync_lora"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.dist_format not in DISTRIBUTED_FORMATS:
            raise ValueError(f"dist_format must be one of {DISTRIBUTED_FORMATS}, got {self.dist_format!r}")
        if self.dist_master_port is not None and not (
                isinstance(self.dist_master_port, int) and not isinstance(self.dist_master_port, bool)
                and 0 < self.dist_master_port < 65536):
            raise ValueError(f"dist_master_port must be a port number (1-65535) or None, "
                             f"got {self.dist_master_port!r}")
        if self.dist_master_address is not None and (
                not isinstance(self.dist_master_address, str) or not self.dist_master_address):
            raise ValueError(f"dist_master_address must be a host name or IP address (a non-empty "
                             f"string) or None, got {self.dist_master_address!r}")
        if not isinstance(self.dist_group_name, str) or not self.dist_group_name:
            raise ValueError(f"dist_group_name must be a non-empty string, got {self.dist_group_name!r}")
        if self.dist_backend is not None and self.dist_backend not in DIST_BACKENDS:
            raise ValueError(f"dist_backend must be one of {DIST_BACKENDS} or None (nccl on CUDA, "
                             f"gloo on CPU), got {self.dist_backend!r}")
        if not (isinstance(self.dist_timeout_s, (int, float)) and not isinstance(self.dist_timeout_s, bool)
                and 0 < self.dist_timeout_s < float("inf")):
            raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {self.dist_timeout_s!r}")
        if self.dist_timeout_s < MIN_TIMEOUT_S:
            # trainer rank 0's own connection to the update group's store can take ~10 ms: a
            # shorter wait failed every sync there, blaming dist_master_port ("is another program
            # on it?"), and no rendezvous with an engine's workers ends within it
            raise ValueError(f"dist_timeout_s must be at least {MIN_TIMEOUT_S:g} second (the update "
                             f"group's rendezvous with the engines and each bucket's broadcast must "
                             f"end within it), got {self.dist_timeout_s!r}")
        if self.dist_timeout_s > MAX_TIMEOUT_S:
            # a longer wait overflows the socket and lock timeouts it is used in (time_t), and
            # failed the first sync with an OverflowError naming no setting
            raise ValueError(f"dist_timeout_s must be at most {MAX_TIMEOUT_S:.0e} seconds (31 years), "
                             f"got {self.dist_timeout_s!r}")
        # YAML 1.1 reads a bare `off` as false (and `on` as true)
        if self.verify is False:
            object.__setattr__(self, "verify", "off")
        if self.lora is False:
            object.__setattr__(self, "lora", "off")
        if self.lora not in LORA_MODES:
            raise ValueError(f"lora must be one of {LORA_MODES}, got {self.lora!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if self.memory_probe is False:
            object.__setattr__(self, "memory_probe", "off")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} (SGLang's names: "
                             f"'fp8' is block-wise FP8), got {self.quantization!r}")
        if self.on_replica_failure not in REPLICA_FAILURE_MODES:
            raise ValueError(f"on_replica_failure must be one of {REPLICA_FAILURE_MODES}, "
                             f"got {self.on_replica_failure!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES} (SGLang's /pause_generation "
                             f"modes, or None: no pause), got {self.pause_mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "engine" and self.method == "distributed" and self.dist_format != "flattened_bucket":
            raise ValueError(f"layout='engine' (per-rank buckets) with method='distributed' runs with "
                             f"dist_format='flattened_bucket'; got dist_format={self.dist_format!r} "
                             f"(the per-tensor baseline sends full tensors): use layout='full' or 'auto' there")
        # a method's own format asked of another method would be ignored without a word
        if self.method != "tensor" and self.strategy != "flattened":
            raise ValueError(f"strategy={self.strategy!r} is the tensor method's; method={self.method!r} "
                             f"ignores it" + (": its per-tensor baseline is dist_format='per_tensor'"
                                              if self.method == "distributed" else "")
                             + " (leave strategy at 'flattened')")
        if self.method != "distributed" and self.dist_format != "flattened_bucket":
            raise ValueError(f"dist_format={self.dist_format!r} is the distributed method's; "
                             f"method={self.method!r} ignores it (leave dist_format at 'flattened_bucket')")
        if self.layout == "engine" and self.method == "tensor" and self.strategy != "flattened":
            raise ValueError(f"layout='engine' (per-rank buckets) runs with method='tensor', "
                             f"strategy='flattened', method='distributed' or method='disk'; got method={self.method!r}, "
                             f"strategy={self.strategy!r}: use layout='full' or 'auto' there")
        for f in fields(self):
            if f.type in (bool, "bool"):
                object.__setattr__(self, f.name, parse_bool(getattr(self, f.name), f.name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not -(1 << 63) <= self.seed < 1 << 63:
            # dp rank r seeds a torch.Generator with seed + r, which takes a 64-bit seed: a larger
            # one failed building the manager with torch's "Overflow when unpacking long long"
            raise ValueError(f"seed must be an int in [-2**63, 2**63) (dp rank r generates with "
                             f"seed + r, a torch generator's 64-bit seed), got {self.seed!r}")
        if not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool) \
                or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.fsdp1_state_dict not in FSDP1_STATE_DICTS:
            raise ValueError(f"fsdp1_state_dict must be one of {FSDP1_STATE_DICTS}, "
                             f"got {self.fsdp1_state_dict!r}")
        if self.memory_probe not in ("full", "rss", "off"):
            raise ValueError(f"memory_probe must be 'full', 'rss' or 'off' (YAML's bare off works "
                             f"too), got {self.memory_probe!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        # disk method: where the versioned checkpoints go, and how many stay
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or not os.fspath(self.disk_dir):
                raise ValueError(f"disk_dir must be a directory path, got {self.disk_dir!r}")
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
        if getattr(self, "method", None) == "disk" and self.disk_dir is None:
            raise ValueError("method='disk' needs disk_dir: the directory every sync writes its "
                             "step_<N>/ checkpoint to (readable by the trainer ranks and the engine)")
        if not isinstance(self.disk_keep, int) or isinstance(self.disk_keep, bool) or self.disk_keep < 1:
            raise ValueError(f"disk_keep must be an int >= 1 (versions kept on disk), "
                             f"got {self.disk_keep!r}")
        if self.disk_hash not in DISK_HASHES:
            raise ValueError(f"disk_hash must be one of {list(DISK_HASHES)} (the digest in the disk "
                             f"method's manifest), got {self.disk_hash!r}")

    def replace(self, **changes: Any) -> "SyncConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"] = None if self.dtype is None else str(self.dtype).removeprefix("torch.")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncConfig":
        """A config from a plain mapping (a YAML recipe); ``bucket_mb`` may stand for
        ``bucket_bytes``. Every bad value is refused naming its key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"SyncConfig.from_dict takes a mapping of SyncConfig keys, got "
                             f"{type(d).__name__} {d!r:.80}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"bucket_mb"})
        if unknown:
            raise ValueError(f"unknown SyncConfig keys {unknown}; known: {sorted(names)}")
        d = dict(d)
        if "bucket_mb" in d and "bucket_bytes" in d:
            raise ValueError(f"give bucket_mb or bucket_bytes, not both (got bucket_mb="
                             f"{d['bucket_mb']!r}, bucket_bytes={d['bucket_bytes']!r})")
        if "bucket_mb" in d:
            d["bucket_bytes"] = mib_to_bytes(d.pop("bucket_mb"), "bucket_mb")
        try:
            return cls(**d)
        except TypeError as exc:   # a wrong type the checks above did not name: name the key
            bad = [k for k, v in d.items() if v is None and k not in _OPTIONAL]
            raise ValueError(f"SyncConfig: {', '.join(bad) or 'a value'} cannot be None"
                             if bad else f"SyncConfig: {exc}") from None

    @classmethod
    def from_verl(cls, cfg: Any, *, hf_config: Any = None, **overrides: Any) -> "SyncConfig":
        """Map verl's config (the whole config, ``actor_rollout_ref`` or its ``rollout``) to ours.

        Follows verl 0.9.x (checked against 0.9.1). Keys read: ``rollout.free_cache_engine``,
        ``rollout.dtype``, ``rollout.quantization`` (verl's ``null`` / ``fp8``), ``rollout.checkpoint_engine.update_weights_bucket_megabytes`` (or
        ``rollout.update_weights_bucket_megabytes``; verl's default 2048 MB when absent) and
        ``actor.fsdp_config.param_offload`` for ``offload_params``. ``multi_stage_wake_up`` is not
        read: verl >= 0.9 always wakes up in stages (resume weights, sync, resume kv_cache) and
        ignores that key, so the mapping is always staged. Booleans may be YAML/CLI spellings
        (``"False"``, ``"off"``); ``overrides`` win over everything read. ``rollout.dtype`` takes
        SGLang's spellings (``half``, ``float``) and ``auto``, resolved as SGLang resolves it from
        ``hf_config`` (the model's Hugging Face config, `auto_dtype`) and refused without one.
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
        out: dict[str, Any] = {"multi_stage_wake_up": True}   # verl >= 0.9: always staged
        v = get(rollout, "free_cache_engine")
        if v is not None:
            out["free_cache_engine"] = parse_bool(v, "rollout.free_cache_engine")
        dt = get(rollout, "dtype")
        if dt is not None and "dtype" not in overrides:    # overridden: not read (nor refused)
            out["dtype"] = parse_dtype(dt, "rollout.dtype", hf_config=hf_config)
        quant = get(rollout, "quantization")
        if quant is not None:
            if quant not in QUANTIZATIONS:
                raise ValueError(f"rollout.quantization: fsdp_sync syncs block FP8 ('fp8') or "
                                 f"nothing (null), got {quant!r}")
            out["quantization"] = quant
        mb = get(get(rollout, "checkpoint_engine"), "update_weights_bucket_megabytes",
                 get(rollout, "update_weights_bucket_megabytes"))
        out["bucket_bytes"] = mib_to_bytes(VERL_BUCKET_MB if mb is None else mb,
                                           "checkpoint_engine.update_weights_bucket_megabytes")
        offload = get(get(get(ref, "actor"), "fsdp_config"), "param_offload")
        if offload is not None:
            out["offload_params"] = parse_bool(offload, "actor.fsdp_config.param_offload")
        out.update(overrides)
        return cls(**out)
