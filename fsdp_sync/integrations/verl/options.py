"""What fsdp_sync's verl adapter reads from verl's rollout config, and where its server is.

- `options`: the ``rollout.custom.fsdp_sync`` mapping; `enabled`: whether fsdp_sync syncs the rollout;
- `sync_config`: the adapter's `SyncConfig`: verl's own keys (`SyncConfig.from_verl`) and the
  ``custom.fsdp_sync.*`` fields it honours (`HONOURED`); every other SyncConfig field is refused
  naming the verl option that decides it (`INSTEAD`), as an option accepted and then ignored
  would silently run something else than the user asked for; ``quantization`` differing from
  ``rollout.quantization`` and ``dtype`` from ``rollout.dtype`` (what verl starts its server
  with) only with a ``base_url`` of the user's own (`quantization_conflict`, `dtype_conflict`);
- `build_refusal`: what the adapter refuses when it is built (prefill/decode disaggregation, a
  model whose fused pairs SGLang must load in one call: `FUSED_PAIRS`);
- `named_actor`, `server_url`, `same_server`: finding verl's server actor and comparing its
  address with ``custom.fsdp_sync.base_url`` (the adapter refuses a base_url beside it).

Not here: the sync (`adapter`). Imports verl's nothing; Ray only when asked for an actor.
"""

from __future__ import annotations

from typing import Any

from ...config import SyncConfig, mib_to_bytes, parse_dtype
from .replica import ROLLOUT_NAME

__all__ = ["ADAPTER_KEYS", "HONOURED", "INSTEAD", "FUSED_PAIRS", "get_key", "options", "enabled",
           "sync_config", "quantization_conflict", "dtype_conflict", "build_refusal", "server_url",
           "named_actor",
           "same_server"]

ADAPTER_KEYS = ("enable", "base_url", "api_key", "metrics_file", "log_dir")
"""``custom.fsdp_sync.*`` keys that are the adapter's own, not SyncConfig fields."""


