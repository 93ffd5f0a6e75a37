"""Step 4 of the disk method (`transport.disk`): the engines load a published version with
``update_weights_from_disk``, on trainer rank 0; `load_version` answers what happened, which the
transport makes known to every rank.

The load names its format, never None: SGLang (0.5.12 to 0.5.23) replaces None with its launch
``--load-format``, and under ``dummy`` (verl's default for rollout servers) its disk update
refuses (``DummyModelLoader`` is no ``DefaultModelLoader``: "Failed to get model loader").
`HF_FORMAT` for Hugging Face files, `RANKED_FORMAT` for per-rank files.

One engine loads the version with the sync's weight version. A fleet loads it engine by engine,
each with the version:

- an engine that stages a disk load (`sessions.stages_disk_loads`: the reference engine,
  ``fsdp-sync serve``) loads it inside ``begin_weight_update`` / ``end_weight_update`` (one left
  open by a dead trainer aborted first: `sessions.begin`), and none of them commits (takes the
  weights and their version) until every engine has loaded it (`fleet.end_all`): all or none;
- SGLang (`SGLangEngine`, over HTTP or in process) loads it outside any session: it applies a
  disk load at once and post-processes the weights itself, and its ``end_weight_update`` would
  post-process them again (``process_weights_after_loading`` twice: scrambled layers, no error).
  Its weights and version change together, as the load answers, so a fleet of SGLang replicas is
  not atomic: after replica i refuses, replicas 0..i-1 serve the new version (the error says
  which) and replica i may hold part of it.

Not here: writing and publishing the version, keep-N (`transport.disk`), the sessions (`sessions`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from .. import fleet
from ..weights import hf_checkpoint as ckpt
from . import sessions

__all__ = ["HF_FORMAT", "RANKED_FORMAT", "Loaded", "load_one", "load_version"]

HF_FORMAT = "auto"
"""The ``load_format`` of a Hugging Face version: SGLang's ``DefaultModelLoader`` (safetensors
first) in 0.5.12 and 0.5.23, and what the reference engine takes (`hf_checkpoint.LOAD_FORMATS`)."""
RANKED_FORMAT = "sharded_state"
"""The ``load_format`` of a per-rank version (SGLang's ``ShardedStateLoader`` file pattern), which
the reference engine takes; SGLang's own disk update refuses that loader, so no SGLang engine is
sent one (`disk_ranked`)."""


@dataclass
class Loaded:
    """What `load_version` did: ``calls`` made, ``err`` (None: every engine loaded it, and a fleet
    committed), ``kept`` (after a failure: the replicas that hold the version or part of it, which
    no abort undid), ``torn`` (those of ``kept`` whose weights are not one known version: a staging
    engine whose abort could not drop what it wrote in place, and the replica that applies loads at
    once whose load failed: refused before reading, it holds its old version, but failed partway,
    SGLang 0.5.23's "rollback" re-reads the directory it was given, so it may serve the new weights
    under the old name, or part of them) and ``served`` (a commit failed on some replicas but
    others serve it now). The replicas that loaded the version before the failure hold it whole."""

    calls: int = 0
    err: BaseException | None = None
    kept: list[str] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    served: bool = False


def load_one(engine: Any, path: str, version: str | None, *, flush: bool = True,
             load_format: str | None = None) -> None:
    """``update_weights_from_disk`` with SGLang's ``weight_version`` where the engine takes it,
    ``flush_cache=False`` where ``flush`` is off (`DiskTransport._check_no_flush`), and
    ``load_format`` where the engine takes one (a method with ``**kwargs`` takes all three). An engine that says it cannot name its weights
    (``takes_weight_version`` False: an in-process ``sglang.Engine``) loads them unnamed, as
    `fleet.end_all` commits them."""
    fn = engine.update_weights_from_disk
    params = inspect.signature(fn).parameters
    # ``**kwargs`` takes them all (a wrapper passing them on, as a user's logging proxy does):
    # left out, SGLang behind it got load_format None (its launch format, e.g. dummy: refused) and,
    # under pause_mode="in_place", flushed the cache with requests held (the load failed, its
    # weights loaded)
    anykw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def takes(name: str) -> bool:
        return name in params or anykw

    if getattr(engine, "takes_weight_version", True) is False:
        version = None
    kw: dict[str, Any] = {} if flush or not takes("flush_cache") else {"flush_cache": False}
    if load_format is not None and takes("load_format"):
        kw["load_format"] = load_format
    if version is not None and takes("weight_version"):
        fn(path, weight_version=version, **kw)
    else:
        fn(path, **kw)
        if version is not None:
            fleet.set_version(engine, version)


def load_version(ctx: Any, final: str) -> Loaded:
    """``ctx.engines`` (none off trainer rank 0) load the published version ``final`` with
    ``ctx.version``, as the module docstring says."""
    out = Loaded()
    engines = list(ctx.engines or [])
    if not engines:
        return out
    version = getattr(ctx, "version", None)
    # the replicas are held in place in a sync (the manager's pause), not when one is brought in
    flush = getattr(ctx.config, "pause_mode", None) != "in_place" or getattr(ctx, "reload", False)
    fmt = RANKED_FORMAT if ckpt.is_ranked(final) else HF_FORMAT
    if len(engines) == 1:
        try:
            load_one(engines[0], final, version, flush=flush, load_format=fmt)
            out.calls = 1
        except Exception as exc:   # noqa: BLE001 - made known to every rank by the caller
            out.err = exc
            if not sessions.stages_disk_loads(engines[0]):    # as a fleet's failed replica below
                out.kept = out.torn = [fleet.describe(engines[0], 0)]
        return out
    staged = [sessions.stages_disk_loads(e) for e in engines]
    opened: set[int] = set()
    i = 0
    try:
        for i, engine in enumerate(engines):
            if staged[i]:
                sessions.begin(engine)
                opened.add(i)
            # the version goes with the weights: a staging engine takes both at its commit; one
            # that applies the load at once (SGLang) both now, so no replica serves the new
            # weights under the old name while the others load
            load_one(engine, final, version, flush=flush, load_format=fmt)
            out.calls += 1
    except Exception as exc:   # noqa: BLE001
        failed = fleet.describe(engines[i], i)
        partial = set(fleet.end_all(engines, commit=False, skip=set(range(len(engines))) - opened))
        torn = partial | ({failed} if not staged[i] else set())
        out.torn = [d for d in (fleet.describe(e, j) for j, e in enumerate(engines)) if d in torn]
        # those that apply a load at once hold it (the failed one perhaps part of it)
        partial |= {fleet.describe(engines[j], j) for j in range(i + 1) if not staged[j]}
        out.kept = [d for d in (fleet.describe(e, j) for j, e in enumerate(engines)) if d in partial]
        loaded = [k for k in out.kept if k != failed]
        out.err = RuntimeError(
            f"{failed} of {len(engines)} failed to load it: {type(exc).__name__}: {exc}; no replica "
            f"committed it" + (f", but {', '.join(loaded)} loaded it already and could not drop it: "
                               f"they serve its weights now" + (
                                   f" as version {version!r}" if version is not None else "")
                               if loaded else ""))
        return out
    try:
        fleet.end_all(engines, commit=True, version=version, skip=set(range(len(engines))) - opened)
    except fleet.CommitError as exc:
        ctx.commit_failed = exc
        out.err = RuntimeError(f"committing the update: {exc}")
        # those that committed, or took it at once, serve it (the failed ones are quarantined)
        out.served = bool(exc.committed) or not all(staged)
    return out
