"""fsdp_sync's sync figures in verl's step metrics, beside ``timing_s/update_weights``.

How a sync's figures reach verl 0.9.1's logger (console, wandb, tensorboard: one
``Tracking.log(data=metrics, step)`` per step, in ``PPOTrainer.fit``, ``trainer/ppo/v1/trainer_base.py``):
the step's ``metrics`` dict gets ``timing_s/*`` from the driver's own timers and, right after
``on_step_end`` (where the sync runs), ``PPOTrainer._consume_sync_metrics()``: whatever the trainer
stashed in ``_pending_sync_metrics``. Only the ``separate_async`` trainer stashes anything (the
checkpoint-engine manager's return: the actor ranks' ``send_weights`` figures); in the colocated
``sync`` trainer ``CheckpointEngineManager.update_weights`` returns ``{}`` for the ``naive``
backend and the trainer drops even that, and ``ActorRolloutRefWorker.update_weights`` returns
nothing. The rollout adapter runs in the workers; the figures are needed in the task runner.

So, two halves, both in this module:

- `publish` (worker side, infer-TP rank 0 of each replica, awaited before the adapter's
  ``update_weights`` returns, so before verl's ``ray.get`` of the sync does): the sync's figures
  go to one Ray actor of this job, `SINK`, made (and held: Ray collects a named actor nobody
  holds) by the first rank that publishes; it asks for no resources.
- `install` (every process, idempotent): once verl's ``trainer_base`` module is imported, its
  ``PPOTrainer._consume_sync_metrics`` also drains `SINK` and adds `step_metrics` of the newest
  sync: ``fsdp_sync/sync_s`` (slowest replica), ``fsdp_sync/bytes``, ``fsdp_sync/buckets``,
  ``fsdp_sync/tensors``, ``fsdp_sync/engine_calls`` (summed over replicas), the phases
  (``export_s``, ``pack_s``, ``transport_s``), ``fsdp_sync/verify_tensors`` and
  ``fsdp_sync/verify_s`` (a failed verify fails the step instead), ``fsdp_sync/quantize_s`` (an FP8
  rollout's quantizer, slowest replica; not in ``transport_s``), ``fsdp_sync/replicas`` and
  ``fsdp_sync/gbps`` (all replicas' bytes over the slowest one's seconds). The
  wrap only adds keys; with nothing published it adds none. A LoRA run's step syncs the adapter
  only (``fsdp_sync/adapter`` 1); the adapter's figures are the ``fsdp_sync/*`` ones, and a base
  sync published since the last drain (verl's ``on_init_end`` at global_steps 0, drained with the
  first step's figures) is added as ``fsdp_sync/base_sync_s`` / ``base_bytes``. verl's trainer module is not imported
  for this (it costs every process a second and 100 MB): an import hook patches it when verl does.

`append` writes the same figures, with the replica's rank, as one JSON line to
``custom.fsdp_sync.metrics_file``: infer-TP rank 0 of each replica, once per sync (its group's
other ranks have no figures of their own to add: the sync's outcome is agreed over the group, and
rank 0's seconds include waiting for them), as verl logs its step metrics once, from the driver.

Without Ray (a test, a script) `publish` does nothing. verl's older trainer (``trainer.use_v1=false``,
``ray_trainer.py``) has no such hook and does not get the figures.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import os
import sys
import threading
from typing import Any

__all__ = ["SINK", "TRAINER_MODULE", "KEYS", "KEPT", "Sink", "publish", "append", "step_metrics",
           "install", "drain"]

log = logging.getLogger("fsdp_sync.verl")

SINK = "fsdp_sync_sync_metrics"
"""The Ray actor (this job's namespace) the adapters publish to and the trainer drains."""

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"

KEYS = {   # figure -> how replicas combine
    "sync_s": max, "export_s": max, "pack_s": max, "digest_s": max, "transport_s": max,
    "bytes": sum, "tensors": sum, "buckets": sum, "engine_calls": sum,
    "verify_tensors": sum, "verify_s": max, "quantize_s": max,     # rollout.quantization=fp8
}

_sink_cls = None
_sink_handle = None        # held: Ray collects a named actor once no handle to it is left
_lock = threading.Lock()


KEPT = 4096
"""The most records `Sink` holds: the newest are kept. A trainer that never drains it (verl's
``trainer.use_v1=false``, the experimental fully async trainer: no ``_consume_sync_metrics``)
left it growing by one record per replica and sync for the whole run."""


class Sink:
    """One job's published sync figures, until the trainer drains them (at most `KEPT`, newest);
    run as the Ray actor `SINK`."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def put(self, record: dict) -> None:
        self.records.append(record)
        del self.records[:-KEPT]

    def drain(self) -> list[dict]:
        out, self.records = self.records, []
        return out


def _sink():
    global _sink_cls, _sink_handle
    import ray

    with _lock:
        if _sink_handle is not None:
            return _sink_handle
        if _sink_cls is None:
            _sink_cls = ray.remote(num_cpus=0)(Sink)
        _sink_handle = _sink_cls.options(name=SINK, get_if_exists=True).remote()
        return _sink_handle


async def publish(stats: dict) -> None:
    """Hand one replica's sync figures to `SINK` (awaited: it holds them before this returns).
    A no-op outside Ray."""
    try:
        import ray
    except ImportError:
        return
    if not ray.is_initialized():
        return
    global _sink_handle
    record = {k: float(stats[k]) for k in KEYS if isinstance(stats.get(k), (int, float))}
    record["global_steps"] = stats.get("global_steps")
    record["kind"] = stats.get("kind", "full")
    for attempt in (1, 2):      # a held handle whose actor died (its owner went): made again
        try:
            await _sink().put.remote(record)
            return
        except Exception as exc:  # noqa: BLE001 - figures must never fail a sync
            _sink_handle = None
            if attempt == 2:
                log.warning("fsdp_sync: could not publish the sync figures to verl's step "
                            "metrics: %s", exc)


def append(path: str, stats: dict, replica_rank: int) -> None:
    """``stats`` and ``replica_rank`` as one JSON line at the end of ``path`` (the adapter's
    ``metrics_file``). Replicas that share the path append whole lines: one ``write`` on an
    ``O_APPEND`` descriptor each, which a local file system never interleaves with another
    process's (a buffered text file split a line longer than its buffer, ``verify``'s digests
    make one, into several writes). A file that cannot be written is a warning naming the key,
    not a failed sync: the weights are in, and on infer-TP rank 0 alone a failure failed only its
    own rank's step."""
    line = memoryview((json.dumps(dict(stats, replica_rank=replica_rank)) + "\n").encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while line:
                line = line[os.write(fd, line):]
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("fsdp_sync: rollout.custom.fsdp_sync.metrics_file=%r: could not append the "
                    "sync's figures (%s); the sync itself went through", path, exc)


def _newest(records: list[dict]) -> list[dict]:
    """The records of the newest ``global_steps`` among ``records`` (one per replica)."""
    steps = [r.get("global_steps") for r in records]
    newest = max((s for s in steps if s is not None), default=None)
    return [r for r in records if r.get("global_steps") == newest]


def step_metrics(records: list[dict]) -> dict[str, float]:
    """The ``fsdp_sync/*`` metrics of the newest sync among ``records`` (one per replica: what
    `SINK` held since the last drain). A LoRA run's base sync among them, whatever its step, is
    reported beside its adapter's as ``base_sync_s`` / ``base_bytes``: verl syncs the base at
    ``on_init_end`` (global_steps 0), before the first step's adapter, and drains after it."""
    if not records:
        return {}
    group = _newest(records)
    base = _newest([r for r in records if r.get("kind") == "base"])
    adapter = [r for r in group if r.get("kind") == "adapter"]
    if adapter:              # a LoRA run: the adapter's figures; the base's (first step) beside
        group = adapter
    out = {f"fsdp_sync/{k}": float(combine(r[k] for r in group))
           for k, combine in KEYS.items() if all(k in r for r in group)}
    if adapter:
        out["fsdp_sync/adapter"] = 1.0
        if base and all("sync_s" in r and "bytes" in r for r in base):
            out["fsdp_sync/base_sync_s"] = float(max(r["sync_s"] for r in base))
            out["fsdp_sync/base_bytes"] = float(sum(r["bytes"] for r in base))
    out["fsdp_sync/replicas"] = float(len(group))
    if out.get("fsdp_sync/sync_s") and "fsdp_sync/bytes" in out:   # all replicas' bytes in the slowest's time
        out["fsdp_sync/gbps"] = out["fsdp_sync/bytes"] / out["fsdp_sync/sync_s"] / 1e9
    return out


def drain() -> dict[str, float]:
    """`step_metrics` of what `SINK` holds, emptied; ``{}`` without Ray or before any publish."""
    try:
        import ray
    except ImportError:
        return {}
    if not ray.is_initialized():
        return {}
    try:
        sink = ray.get_actor(SINK)
    except ValueError:          # nothing published in this job yet
        return {}
    return step_metrics(ray.get(sink.drain.remote()))


def _patch(module: Any) -> None:
    trainer = getattr(module, "PPOTrainer", None)
    original = getattr(trainer, "_consume_sync_metrics", None)
    if original is None:
        log.warning("fsdp_sync: %s has no PPOTrainer._consume_sync_metrics (another verl than "
                    "0.9.1?): fsdp_sync's sync figures do not reach verl's step metrics",
                    module.__name__)
        return
    if getattr(original, "_fsdp_sync", False):
        return

    def _consume_sync_metrics(self):
        out = dict(original(self) or {})
        try:
            out.update(drain())
        except Exception as exc:  # noqa: BLE001 - figures must never fail a training step
            log.warning("fsdp_sync: could not read the sync figures: %s", exc)
        return out

    _consume_sync_metrics._fsdp_sync = True
    _consume_sync_metrics.__doc__ = original.__doc__
    trainer._consume_sync_metrics = _consume_sync_metrics


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Hook(importlib.abc.MetaPathFinder):
    """Patches `TRAINER_MODULE` right after it executes, whenever that is."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRAINER_MODULE:
            return None
        for finder in sys.meta_path:        # whoever would have found it (an editable install's too)
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Make verl's trainer add fsdp_sync's figures to its step metrics (see the module)."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is not None:
        _patch(module)
        return
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
