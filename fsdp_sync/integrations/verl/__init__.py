"""fsdp_sync's verl plug-in, loaded by verl itself on every ``import verl``.

fsdp_sync declares this package under the ``verl.plugins`` entry-point group, so the driver, the
task runner and every Ray worker import it (unless ``VERL_USE_EXTERNAL_PLUGINS`` excludes it).
Importing it:

- maps ``("sglang", "async")`` in verl's rollout registry to `SGLangAdapter` (`adapter`), inert
  until a run opts in with ``+actor_rollout_ref.rollout.custom.fsdp_sync.enable=true``;
- registers the rollout name ``fsdp_sync_ref`` (`replica`): verl's rollout on fsdp_sync's reference
  engine, one ``fsdp-sync serve`` per replica, `SGLangAdapter` always on;
- wraps verl's other rollouts (``vllm``, ``trtllm``) in `guard.Unwrapped`: verl's own adapter
  unless a run sets ``custom.fsdp_sync.enable=true`` there, which is refused (it would be ignored);
- registers the checkpoint-engine backend ``fsdp_sync`` (`checkpoint_engine`) for verl's
  disaggregated modes: ``rollout.checkpoint_engine.backend=fsdp_sync``;
- makes verl's v1 trainer add each sync's ``fsdp_sync/*`` figures to its step metrics
  (`metrics`: patched in when verl imports its trainer module, not before);
- only when ``VERL_PLATFORM=cpu``: verl's CPU platform (`cpu_platform`), so verl's own trainer runs
  on a machine with no GPU.

A process where this plug-in failed to import runs verl's own adapter instead (verl logs the
failure at DEBUG only); the adapter refuses, at its first sync, an infer-TP group where not every
rank runs it (`fsdp_sync.integrations.peer_check`). ``VERL_USE_EXTERNAL_MODULES=fsdp_sync.integrations.verl``
makes verl import this package itself, failing loudly where it cannot.

``recipes/verl/`` holds recipes for both: the tiny GRPO run on a laptop (``fsdp_sync_ref``, CPU) and
Qwen2.5-0.5B on GSM8K (``sglang``, GPUs). docs/verl.md says what each piece does and costs.
"""

from __future__ import annotations

from . import cpu_platform
from .adapter import KEY, VERL_DEFAULT, SGLangAdapter, enabled, sync_config
from .replica import ROLLOUT_NAME, ServeReplica

__all__ = ["SGLangAdapter", "KEY", "VERL_DEFAULT", "ROLLOUT_NAME", "enabled", "sync_config",
           "register"]


def register() -> None:
    """Everything the module docstring lists (idempotent)."""
    from verl.workers.rollout import base as verl_rollout
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from . import adapter, guard, metrics

    adapter.register()
    metrics.install()
    verl_rollout._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = adapter.OURS
    guard.install(verl_rollout._ROLLOUT_REGISTRY, (adapter.OURS,))

    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: ServeReplica)
    from . import checkpoint_engine  # noqa: F401  (registers the backend on import)
    if cpu_platform.requested():
        cpu_platform.install()


register()
