"""`FSDPShardingManager`: the ``with`` block a verl-style worker puts around its rollout.

On entry it runs named stages in order (each timed and memory-probed into a `Timeline`):

    multi_stage_wake_up=True:   resume_weights → sync_weights → offload_params → resume_kv_cache → swap_rng
    multi_stage_wake_up=False:  resume_all → sync_weights → offload_params → swap_rng

and on exit: release_memory (kv_cache, weights) → restore_module → restore_rng. The engine-memory
stages (resume_*, release_memory) do something only for a colocated transport (``method="tensor"``);
for the disaggregated ones they are empty by that one rule. Engine calls come from the rank that
holds the engine handles (None on the other ranks); every stage is agreed by an `agree`
collective, at its end or, for ``prepare``, ``offload_params`` and ``resume_kv_cache`` (none of
their own), at the next stage's, and the exit's stages by one at the exit's end; so a failure on
any rank (engine error, bad tensor, dead worker) raises the same `SyncError` on every rank instead
of leaving ranks blocked. The first settled stage's agree also compares the ranks' `STAGE_SETTINGS`.

The weight sync itself is the transport's (`fsdp_sync.transport`, by `SyncConfig.method`): ``tensor``,
``distributed`` or ``disk``. The manager counts syncs (``step``) and closes the transport (`close`).

Not here: how tensors are gathered (export), laid out (bucket), shared (handles) or moved
(transport), and no process group of its own: it runs on the mesh (or default group) it is given.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from contextlib import nullcontext
from typing import Any, Mapping

import torch
import torch.distributed as dist

from . import lora_stage, lora_sync, tp_batch
from .weights import export_checks, ipc_memory, quantize
from .config import SyncConfig
from .faultpoint import fault_point
from . import fleet, manager_fleet, manager_pause
from .fleet import Fleet
from .manager_rng import RolloutRng
from .memory import Timeline, empty_cache
from .topology import SyncError, cpu_group, SyncTopology, agree, agree_values, let_go_of_frames
from .transport import SyncContext, SyncStats, make_transport
from .verify import SampleTurns, verify_engines

__all__ = ["FSDPShardingManager", "SyncStats", "STAGE_SETTINGS"]

log = logging.getLogger("fsdp_sync")


STAGE_SETTINGS = ("method", "lora", "multi_stage_wake_up", "free_cache_engine", "offload_params",
                  "pause_mode", "on_replica_failure")
"""`SyncConfig` fields that decide the manager's stages and the collectives around them, compared
across the trainer ranks in the first stage's agree (its digest: no round trip of its own), before
any collective that would not match: ``pause_mode`` (the pause's and continue's agrees run only
under one), ``method`` and ``lora`` (the fleet's agree, the adapter's stage), ``on_replica_failure``
(whether a failed sync is sent again), and the ones that decide which engine-memory stages run and
what stays on the accelerator (``multi_stage_wake_up``, ``free_cache_engine``, ``offload_params``);
with them the mesh's layout (``mesh``: dims and ranks) and the manager's ``global_steps`` (the version's name, and which tensors a ``verify="sample"``
gathers: set on rank 0 alone, FSDP2's gathers of other tensors aborted gloo) and ``base_sync_done``
(``lora="adapter"``: whether the base goes, with its own checks' agrees). Before, each rank
acted on its own: under another ``pause_mode`` both ranks blocked until the process group's
timeout, then raised raw gloo errors. (The export's own settings are compared with the model,
`weights.export_checks.SETTINGS`.)"""

_SETTINGS = object()        # `_run`'s settle: agree with `STAGE_SETTINGS` compared
_SETTINGS_WHY = ("The ranks would run different stages and collectives (a hang until the process "
                 "group's timeout, or memory held on some ranks only); nothing was sent. Pass "
                 "every rank the same SyncConfig, and set global_steps and base_sync_done alike "
                 "on every rank")


class FSDPShardingManager:
    """Syncs ``module``'s weights into ``engine`` on entry; gives memory back to training on exit.

    Args:
        module: the FSDP2, FSDP1 or plain module being trained: the same model on every rank
            (compared before each sync's first collective, `weights.export_checks`).
        engine: ``method="tensor"``: the colocated engine handle on infer-TP rank 0 of each group,
            ``None`` elsewhere. ``"distributed"``/``"disk"``: on trainer rank 0 the engine, or a
            list of engines (rollout replicas); ``None`` on every other rank.
        mesh: a DeviceMesh with dims ``("dp", "infer_tp")`` over every rank of the default
            process group (the trainer ranks; a mesh over part of it is refused); required by
            ``"tensor"``, optional otherwise (then the trainer is the default process group).
        config: a `SyncConfig`; ``config.method`` picks the transport (`fsdp_sync.transport`).

    The transport's ``colocated`` flag is the one rule for the engine-memory stages: they run
    (resume on entry, release on exit) only when the engine shares the trainer's devices.
    `close` (also at interpreter exit) releases what the transport holds (the update group).
    """

    def __init__(self, module: torch.nn.Module, engine: Any, *, mesh=None,
                 config: SyncConfig | Mapping[str, Any] | None = None, peft_config: Any = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be the torch.nn.Module being trained (FSDP2, FSDP1 or "
                            f"plain), got {type(module).__name__} {module!r:.60}")
        if isinstance(config, Mapping):
            config = SyncConfig.from_dict(config)
        elif config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig or a mapping of its keys, got "
                            f"{type(config).__name__} {config!r:.60}")
        self.module = module
        self.config = config or SyncConfig()
        # lora="adapter": peft config (no peft model), base_sync_done, engine id -> base weight_version
        self.peft_config, self.base_sync_done, self.lora_base = peft_config, False, {}
        lora_sync.check_mode(module, self.config)
        if mesh is None and self.config.method == "tensor":
            raise ValueError("method='tensor' needs mesh= (a ('dp', 'infer_tp') DeviceMesh, see make_mesh); "
                             "only 'distributed' and 'disk' run without one")
        self.topo = SyncTopology.from_mesh(mesh) if mesh is not None else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.config.method == "tensor":
            holder, where = self.topo.is_tp_src, f"{self.topo.describe()}: infer-TP rank 0"
        else:
            holder, where = self.rank == 0, f"trainer rank {self.rank}: trainer rank 0"
        if holder and (engine is None or (isinstance(engine, (list, tuple)) and not engine)):
            raise ValueError(f"{where} needs an engine handle (method {self.config.method!r}), got {engine!r}")
        if not holder and engine is not None:
            raise ValueError(f"{where.split(':')[0]}: only {where.split(': ')[1]} holds the engine; "
                             f"pass engine=None on the other ranks")
        if isinstance(engine, (list, tuple)):
            if self.config.method == "tensor" and len(engine) != 1:
                raise ValueError(f"method='tensor' takes one colocated engine per infer-TP group, "
                                 f"got a list of {len(engine)}")
            engines = list(engine)
            missing = [i for i, e in enumerate(engines) if e is None]
            if missing:     # else a replica that fails every sync, said to hold partial weights
                raise ValueError(f"{self._where()}: engine[{missing[0]}] of the {len(engines)} "
                                 f"engines is None: pass each replica's engine handle (leave out one "
                                 f"not started)")
        else:
            engines = [] if engine is None else [engine]
        self.fleet = Fleet(engines)
        self.transport = make_transport(self.config)
        self.step = 0
        self._configs_checked: dict[int, Any] = {}  # engine id -> the trainer's config key it matched
        self.version: str | None = None       # the weight version every serving replica committed
        self.global_steps: int | None = None  # set by the caller: the next sync's version is it
        self.sample_turns = SampleTurns()     # verify="sample": which tensors each verify checks
        self.timeline, self.watch = Timeline(), {}   # watch: stage name -> `Timeline.watch`
        self.stats = SyncStats()
        self._inside = False
        self._failed: tuple[str, str] | None = None   # an unsettled stage's failure (`_run`)
        self._modes: dict[torch.nn.Module, bool] | None = None   # each submodule's train/eval at entry
        self._offloaded: dict[str, torch.device] = {}
        self._tp_sizes: list[int] | None = None      # per-TP-rank batch sizes of preprocess_data
        # generation RNG: seeded by dp rank, hence equal on every TP rank of a group
        self._rng = RolloutRng(self.config.seed + (self.topo.dp_rank if self.topo is not None else self.rank))
        _open.add(self)

    @property
    def engines(self) -> list:
        """The engines (rollout replicas) in service on this rank; [] on the ranks that hold none."""
        return [r.engine for r in self.fleet.serving]

    @property
    def engine(self) -> Any:
        engines = self.engines
        return engines[0] if engines else None

    @property
    def _holds_engine(self) -> bool:
        return bool(self.fleet.replicas)

    # ------------------------------------------------------------------ the with block
    def __enter__(self) -> "FSDPShardingManager":
        if self._inside:
            raise RuntimeError("FSDPShardingManager is not re-entrant: already inside its with block")
        self._refuse_closed("")   # with several ranks: agreed at the first stage (`_prepare`)
        self._failed = None     # one an interrupt kept from its agree is that block's, raised with it
        pids = [p for e in self.engines for p in (getattr(e, "worker_pids", None) or [])]
        self.timeline = Timeline(engine_pids=pids, mode=self.config.memory_probe, watch=self.watch)
        if self._modes is None:     # else the last block's restore_module did not run: keep its
            self._modes = {m: m.training for m in self.module.modules()}
        self._tp_sizes = None                      # preprocess_data's sizes belong to one block
        try:   # settle=False: no collective inside; agreed with the next stage (`_run`)
            self._run("prepare", self._prepare, settle=False)
            if self.config.multi_stage_wake_up:   # `STAGE_SETTINGS` compared in its agree
                self._run("resume_weights", self._resume, ["weights"], settle=_SETTINGS)
                self._run("sync_weights", self._sync_weights)
                self._run("offload_params", self._offload_params, settle=False)
                self._run("resume_kv_cache", self._resume, ["kv_cache"], settle=False)
            else:
                self._run("resume_all", self._resume, None, settle=_SETTINGS)
                self._run("sync_weights", self._sync_weights)
                self._run("offload_params", self._offload_params, settle=False)
            self._run("swap_rng", self._swap_rng)
        except BaseException as exc:
            self._restore(release=True, original=exc)
            raise
        self._inside = True
        if self.rank == 0:
            log.info("fsdp_sync enter: %s", self.timeline.summary())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._inside = False
        self._restore(release=True, original=exc, collective=True)
        if self.rank == 0:
            log.info("fsdp_sync exit: %s", self.timeline.summary())

    async def wake_up(self) -> None:
        """The same stages as ``__enter__``, for async rollouts."""
        self.__enter__()

    async def sleep(self) -> None:
        """The same stages as ``__exit__``, for async rollouts."""
        self.__exit__(None, None, None)

    # ------------------------------------------------------------------ data
    def preprocess_data(self, batch: Any) -> Any:
        """All-gather a batch across infer_tp so every TP rank of a group runs the same prompts
        (`tp_batch.gather`: a dict of tensors/lists, or a verl ``DataProto``); sizes may differ
        per rank (kept for `postprocess_data`); a bad batch raises on every rank."""
        batch, self._tp_sizes = tp_batch.gather(self.topo, batch)
        return batch

    def postprocess_data(self, batch: Any) -> Any:
        """Keep this rank's part of a batch that `preprocess_data` gathered in this ``with``
        block (its own size, in TP-rank order; k times it when each prompt became k samples);
        without a preceding `preprocess_data`, an even split (`tp_batch.keep_own`)."""
        return tp_batch.keep_own(self.topo, batch, self._tp_sizes)

    # ------------------------------------------------------------------ stages
    def _run(self, name: str, fn, *args, settle: Any = True) -> None:
        """Run a stage on every rank; any rank's failure becomes a SyncError on all ranks (with
        ``settle=False``, one agreed with the next settled stage: the failed rank runs none;
        ``_SETTINGS``: the ranks' `STAGE_SETTINGS` compared in the same agree)."""
        with self.timeline.stage(name):
            try:
                if self._failed is None:    # after a failed, unsettled stage this rank runs nothing
                    fault_point("trainer", self.rank, name)   # FSDP_SYNC_FAULT (tests, fsdp-sync faults)
                    fn(*args)
            except SyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to every rank just below
                self._failed = (f"stage {name!r}", f"{type(exc).__name__}: {exc}")
            if settle:
                failed, self._failed = self._failed, None
                if settle is _SETTINGS:
                    values = self._stage_values()
                    gs = self.global_steps      # the version's name, verify="sample"'s turns
                    values["FSDPShardingManager.global_steps"] = gs if gs is None else str(gs)
                    if self.config.lora == "adapter":       # whether the base goes (`lora_stage`)
                        values["FSDPShardingManager.base_sync_done"] = bool(self.base_sync_done)
                    agree_values(failed, values, what="entering the with block", why=_SETTINGS_WHY)
                else:
                    self._agree(failed, what=f"stage {name!r}")

    def _prepare(self) -> None:
        self._refuse_closed("", here=True)    # a rank's closed manager: every rank raises it
        empty_cache()  # before resuming engine memory: verl's first-iteration OOM
        self.module.eval()

    def _swap_rng(self) -> None:
        self._rng.swap()

    def _resume(self, tags: list[str] | None) -> None:
        tags = lora_sync.memory_tags(self.config, tags)   # lora="adapter": the KV cache only
        # a closed manager's (on one rank: refused at `_prepare`, then released): no engine is touched
        if tags != [] and self.config.free_cache_engine and self.transport is not None and self.transport.colocated:
            for engine in self.engines:
                engine.resume_memory_occupation(tags=tags)

    def _release(self) -> None:
        tags = lora_sync.memory_tags(self.config, ["kv_cache", "weights"])
        if self.config.free_cache_engine and self.transport is not None and self.transport.colocated:
            for engine in self.engines:
                engine.release_memory_occupation(tags=tags)

    def _offload_params(self) -> None:
        if self.config.offload_params:
            for name, p in self.module.named_parameters():
                if p.device.type != "cpu":
                    self._offloaded[name] = p.device
            if self._offloaded:
                move_params(self.module, "cpu")
        empty_cache()   # offloaded or not: the sync's freed buffers are not kept while the KV cache resumes

    def _reload_params(self) -> None:
        if self._offloaded:
            move_params(self.module, next(iter(self._offloaded.values())))
            self._offloaded.clear()

    def _restore(self, *, release: bool, original: BaseException | None = None,
                 collective: bool = False) -> None:
        """Exit stages; each runs even if an earlier one failed. The first error is raised, unless
        an exception is already propagating (``original``): that one wins, and ours are attached
        to it as notes (a dead engine cannot release memory, but the caller must see why it died).

        ``collective`` (``__exit__``): the ranks then agree, so an error on any rank (a worker that
        died during the rollout, an exception inside the block on one rank) raises the same
        `SyncError` on every rank instead of letting the others leave the block and block in
        their next collective."""
        errors: list[BaseException] = []
        for name, fn in (("release_memory", self._release if release else (lambda: None)),
                         ("restore_module", self._restore_module),
                         ("restore_rng", self._rng.restore)):
            try:
                with self.timeline.stage(name):
                    fault_point("trainer", self.rank, name)
                    fn()
            except BaseException as exc:  # noqa: BLE001 - finish restoring, then raise
                errors.append(exc)
        # a Ctrl-C or exit while restoring comes out as itself, even over an error on its way out:
        # a loop catching SyncError (or Exception) to retry must not swallow it (the other ranks
        # get the SyncError of the agree)
        interrupt = next((e for e in errors if not isinstance(e, Exception)), None)
        if original is not None and not isinstance(original, Exception):
            interrupt = None                        # already an interrupt on its way out: it wins
        agreed: SyncError | None = None
        if collective:
            mine = errors[0] if errors else (
                None if original is None else f"{type(original).__name__}{_INSIDE}: {original}")
            try:
                self._agree(mine, what="exit")
            except SyncError as exc:
                agreed = exc
                if original is None and interrupt is None:
                    raise
                if original is not None and not _only_passed_on(exc):   # some rank's restoring failed
                    errors = [exc]
        if interrupt is not None:
            if original is not None:
                interrupt.add_note(f"while restoring after {type(original).__name__}: {original}")
            raise interrupt from (original if original is not None else agreed)
        if errors and original is None:
            raise errors[0]
        for err in errors:
            if hasattr(original, "add_note"):
                original.add_note(f"while restoring after it: {type(err).__name__}: {err}")
            log.warning("fsdp_sync: restoring after %s failed too: %s", type(original).__name__, err)

    def _restore_module(self) -> None:
        modes, self._modes = self._modes, None
        for m, training in (modes or {}).items():     # each one's own: a frozen block stays in eval
            m.training = training
        self._reload_params()
        empty_cache()

    # ------------------------------------------------------------------ the sync
    def _check_coverage(self) -> None:
        """A full sync must leave every weight the engine holds equal to the trainer's: an engine
        that lists its weights (``hf_names()``) and holds one the trainer does not export (an
        untied lm_head behind a tied trainer) fails the sync on every rank, naming the tensor,
        before anything is sent. (What is sent but not held is refused by the engine itself.)"""
        err = None
        for engine in self.engines:
            if err is not None:
                break
            try:
                self._check_config(engine)        # each engine, a replica added later too
                names = getattr(engine, "hf_names", None)
                if not callable(names):
                    continue
                sent = {m.name for m in quantize.sync_metas(self.module, self.config)}
                missing = [n for n in names() if n not in sent]
                if missing:
                    err = (f"the engine holds {missing[:5]}{' …' if len(missing) > 5 else ''} "
                           f"({len(missing)} tensors) that the trainer does not export, so a sync "
                           f"would leave them stale; {self._what_differs(missing, sent, names())} "
                           f"({self._where()})")
            except Exception as exc:  # noqa: BLE001 - reported to every rank just below
                err = f"{type(exc).__name__}: {exc}"
        # agreed with the ranks' model digests (ranks holding other models would block in the
        # export's collectives), then the tied head (`export_checks.check_module`)
        export_checks.check_module(self.module, self.config, err, what="weight sync")

    def _check_config(self, engine: Any) -> None:
        """`config_check.check_engine` (TP, quantization, math) at the first sync with ``engine``,
        and again whenever the trainer's config changed since (a value edited between syncs)."""
        from .config_check import check_engine, math_key

        key = math_key(self.module)
        if self._configs_checked.get(id(engine), _UNCHECKED) != key:
            check_engine(self.module, engine, self.config, self.topo, where=self._where())
            self._configs_checked[id(engine)] = key

    def _what_differs(self, missing: list[str], sent: set[str], held: list[str]) -> str:
        from .config_check import model_config

        cfg = model_config(self.module)
        if missing == ["lm_head.weight"] and cfg is not None:
            if getattr(cfg, "tie_word_embeddings", False):
                return ("the trainer ties lm_head to embed_tokens (tie_word_embeddings=True) and the "
                        "engine keeps its own lm_head; start the engine from the trainer's config")
            return ("the trainer's config unties lm_head (tie_word_embeddings=False), but its module "
                    "holds lm_head and embed_tokens as one tensor (tied by hand, or by tie_weights()), "
                    "which is exported once: give lm_head a Parameter of its own, or set "
                    "tie_word_embeddings=True in the trainer's and the engine's configs")
        extra = sorted(set(sent) - set(held))
        return (f"the models differ: the engine holds {len(held)} tensors, the trainer exports "
                f"{len(sent)}" + (f" (the trainer's {extra[:3]} are not in the engine)" if extra else "")
                + "; start the engine from the trainer's config")

    def _where(self) -> str:
        return self.topo.describe() if self.topo is not None else f"trainer rank {self.rank}"

    @staticmethod
    def _agree(err, *, what: str) -> None:
        """`agree` over the trainer's ranks (``err`` may be ``(what, text)``); a one-process
        trainer without a process group (disaggregated) raises its own error (`agree` too)."""
        agree(err, what=what)

    def _sync_weights(self) -> None:
        """Every weight; lora="adapter": the base once (again once ``base_sync_done`` is set False),
        then the adapter alone (`lora_stage.sync_weights`). What goes to an engine by CUDA IPC
        handles (the tensor method, a LoRA adapter) is allocated with expandable segments off
        (`weights.ipc_memory`): a consumer opens a block of one only with ptrace rights over us."""
        shares = self.config.method == "tensor" or self.config.lora == "adapter"
        with ipc_memory.shareable() if shares else nullcontext(False) as switched:
            if self.config.lora == "adapter":      # it pauses once, around base and adapter
                lora_stage.sync_weights(self, self._sync_full, self._agree, self._pause, self._continue)
            else:
                self._sync_full()
        if switched:
            self.stats.extra["expandable_segments"] = ipc_memory.SWITCHED

    def _sync_full(self, hold: Any = None) -> None:
        """The full sync; ``hold(targets)``: the caller's pause instead of this one's (it resumes)."""
        targets = self._targets()
        if self._fleet_mode:        # no replica to take it (all out of service, or none left):
            why = None              # no version nobody holds. Agreed, not broadcast: a rank that
            if self.rank == 0 and not targets:      # failed entering this stage is in its agree
                why = self.fleet.no_target(self._next_version())
            try:
                self._agree(why, what="weight sync")
            except SyncError:
                self.step += 1        # counted, as for any failed sync
                raise
        self._check_coverage()
        if self.transport is None:
            raise RuntimeError("the manager was closed; make a new FSDPShardingManager")
        version = self._next_version()
        paused = self._pause(targets) if hold is None else hold(targets) or []
        kept: list = []       # replicas that kept part of a failed attempt (`manager_pause.stall`)
        try:
            err, ctx = self._transport_sync(targets, version, self.step)
            kept = manager_pause.kept_part(targets)
            if getattr(ctx, "commit_failed", None) is not None:
                kept = []        # a fleet's failed commits: `after_failure` holds them (or blames)
            if err is not None:
                targets, again = manager_fleet.after_failure(self, targets, err, ctx, version)
                if again:           # quarantined: again, without them (rank 0's word, every rank)
                    err, _ = self._transport_sync(targets, version, self.step)
                    kept = [r for r in kept if r not in targets] + manager_pause.kept_part(targets)
                    if err is not None:
                        raise err
        except BaseException as exc:
            self.step += 1    # counted even if the sync failed: the disk method named its version
            # what the transport noted before an interrupt (or any raise) cut it short, too
            kept = kept + [r for r in manager_pause.kept_part(targets) if r not in kept]
            try:
                manager_pause.stall(self, kept, exc)     # no generation on partly new weights
                self._continue(paused)
            except Exception as cont:  # noqa: BLE001 - the sync's error is the one to raise
                exc.add_note(f"and then: {cont}")
            raise
        self.step += 1
        manager_pause.stall(self, [r for r in kept if r not in targets], None)
        for rep in targets or []:
            if not rep.serving or rep.untold:      # quarantined, healthy again, synced now (or
                self.fleet.reinstate(rep, version)     # in service, but not told so yet: `reinstate`)
            rep.version = version
        self.version = version          # committed: said before generation is continued
        manager_pause.release(self, paused, targets or [], version, resume_now=hold is None)
        if self._fleet_mode and self.rank == 0:       # what a run's metrics log shows of the fleet
            out = self.fleet.out_of_service
            self.stats.extra.update(version=version, replicas_serving=len(self.fleet.serving),
                                    replicas_out=[f"{r.name}: {r.reason}" for r in out])
        if self.config.verify != "off":
            self._verify()

    def _next_version(self) -> str:
        return str(self.global_steps) if self.global_steps is not None else str(self.step)

    # ------------------------------------------------------------------ the fleet (`fsdp_sync.fleet`)
    def _from_rank0(self, obj: Any, *, compared: str | None = None) -> Any:
        """``obj`` as trainer rank 0 has it, on every rank (the fleet's decisions are its).
        ``compared`` (what is being done: ``"recover"``): the ranks' `STAGE_SETTINGS` are
        compared in the same collective (gathered, not broadcast: no round trip of its own), and
        where they differ every rank raises the same `SyncError` naming each one, as the first
        stage's agree does (`recover` / `add_engine` may come before any ``with`` block)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        if compared is None:
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=cpu_group())
            return box[0]
        mine = {k: repr(v) for k, v in self._stage_values().items()}
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, (obj if self.rank == 0 else None, mine, self.transport is None),
                               group=cpu_group())
        closed = [r for r, (_, _, c) in enumerate(got) if c]
        if closed:
            raise SyncError(self._closed_text(f"{compared}: ", closed))
        parts = []
        for key in mine:
            held: dict[str, list[int]] = {}
            for r, (_, vals, _) in enumerate(got):
                held.setdefault(vals.get(key, "(not set)"), []).append(r)
            if len(held) > 1:
                parts.append(f"{key} is " + ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                                                      f"{rs if len(rs) > 1 else rs[0]}" for v, rs in held.items()))
        if parts:
            raise SyncError(f"{compared} failed: the ranks' settings differ: {'; '.join(parts)}. "
                            f"{_SETTINGS_WHY}")
        return got[0][0]

    def _stage_values(self) -> dict:
        """This rank's `STAGE_SETTINGS`, by name, as the ranks compare them, and its mesh's layout
        (ranks that built different meshes gather and call engines over different groups)."""
        values: dict = {f"SyncConfig.{f}": getattr(self.config, f) for f in STAGE_SETTINGS}
        mesh = self.topo.mesh if self.topo is not None else None
        values["mesh"] = mesh if mesh is None else {
            **dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape)), "ranks": mesh.mesh.tolist()}
        return values

    @property
    def _fleet_mode(self) -> bool:
        """Fleet decisions (quarantine, recover, add/remove) are trainer rank 0's; the tensor
        method's engines are colocated, one per infer-TP group, fixed by placement."""
        return self.config.method != "tensor"

    def _targets(self) -> list:
        """The replicas this sync goes to (`manager_fleet.targets`)."""
        return manager_fleet.targets(self)

    def _transport_sync(self, targets: list, version: str | None, step: int, reload: bool = False):
        ctx = SyncContext(module=self.module, config=self.config, topo=self.topo, group=None,
                          engines=[r.engine for r in targets], step=step, stats=SyncStats(),
                          version=version, reload=reload)
        fleet.take_noted()       # what an earlier sync's transport noted is not this one's
        try:
            self.transport.sync(ctx)
            return None, ctx
        except SyncError as exc:
            let_go_of_frames(exc)
            return exc, ctx
        finally:
            self.stats = ctx.stats

    def _pause(self, targets: list) -> list:
        return manager_pause.pause(self, targets)      # `SyncConfig.pause_mode`

    def _continue(self, paused: list) -> None:
        manager_pause.resume(self, paused)

    def fleet_status(self) -> dict:
        """The published version and, on trainer rank 0, each replica's state and version."""
        return {"version": self.version, **self.fleet.summary()}

    def recover(self, engine: Any = None) -> bool:
        """Bring a quarantined replica back at the current version (`fleet`). Called on every
        trainer rank (``engine`` on trainer rank 0, None elsewhere). ``disk``: it loads now the
        directory the replicas in service loaded (not one a failed sync published since; refused
        if its files are gone). ``distributed``: inside the ``with`` block (the trainer's weights
        are that version) it is sent them now; outside (after a failed sync too), the trainer may
        have stepped since, so it rejoins at the next sync (returns False), as one holding partly new
        weights from a failed sync does before any version was committed. ``lora="adapter"``: the
        base, then the adapter the others serve (`lora_stage.bring_adapter`). Returns whether it
        serves now; raises naming the replica if it cannot take updates. Refused for
        ``method='tensor'`` (no replica goes out of service there: each sync sends them all)."""
        self._refuse_closed("recover: ")     # with several ranks: agreed in `bring_in`
        return manager_fleet.bring_in(self, engine, "recover")    # (refused there for 'tensor')

    def add_engine(self, engine: Any = None) -> bool:
        """Add a replica between syncs (called on every trainer rank, ``engine`` on trainer rank
        0): it is out of service until it holds the current version, brought to it as `recover`
        does, then handed to the router (its /health turns 200). Refused for ``method='tensor'``:
        colocated engines are fixed by placement."""
        self._refuse_closed("add_engine: ")  # with several ranks: agreed in `bring_in`
        added, refused = None, None
        # refused on every rank alike (`bring_in`): a rank raising alone left the others in its collective
        if self.rank == 0 and self._fleet_mode and self.transport is not None:
            try:
                if engine is None:
                    raise ValueError("add_engine: trainer rank 0 passes the engine (None on the others)")
                added = self.fleet.add(engine, serving=False)   # told it is joining once not
            except ValueError as exc:                             # refused (`bring_in`)
                refused = str(exc)
        try:
            return manager_fleet.bring_in(self, engine, "add_engine", refused=refused)
        except BaseException as exc:      # refused or failed: not in the fleet (no replica left 'joining')
            note = manager_fleet.not_added(self, self.fleet.remove(engine), exc) if added else None
            if isinstance(exc, SyncError):
                raise fleet.restate(exc, f"{exc}; it was not added to the fleet" + (
                    f"; {note}" if note else "")) from None
            raise

    def quarantine(self, engine: Any = None, reason: str = "taken out of service by hand") -> None:
        """Take a replica out of service (trainer rank 0; a no-op elsewhere), e.g. to drain it:
        it is told so (`fsdp-sync serve` answers 503 on /health and /generate, and a router stops
        sending to it), no sync goes to it, and only `recover` brings it back. Refused for
        ``method='tensor'``, as `add_engine` and `remove_engine` are."""
        self._refuse_placed("quarantine", "taking a replica out of service")
        if self.rank == 0:
            rep = self.fleet.find(engine)
            self.fleet.quarantine(rep, reason)
            rep.held = True

    def remove_engine(self, engine: Any = None) -> None:
        """Take a replica out of the fleet (trainer rank 0; a no-op elsewhere): no later sync
        goes to it (the distributed method's update group is made again without it); a sync with
        none left is refused, naming `add_engine`. One holding partly new weights from a failed
        sync is let go as `manager_pause.let_go` says (its requests aborted, kept paused, out of
        service): no sync will make it whole any more. Refused for ``method='tensor'``."""
        self._refuse_placed("remove_engine", "removing a replica")
        if self.rank == 0:
            manager_pause.let_go(self, self.fleet.remove(engine), "remove_engine")

    def _refuse_placed(self, what: str, needs: str) -> None:
        """Refused on every rank, the fleet untouched: the tensor method's engine is each infer-TP
        group's own (its sync would find none there and fail every time after)."""
        if not self._fleet_mode:
            raise ValueError(f"{what}: method='tensor' engines are colocated with the trainer ranks, "
                             f"one per infer-TP group, fixed by placement; {needs} needs "
                             f"method='distributed' or 'disk'")

    def _refuse_closed(self, what: str, here: bool = False) -> None:
        """Refused before anything moves (the fleet untouched): a closed manager has no transport.
        Raised here where this process is the whole job (or ``here``: inside a stage, which its
        runner agrees); with several ranks the closure is agreed where they next meet, so every
        rank raises it: the with block's first stage (`_prepare`), `recover` / `add_engine`'s
        `_from_rank0`. Raised on the closed rank alone, the others waited in that collective
        until the process group's timeout."""
        if self.transport is None and (here or not (dist.is_initialized() and dist.get_world_size() > 1)):
            raise RuntimeError(self._closed_text(what))

    def _closed_text(self, what: str, ranks: list[int] | None = None) -> str:
        where = "" if ranks is None else (f" on trainer rank{'s' if len(ranks) > 1 else ''} "
                                          f"{', '.join(map(str, ranks))}")
        return (f"{what}this FSDPShardingManager was closed{where} (close(), or interpreter exit): "
                f"make a new one{' on every rank' if ranks else ''} to sync again")

    def _verify(self) -> None:
        """`SyncConfig.verify`: compare what the engines now serve with the trainer's tensors
        (`fsdp_sync.verify`); a mismatch raises the same `SyncError` on every rank."""
        try:    # "sample": this manager's turns (`verify.SampleTurns`), from the run's step
            err, figures = verify_engines(self.module, self.config, self.engines,
                                          self.sample_turns.next(self.global_steps))
        except Exception as exc:  # noqa: BLE001 - reported to every rank just below
            err, figures = f"{type(exc).__name__}: {exc}", {}
        self.stats.extra.update(figures)
        self._agree(err, what=f"verify={self.config.verify!r}")

    def close(self) -> None:
        """Close the transport (distributed: destroy the weight-update group). Idempotent; also
        runs at interpreter exit."""
        if getattr(self, "_inside", False):
            raise RuntimeError("close() inside the with block: leave the block first (its exit gives "
                               "the engine's memory back and restores the module), then close()")
        transport, self.transport = getattr(self, "transport", None), None
        lora_sync.close(self)     # the adapter's export kept between syncs
        if transport is not None:
            transport.close()


def move_params(module: torch.nn.Module, device: Any) -> None:
    """``module.to(device)``, FSDP1's flat parameters first by their handles with ``_local_shard``
    re-pointed (verl's offload_fsdp_model_to_cpu): FSDP1 sets ``flat_param.data`` back to it after
    every unshard, so ``.to`` alone kept the GPU shard. FSDP2 re-points its own (``_apply``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    for h in (unit._handle for unit in FSDP.fsdp_modules(module)):
        if h is not None and not h._offload_params:    # CPUOffload's shards: FSDP's to move
            h.flat_param_to(device)
            h.flat_param._local_shard = h.flat_param.data
    module.to(device)


_INSIDE = " inside the with block"
_UNCHECKED = object()


def _only_passed_on(exc: SyncError) -> bool:
    """Whether every rank that failed the exit's `agree` only passed on an exception raised inside
    its ``with`` block (``"<Type> inside the with block: ..."``; a failed exit stage reads
    ``"<Type>: ..."``): then restoring went well everywhere, and that exception is all there is."""
    return bool(exc.failures) and all(m.split(": ", 1)[0].endswith(_INSIDE) for m in exc.failures.values())


_open: "weakref.WeakSet[FSDPShardingManager]" = weakref.WeakSet()


@atexit.register
def _close_open_managers() -> None:
    for manager in list(_open):
        try:       # one the program left inside its block (wake_up without sleep) is never left:
            manager._inside = False       # its transport is closed all the same (the update group)
            manager.close()
        except Exception as exc:  # noqa: BLE001 - interpreter exit: report, go on
            log.warning("fsdp_sync: closing a sharding manager at exit: %s", exc)
