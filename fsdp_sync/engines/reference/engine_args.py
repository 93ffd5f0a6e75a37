"""The checks of `ReferenceEngine`'s constructor arguments, run before any worker starts.

Each argument is refused with a `ValueError` naming it, the rule and the value it got, rather
than coerced: ``weights_cpu_backup="no"`` is not ``True``, ``kv_cache_tokens=2.5`` is not 2 and
``True`` is not 1 (a bool is not taken where a number is asked), a seed of None is not a raw
``TypeError`` from a worker, and a timeout of 0 is not a receive that gives up at once.

Not here: the model config and its split over the TP ranks (`quant.engine_layout`,
`weights.layout.ModelSpec`), which quantization a config and argument make (`quant.resolve`), the
prompts of a generate call (`rollout`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ...config import parse_dtype
from ..base import EngineError

__all__ = ["DTYPES", "EngineArgs", "check_engine_args"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
"""What ``torch.Generator.manual_seed`` takes."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, *, optional: bool = False, none_means: str = "") -> int | None:
    """``value`` is an int (not a bool, not a float that happens to be whole) >= ``low``."""
    if value is None and optional:
        return None
    if not _is_int(value) or value < low:
        alt = f" (or None{none_means})" if optional else ""
        raise ValueError(f"{name} must be an int >= {low}{alt}, got {value!r}")
    return int(value)


def check_seconds(name: str, value: Any, *, optional: bool = False, none_means: str = "") -> float | None:
    """``value`` is a finite number of seconds > 0 (not a bool)."""
    if value is None and optional:
        return None
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and 0 < float(value) < math.inf):
        alt = f" (or None{none_means})" if optional else ""
        raise ValueError(f"{name} must be a finite number of seconds > 0{alt}, got {value!r}")
    return float(value)


def check_flag(name: str, value: Any) -> bool:
    """``value`` is True or False: ``"no"`` or ``0`` is refused, not read as a truth value."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class EngineArgs:
    """The checked arguments (`check_engine_args`): plain attributes, one per argument."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def check_target_modules(value: Any) -> tuple[str, ...] | None:
    """``lora_target_modules`` as SGLang's ``--lora-target-modules`` takes it: None (any), the
    string ``"all"`` / ``"all-linear"`` (kept as ``("all",)``), or module names (strings). Any other
    string was split into its characters (``"q_proj"`` -> q, _, p, ...), and every adapter then
    refused listing them."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in ("all", "all-linear"):
            return ("all",)
        raise ValueError(f"lora_target_modules must be a list of module names or 'all' / 'all-linear' "
                         f"(as SGLang's --lora-target-modules), got the string {value!r}: pass "
                         f"[{value!r}] for that one module")
    try:
        names = tuple(value)
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"lora_target_modules must be a non-empty list of module names (strings) or "
                         f"'all' / 'all-linear', got {value!r}")
    return names


def check_engine_args(*, dtype: Any, device: Any, tp_size: Any, base_gpu_id: Any, kv_cache_tokens: Any,
                      mem_fraction: Any, weights_cpu_backup: Any, seed: Any, num_threads: Any,
                      pg_timeout_s: Any, startup_timeout_s: Any, call_timeout_s: Any,
                      use_memory_saver: Any, transactional_updates: Any, update_recv_timeout_s: Any,
                      max_lora_rank: Any, keep_bucket_buffers: Any) -> EngineArgs:
    """Check every argument `ReferenceEngine` takes apart from the model's (see its docstring);
    returns them checked: ``dtype`` a torch dtype (names as `SyncConfig` takes them), ``device``
    ``"cpu"`` or ``"cuda"``, ``kv_cache_tokens`` 4096 where neither it nor ``mem_fraction`` is given."""
    given = dtype
    try:    # the names SyncConfig takes ("bf16", "bfloat16", ...) as well as torch dtypes
        dtype = parse_dtype(dtype, "dtype") if dtype is not None else None
    except ValueError:
        dtype = None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]} (or a name: "
                         f"float32/fp32, bfloat16/bf16, float16/fp16), got {given!r}")
    device = str(device)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("device='cuda' but CUDA is not available in this process")
    tp_size = check_int("tp_size", tp_size, 1)
    base_gpu_id = check_int("base_gpu_id", base_gpu_id, 0)
    if device == "cuda" and base_gpu_id + tp_size > torch.cuda.device_count():   # not wrapped to GPU 0
        raise EngineError(f"base_gpu_id {base_gpu_id} + tp_size {tp_size} needs GPUs {base_gpu_id}.."
                          f"{base_gpu_id + tp_size - 1}, one per TP rank (NCCL refuses two ranks on one "
                          f"GPU); this process sees {torch.cuda.device_count()}")
    if kv_cache_tokens is not None and mem_fraction is not None:
        raise ValueError(f"give kv_cache_tokens or mem_fraction, not both (got kv_cache_tokens="
                         f"{kv_cache_tokens!r}, mem_fraction={mem_fraction!r})")
    if kv_cache_tokens is not None and (not _is_int(kv_cache_tokens) or kv_cache_tokens < 1):
        raise ValueError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens!r}: a whole number of "
                         f"KV-cache slots per worker (an int, not a float or a bool), or None to size "
                         f"the cache by mem_fraction (else 4096)")
    if mem_fraction is not None:
        if not (isinstance(mem_fraction, numbers.Real) and not isinstance(mem_fraction, bool)
                and 0 < float(mem_fraction) <= 1):
            raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction!r}: a number, the "
                             f"fraction of device memory for weights and KV cache")
        mem_fraction = float(mem_fraction)
    elif kv_cache_tokens is None:
        kv_cache_tokens = 4096
    if not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an int in [-2**63, 2**64 - 1] (it seeds the start-up weights "
                         f"and sampling), got {seed!r}")
    return EngineArgs(
        dtype=dtype, device=device, tp_size=tp_size, base_gpu_id=base_gpu_id,
        kv_cache_tokens=None if kv_cache_tokens is None else int(kv_cache_tokens), mem_fraction=mem_fraction, seed=int(seed),
        weights_cpu_backup=check_flag("weights_cpu_backup", weights_cpu_backup),
        use_memory_saver=check_flag("use_memory_saver", use_memory_saver),
        transactional_updates=check_flag("transactional_updates", transactional_updates),
        keep_bucket_buffers=check_flag("keep_bucket_buffers", keep_bucket_buffers),
        num_threads=check_int("num_threads", num_threads, 1, optional=True, none_means=" for 1") or 1,
        pg_timeout_s=check_seconds("pg_timeout_s", pg_timeout_s),
        startup_timeout_s=check_seconds("startup_timeout_s", startup_timeout_s),
        call_timeout_s=check_seconds("call_timeout_s", call_timeout_s, optional=True,
                                     none_means=" to wait without a limit"),
        update_recv_timeout_s=check_seconds("update_recv_timeout_s", update_recv_timeout_s),
        max_lora_rank=check_int("max_lora_rank", max_lora_rank, 1, optional=True,
                                none_means=" for any rank"))
