"""A refusal where ``custom.fsdp_sync.enable`` would be ignored: verl rollouts fsdp_sync does not wrap.

fsdp_sync syncs verl's ``("sglang", "async")`` rollout (`adapter.SGLangAdapter`) and its own
``fsdp_sync_ref`` (`replica`). Before, ``+actor_rollout_ref.rollout.custom.fsdp_sync.enable=true``
on ``rollout.name=vllm`` (or ``trtllm``) was ignored without a word: verl's own adapter synced,
and the run's fsdp_sync options did nothing.

`install` (called by the plug-in) points every other entry of verl's rollout registry present when
the plug-in loads (verl 0.9.1: ``("vllm", "async")``, ``("trtllm", "async")``) at `Unwrapped`,
remembering the class path that was there (`ORIGINAL`). Building `Unwrapped`, as verl's worker
builds its rollout (``get_rollout_class(name, mode)(config=..., model_config=..., device_mesh=...)``,
also in the checkpoint-engine worker of disaggregated runs), gives that class's own object, built
with the same arguments, so installing fsdp_sync changes no such run by itself; with the opt-in
(`options.enabled`) it raises, naming the rollout and what to set, before anything is built.

Entries another plug-in adds after this one loads are not covered (their opt-in would be ignored
as before); nor is any rollout that verl builds without its registry.

Not here: the adapter (`adapter`), the options (`options`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .options import enabled, get_key
from .replica import ROLLOUT_NAME

__all__ = ["PATH", "ORIGINAL", "install", "Unwrapped"]

PATH = "fsdp_sync.integrations.verl.guard.Unwrapped"
"""The public path verl resolves for every registry entry `install` took over."""

ORIGINAL: dict[tuple[str, str], str] = {}
"""``(rollout name, mode)`` -> the class path that was in verl's registry before `install`."""


def install(registry: dict, ours: tuple[str, ...]) -> None:
    """Point every entry of ``registry`` whose class path is not in ``ours`` (fsdp_sync's own
    adapters) at `Unwrapped` (idempotent)."""
    for key, fqdn in list(registry.items()):
        if fqdn in ours or fqdn == PATH or key[0] == ROLLOUT_NAME:
            continue
        ORIGINAL[key] = fqdn
        registry[key] = PATH


class Unwrapped:
    """verl's rollout class of a registry entry fsdp_sync does not wrap (see the module
    docstring): building it gives that class's object, or refuses an opted-in run."""

    def __new__(cls, *args: Any, **kwargs: Any):
        config = kwargs["config"] if "config" in kwargs else (args[0] if args else None)
        name, mode = get_key(config, "name"), get_key(config, "mode", "async")
        fqdn = ORIGINAL.get((name, mode))
        if fqdn is None:
            raise RuntimeError(f"fsdp_sync's verl plug-in: no rollout class was registered for "
                               f"rollout.name={name!r}, mode={mode!r} before it loaded")
        if enabled(config):
            raise NotImplementedError(
                f"rollout.custom.fsdp_sync.enable=true, but actor_rollout_ref.rollout.name={name!r} "
                f"(mode {mode!r}) is a rollout fsdp_sync does not wrap: verl's own adapter would "
                f"sync it and every custom.fsdp_sync option would be ignored. fsdp_sync syncs "
                f"rollout.name=sglang and {ROLLOUT_NAME}: set actor_rollout_ref.rollout.name=sglang, "
                f"or drop +actor_rollout_ref.rollout.custom.fsdp_sync.enable")
        module, _, attr = fqdn.rpartition(".")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)