def get_key(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` or ``node.key`` (a dict, an OmegaConf node or a verl dataclass), else ``default``."""
    if node is None:
        return default
    if isinstance(node, dict) or hasattr(node, "keys"):
        try:
            return node.get(key, default)
        except AttributeError:
            pass
    return getattr(node, key, default)


def options(config: Any) -> dict:
    """``rollout.custom.fsdp_sync`` as a plain dict ({} when absent)."""
    opts = get_key(get_key(config, "custom"), "fsdp_sync")
    if opts is None:
        return {}
    if hasattr(opts, "items"):
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(opts, DictConfig):
                opts = OmegaConf.to_container(opts, resolve=True)
        except ImportError:
            pass
        return dict(opts.items())
    raise TypeError(f"rollout.custom.fsdp_sync must be a mapping of options, got "
                    f"{type(opts).__name__}: {opts!r}")


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"rollout.custom.fsdp_sync.{key} must be true or false, got {value!r}")


def enabled(config: Any) -> bool:
    """Whether fsdp_sync syncs this rollout: ``rollout.custom.fsdp_sync.enable`` set, or the
    rollout is fsdp_sync's own (``rollout.name=fsdp_sync_ref``, where nothing else could). Other
    ``custom.fsdp_sync`` keys with no ``enable`` at all are refused: verl's own adapter would run
    and read none of them (``verify=full`` with no check); ``enable=false`` keeps them, unread."""
    name = get_key(config, "name")
    if name == ROLLOUT_NAME:
        return True
    opts = options(config)
    if opts and "enable" not in opts:
        raise ValueError(f"rollout.custom.fsdp_sync sets {sorted(opts)} but not enable, so under "
                         f"rollout.name={name!r} verl's own adapter would sync and read none of "
                         f"them; add +actor_rollout_ref.rollout.custom.fsdp_sync.enable=true "
                         f"(fsdp_sync syncs rollout.name=sglang), or set it to false to run "
                         f"verl's adapter with them unread")
    return _flag(opts.get("enable", False), "enable")


HONOURED = ("strategy", "bucket_bytes", "dtype", "verify", "quantization", "dist_timeout_s",
            "share_host_memory")
"""The `SyncConfig` fields the adapter reads from ``custom.fsdp_sync.*`` (``bucket_mb`` stands for
``bucket_bytes``). The others are verl's to decide here, or have no meaning under verl's worker:
`INSTEAD` says which, and `sync_config` refuses them by key."""

_DISTRIBUTED = ("fsdp_sync's adapter syncs colocated engines by tensor; disaggregated runs use "
                "verl's checkpoint engines: set actor_rollout_ref.rollout.checkpoint_engine.backend "
                "and custom_backend_module=fsdp_sync.integrations.verl.checkpoint_engine")
_WORKER = "verl's worker owns the export and the memory stages around the sync"
INSTEAD = {
    "method": "verl chooses how weights travel: set actor_rollout_ref.rollout.checkpoint_engine.backend; "
              "colocated runs force 'naive', which this adapter syncs by tensor",
    "free_cache_engine": "set actor_rollout_ref.rollout.free_cache_engine, which the adapter reads",
    "offload_params": "set actor_rollout_ref.actor.fsdp_config.param_offload: verl's worker offloads",
    "multi_stage_wake_up": "verl >= 0.9 always wakes the rollout up in stages",
    "pause_mode": "verl pauses and resumes generation itself: abort_all_requests, resume_generation",
    "layout": "the adapter sends full tensors, as SGLang loads them from verl: layout 'full'",
    "pipelined": "it applies to per-rank buckets, which the adapter does not send",
    "disk_dir": "the disk method does not run under verl",
    "disk_keep": "the disk method does not run under verl",
    "disk_hash": "the disk method does not run under verl",
    "dist_format": _DISTRIBUTED, "dist_master_address": _DISTRIBUTED,
    "dist_master_port": _DISTRIBUTED, "dist_backend": _DISTRIBUTED,
    "dist_group_name": _DISTRIBUTED, "on_replica_failure": _DISTRIBUTED,
    "fsdp1_state_dict": _WORKER, "memory_probe": _WORKER,
    "seed": "verl's agent loop generates: set its sampling options (actor_rollout_ref.rollout.*)",
    "lora": "set actor_rollout_ref.model.lora_rank (and lora.merge); the adapter follows it",
    "lora_name": "the adapter loads verl's LoRA under verl's adapter name",
}


def sync_config(config: Any, hf_config: Any = None) -> SyncConfig:
    """The `SyncConfig` of a rollout config: verl's keys (`SyncConfig.from_verl`), then the
    ``custom.fsdp_sync.*`` keys of `HONOURED` (those win). A SyncConfig field the adapter does not
    honour is refused naming what to set instead (`INSTEAD`); an unknown key is refused by name;
    ``bucket_mb`` goes through `config.mib_to_bytes`, and not with ``bucket_bytes``. A dtype
    ``auto`` is the one SGLang serves ``hf_config``'s model in (`config.auto_dtype`; refused
    without ``hf_config``)."""
    opts = {k: v for k, v in options(config).items() if k not in ADAPTER_KEYS}
    where = "rollout.custom.fsdp_sync"
    ignored = sorted(set(opts) & set(INSTEAD))
    if ignored:
        raise ValueError(f"{where}: fsdp_sync's verl adapter does not honour "
                         + "; ".join(f"{k!r}: {INSTEAD[k]}" for k in ignored)
                         + f". It reads {list(HONOURED) + ['bucket_mb']} and {list(ADAPTER_KEYS)}")
    unknown = sorted(set(opts) - set(HONOURED) - {"bucket_mb"})
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known: "
                         f"{sorted(set(ADAPTER_KEYS) | set(HONOURED) | {'bucket_mb'})}")
    why = quantization_conflict(config)
    if why and not options(config).get("base_url"):
        raise ValueError(why)
    if "bucket_mb" in opts:
        if "bucket_bytes" in opts:
            raise ValueError(f"{where}: give bucket_mb or bucket_bytes, not both (got bucket_mb="
                             f"{opts['bucket_mb']!r}, bucket_bytes={opts['bucket_bytes']!r})")
        opts["bucket_bytes"] = mib_to_bytes(opts.pop("bucket_mb"), f"{where}.bucket_mb")
    if "dtype" in opts:     # null too: the trainer's dtype, which verl's server does not serve
        opts["dtype"] = parse_dtype(opts["dtype"], f"{where}.dtype", hf_config=hf_config)
        why = dtype_conflict(config, opts["dtype"], hf_config)
        if why and not options(config).get("base_url"):
            raise ValueError(why)
    try:
        return SyncConfig.from_verl(config, hf_config=hf_config, **opts)
    except ValueError as exc:
        # SyncConfig names a field by its own name ("strategy must be one of ..."): under verl
        # the user wrote it as rollout.custom.fsdp_sync.<field>, so the refusal says that
        field = str(exc).split(" ", 1)[0].rstrip(":")
        if field in opts and field != "dtype":      # dtype's already names its key
            raise ValueError(f"{where}.{exc}") from exc
        raise


def dtype_conflict(config: Any, ours: Any, hf_config: Any = None) -> str | None:
    """Why ``custom.fsdp_sync.dtype`` (``ours``, parsed) contradicts ``rollout.dtype`` (None: that
    is unset or names the same dtype, ``auto`` resolved as SGLang resolves it). verl starts its
    SGLang server with ``--dtype`` = ``rollout.dtype`` (``async_sglang_server``), so tensors cast
    to another dtype are either cast again by SGLang's loader (float16 into bfloat16: values past
    65504 become inf; bfloat16 into float32: the trainer's low bits are lost) or refused at the
    first bucket (``fsdp-sync serve``), and verify's digests of the cast tensors never match.
    `sync_config` refuses it unless ``base_url`` is set (a server of the user's own, started with
    that dtype); the adapter refuses it too where that base_url is verl's own server."""
    raw = get_key(config, "dtype")
    if raw is None:
        return None
    verls = parse_dtype(raw, "actor_rollout_ref.rollout.dtype", hf_config=hf_config)
    if verls is None or verls == ours:
        return None
    # null: no cast, the trainer's dtype (float32 master weights under verl's FSDP)
    name = {d: "null" if d is None else str(d).removeprefix("torch.") for d in (ours, verls)}
    sent = name[ours] if ours is not None else "the trainer's dtype"
    fix = ("" if ours is None else f", or set actor_rollout_ref.rollout.dtype={name[ours]}")
    return (f"rollout.custom.fsdp_sync.dtype={name[ours]} contradicts "
            f"actor_rollout_ref.rollout.dtype={raw} ({name[verls]}), the dtype verl starts its "
            f"server with: the adapter would send every tensor in {sent} and the server would "
            f"load it as {name[verls]} (a second cast that may change values, a refusal at the "
            f"first bucket, or a verify mismatch after the sync); drop "
            f"rollout.custom.fsdp_sync.dtype (the adapter then sends {name[verls]}){fix} (a "
            f"different value is taken only with rollout.custom.fsdp_sync.base_url naming a "
            f"server of your own, started with it)")


def quantization_conflict(config: Any) -> str | None:
    """Why ``custom.fsdp_sync.quantization`` contradicts ``rollout.quantization`` (None: it is
    absent or the same). verl starts its server with ``rollout.quantization``, so a different
    value would send FP8 weights into a bf16 server or the reverse. `sync_config` refuses it
    unless ``base_url`` is set (a server of the user's own, which runs the override); the adapter
    refuses it too where that base_url is verl's own server (`SGLangAdapter._check_base_url`)."""
    opts = options(config)
    if "quantization" not in opts:
        return None
    want, verls = opts["quantization"], get_key(config, "quantization")
    if want == verls:
        return None
    yaml = {w: "null" if w is None else w for w in (want, verls)}   # as written on verl's command line
    return (f"rollout.custom.fsdp_sync.quantization={yaml[want]} contradicts "
            f"actor_rollout_ref.rollout.quantization={yaml[verls]}, which verl starts its server with: "
            f"the adapter would send {'block-FP8' if want else 'unquantized'} weights into a server "
            f"that holds {'block-FP8' if verls else 'unquantized'} ones; set "
            f"actor_rollout_ref.rollout.quantization={yaml[want]} and drop "
            f"rollout.custom.fsdp_sync.quantization (a different value is taken only with "
            f"rollout.custom.fsdp_sync.base_url naming a server of your own, started with it)")


FUSED_PAIRS = {"deepseek_v4": "wq_a/wkv, compressor.wkv/wgate, indexer.compressor.wkv/wgate"}
"""Model types whose SGLang loader concatenates pairs of checkpoint tensors inside one
``load_weights`` call and asserts it saw both (verl's ``DEEPSEEK_V4_FUSION_GROUPS``, which verl's
own adapter keeps in one bucket): the adapter's buckets, cut by bytes, may split a pair."""


def build_refusal(config: Any, model_config: Any) -> str | None:
    """What the adapter refuses when it is built (None: nothing), naming verl's key: verl's
    prefill/decode disaggregation, and a model whose fused pairs must reach SGLang in one call
    (`FUSED_PAIRS`; fsdp_sync's layout map does not know those models either)."""
    disagg = get_key(config, "disaggregation")
    if disagg is not None and get_key(disagg, "enabled", False):
        return ("prefill/decode disaggregation (rollout.disaggregation.enabled) is not supported; "
                "drop rollout.custom.fsdp_sync.enable")
    model_type = get_key(get_key(model_config, "hf_config"), "model_type")
    if model_type in FUSED_PAIRS:
        return (f"model_type {model_type!r}: SGLang loads its fused pairs "
                f"({FUSED_PAIRS[model_type]}) only when both halves come in one load_weights call, "
                f"which verl's own adapter keeps together and fsdp_sync's buckets (cut by bytes) do "
                f"not; drop rollout.custom.fsdp_sync.enable for this model (verl's adapter syncs it)")
    return None


def server_url(host: Any, port: Any) -> str:
    host = f"[{host}]" if ":" in str(host) else host
    return f"http://{host}:{port}"


def named_actor(name: str) -> Any:
    """The Ray actor called ``name`` in this job, or None (no Ray, or no such actor)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(name)
    except ValueError:       # Ray's answer for a name no live actor has
        return None


def same_server(a: str, b: str) -> bool:
    """Whether two server URLs name one server: the same port, and the same host or hosts whose
    addresses overlap (``localhost`` and ``127.0.0.1``)."""
    import socket
    from urllib.parse import urlsplit

    def parts(url: str) -> tuple[str, int | None]:
        u = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            return url, None
        return (u.hostname or "").lower(), port

    (ha, pa), (hb, pb) = parts(a), parts(b)
    if pa is None or pa != pb:
        return False
    if ha == hb:
        return True

    def addresses(host: str) -> set:
        try:
            return {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return set()

    return bool(addresses(ha) & addresses(hb))
