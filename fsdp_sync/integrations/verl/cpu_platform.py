"""verl on CPU, opt-in: ``VERL_PLATFORM=cpu`` runs verl 0.9's own trainer on a machine with no GPU.

verl has no CPU platform: ``verl.plugin.platform`` falls back to ``"nvidia"`` and rewrites
``trainer.device=cpu`` to cuda. `install` (called by the plug-in, ``fsdp_sync.integrations.verl``,
only when ``VERL_PLATFORM`` is ``cpu`` in that process's environment, so a GPU host's
auto-detection never sees it) registers:

- `CPUPlatform` under the name ``"cpu"``: device ``cpu`` (verl calls ``tensor.to(get_device_id())``
  and an integer would mean an accelerator, so ``current_device()`` is ``"cpu"``), collectives over
  gloo, memory figures from psutil (``mem_get_info``) or zero (``memory_allocated``, ...), and the
  Ray resource ``"GPU"``: verl asks Ray for GPUs everywhere (``single_controller/ray/base.py``
  hard-codes ``use_gpu=True``), so a CPU run declares logical ones (``ray_init.num_gpus``);
- verl's FSDP engines for device ``cpu``: they are registered for ``cuda``/``npu`` only, and are
  device-agnostic through verl's platform calls, so ``VERL_ENGINE_DEVICE`` (verl's own override)
  defaults to ``cuda`` for the lookup;
- a global process group of ``cpu:gloo``: verl builds ``"cpu:gloo,{device}:{backend}"``, which is
  ``"cpu:gloo,cpu:gloo"`` here and refused by torch.

The rest of a CPU run is configuration (the recipe ``recipes/verl/tiny_grpo_cpu.yaml`` sets it):
``trainer.device=cpu``, ``ray_kwargs.ray_init.num_cpus`` large enough for TransferQueue's actors (on
2 cores Ray waits for CPUs forever otherwise), ``+ray_kwargs.ray_init.num_gpus`` = the trainer's
ranks, ``attn_implementation=sdpa`` and ``use_remove_padding=False`` (flash-attention is CUDA-only).

Not here: the rollout (`replica`), the weight sync (`adapter`).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["CPUPlatform", "install", "requested"]

PLATFORM = "cpu"


def requested() -> bool:
    """Whether this process runs verl on CPU (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


class _CPUDeviceModule(types.ModuleType):
    """What verl calls ``get_torch_device()``: ``torch.cpu``, plus the ``torch.cuda`` calls verl
    makes that mean nothing on CPU (memory statistics are 0, caches and events no-ops)."""

    _ZERO = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")
    _NOOP = ("empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated",
             "ipc_collect", "set_per_process_memory_fraction", "synchronize", "set_device",
             "manual_seed", "manual_seed_all")

    def __init__(self) -> None:
        super().__init__("fsdp_sync_verl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        if name in self._ZERO:
            return _zero
        if name in self._NOOP:
            return torch.manual_seed if name.startswith("manual_seed") else _nothing
        if name == "mem_get_info":
            return _mem_get_info
        if name == "memory_stats":
            return lambda *a, **k: {}
        if name == "get_device_name":
            return lambda *a, **k: "cpu"
        if name in ("is_available", "is_initialized"):
            return lambda *a, **k: True
        if name == "device_count":
            return lambda *a, **k: 1
        if name == "current_device":
            return lambda *a, **k: 0
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(f"verl asked the CPU device module for {name!r}, which fsdp_sync's "
                             f"CPU platform does not provide (VERL_PLATFORM=cpu)")


_DEVICE = _CPUDeviceModule()


def _platform_base() -> type:
    from verl.plugin.platform import PlatformBase

    return PlatformBase


class CPUPlatform(_platform_base()):
    """verl's platform interface on CPU (see the module docstring)."""

    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return requested()

    def current_device(self) -> str:    # verl does `.to(get_device_id())`: "cpu", never an index
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"     # Ray sets it for the logical GPUs it hands out

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"                      # logical GPUs: ray_init.num_gpus on a CPU machine

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


_installed = False


def install() -> None:
    """Register `CPUPlatform`, the FSDP engine lookup and the gloo process group (idempotent; the
    plug-in calls it only when `requested`)."""
    global _installed
    if _installed:
        return
    from verl.plugin.platform import PlatformRegistry
    import verl.utils.distributed as verl_dist

    PlatformRegistry.register(platform=PLATFORM)(CPUPlatform)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    verl_init = verl_dist.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return verl_init(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    verl_dist.initialize_global_process_group_ray = initialize_global_process_group_ray
    _installed = True
