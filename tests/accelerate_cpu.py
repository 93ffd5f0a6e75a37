"""TEST-ONLY: make Hugging Face accelerate apply FSDP on a CPU machine.

On CPU, accelerate never selects FSDP by itself (its ``AcceleratorState`` picks FSDP only for
GPU-like distributed types): with ``accelerate launch`` and an FSDP config each rank trains an
unsharded copy (or, with ``cpu=True``, a DDP copy over gloo). To test the real thing on CPU,
`force_fsdp` switches an ``Accelerator(cpu=True, fsdp_plugin=...)`` built under a launcher to
``DistributedType.FSDP`` before ``prepare``; `patch_accelerator` makes every later
``accelerate.Accelerator(...)`` do that (used to run ``examples/accelerate_rollout.py`` under
``accelerate launch`` in the suite, see ``tests/accelerate_cpu_run.py``).

On a GPU none of this is needed: accelerate applies FSDP itself. Nothing in ``fsdp_sync`` imports
this module.
"""

from __future__ import annotations

import torch


def force_fsdp(accelerator, plugin, parallelism_config=None) -> None:
    """Before ``accelerator.prepare``: shard with ``plugin`` on CPU (FSDP1 needs
    ``sync_module_states=False`` and ``cpu_ram_efficient_loading=False`` there). A
    ``ParallelismConfig`` (HSDP: ``dp_replicate_size`` x ``dp_shard_size``) is given here rather
    than to ``Accelerator``, which refuses it for a CPU distributed type."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
        shared["device"] = torch.device("cpu")   # FSDP1: "cpu vs cpu:0" otherwise
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    if parallelism_config is not None:
        AcceleratorState._shared_state["parallelism_config"] = parallelism_config
        accelerator.state.device_mesh = parallelism_config.get_device_mesh("cpu")


def reset() -> None:
    """Forget accelerate's process-wide state (the process group stays), to build another
    Accelerator with another plugin in the same process."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._shared_state.clear()


def patch_accelerator() -> None:
    """Make ``accelerate.Accelerator(...)`` (imported after this call) shard on CPU, with the
    FSDP plugin that ``accelerate launch --config_file`` describes (or the one passed)."""
    import accelerate
    from accelerate.utils import FullyShardedDataParallelPlugin

    base = accelerate.Accelerator

    class CPUFSDPAccelerator(base):
        def __init__(self, *args, **kwargs):
            kwargs["cpu"] = True
            plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()  # from env
            kwargs["fsdp_plugin"] = plugin
            super().__init__(*args, **kwargs)
            force_fsdp(self, plugin)

    CPUFSDPAccelerator.__name__ = CPUFSDPAccelerator.__qualname__ = "Accelerator"
    accelerate.Accelerator = CPUFSDPAccelerator
