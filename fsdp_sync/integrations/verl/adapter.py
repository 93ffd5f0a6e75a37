"""verl's rollout adapter with fsdp_sync's sync: flattened buckets behind verl's SGLang rollout.

`register` (called by the plug-in, ``fsdp_sync.integrations.verl``) maps ``("sglang", "async")`` in
verl's rollout registry to `SGLangAdapter` and remembers what was there before (verl's own
``ServerAdapter``, or whatever another plug-in put there).

Under ``rollout.name=sglang`` nothing changes until a run opts in with
``+actor_rollout_ref.rollout.custom.fsdp_sync.enable=true``: without it, building `SGLangAdapter`
returns the previous class's object, built with the same arguments (verl's ``ServerAdapter``
itself, not a look-alike), so installing fsdp_sync changes no run by itself. Under
``rollout.name=fsdp_sync_ref`` (`replica`) it is always on.

Opted in, `SGLangAdapter` is verl's colocated SGLang adapter with fsdp_sync's sync: verl's worker
still owns the export (``get_per_tensor_param``: one ``full_tensor()`` per parameter), the
resume/offload order and the barrier; ``update_weights`` streams verl's ``(name, tensor)``
generator into one reused flattened buffer per trainer rank (``bucket_bytes``, from verl's
``checkpoint_engine.update_weights_bucket_megabytes``) and hands each full bucket to the tensor
transport's send loop (`fsdp_sync.transport.tensor.TensorTransport.send`, the one the manager
uses): one handle per bucket per TP rank, ``gather_object`` to infer-TP rank 0, one
``update_weights_from_tensor(load_format="flattened_bucket")`` call, an all-reduced status so a
failure raises on every rank of the infer-TP group, then the buffer is reused. Extra memory at peak: the buffer plus the tensor being copied, at most 2 x bucket + the
largest tensor. A tensor larger than a bucket is sent alone, from a buffer of its own made after
the bucket buffer is freed (extra: 2 x that tensor while it is copied).
Calls are bracketed by ``begin_weight_update``/``end_weight_update`` (SGLang 0.5.21+; skipped on
older servers) and end with one ``flush_cache``. Each sync's seconds, bytes, tensors, buckets and
engine calls are logged on infer-TP rank 0 (logger ``fsdp_sync.verl``, level from
``VERL_LOGGING_LEVEL``, INFO by default), kept in `SGLangAdapter.last_stats`, returned from
``update_weights`` as ``fsdp_sync/*`` metrics (verl 0.9.1 drops that value in its colocated
``naive`` mode), and appended as a JSON line, with ``replica_rank``, to
``custom.fsdp_sync.metrics_file`` if set (a write that fails is a warning: `metrics.append`).

With ``verify`` (``"full"`` or ``"sample"``) infer-TP rank 0 keeps a digest of each tensor as it
is sent and, after the sync, compares the engine's digests of what it serves
(`verify.check_sent`; ``fsdp-sync serve`` reports them, SGLang cannot and the sync says so); a
difference raises on every rank. The digests go into the metrics-file line (``digests``).

Options, under ``+actor_rollout_ref.rollout.custom.fsdp_sync.``: ``enable``; ``base_url`` (the
server's URL where no Ray actor of verl's names one, e.g. ``fsdp-sync serve`` in a test; where
verl's server actor runs, base_url must be its address, or it is refused: verl generates from
that server); ``api_key``; ``metrics_file``; ``log_dir`` (where ``fsdp_sync_ref`` writes serve's
log); and the `fsdp_sync.config.SyncConfig` fields of `options.HONOURED` (``strategy``:
``flattened`` (default) or ``bucketed`` / ``per_tensor``, verl's own algorithm of one handle per
tensor, kept for comparison; ``bucket_bytes`` or ``bucket_mb``; ``dtype``; ``verify``;
``quantization``, leaving verl's ignored FP8 layers unquantized (`fp8_ignored`);
``dist_timeout_s``; ``share_host_memory``); another SyncConfig field is refused
naming the verl option that decides it (`options.INSTEAD`). The verl keys users already set are
read through `SyncConfig.from_verl`: bucket megabytes, ``free_cache_engine`` (resume and release
only when set, as verl does) and ``dtype`` (tensors are cast to it before they are flattened,
but for the float32 ones SGLang keeps in float32, sent as verl sends them: `float32_params`).
``param_offload`` stays verl's: its worker offloads the actor after ``update_weights``.

LoRA, as verl's own SGLang rollout serves it (`fsdp_sync.integrations.verl_lora`): with
``lora_rank`` > 0 and ``lora.merge=false`` verl's worker calls ``update_weights`` with its
``peft_config`` and ``base_sync_done``. ``base_sync_done=False``: the base weights, sent as above
with peft's ``.base_layer.`` dropped from their names, after rank 0 asked the engine whether it
would take the adapter (`verl_lora.engine_refusal`, agreed). ``base_sync_done=True``: the adapter only
(`_sync_adapter`): infer-TP rank 0 unloads verl's adapter name where the server lists it and loads
``lora_A``/``lora_B`` with the normalized peft config through SGLang's
``load_lora_adapter_from_tensors``; with ``verify`` it then reads the adapter's digests back
(``fsdp-sync serve``) and compares them bit for bit. Between syncs only the KV cache is released
(``sleep_level`` 1, as verl's). What cannot be done exactly is refused when the adapter is built,
naming verl's key (`verl_lora.refusal`). Merged LoRA (``lora.merge=true``) is a full sync.

Where verl's FSDP engine hands its module along (`module_stream`: wrapped when a run opts in) and
fsdp_sync's export would send exactly what verl's stream would, every rank agreeing, the buckets
come from fsdp_sync's own export of the module (`weights.export.iter_buckets`: a gather per
bucket, or none through a host-shared buffer) instead of verl's one ``full_tensor()`` per
parameter (LoRA streams keep verl's); the sync's ``export`` figure says which ran. The comparison
is made at the first sync and kept while the module is unchanged (`module_stream.ExportDecision`;
``export_decision``: ``made`` or ``kept``).

Before the first sync the engine is checked as the manager checks one (`engine_checks`:
`config_check.check_engine`; e.g. block FP8 of a Llama model, whose scales SGLang's own loader
drops, is refused). A refusal before verl's stream is walked still walks it (`stream.drained`), so
a checkpoint engine's sender is not left waiting out its timeout.

Not here (refused with an error when opted in): verl's delta checkpoint wire, prefill/decode
disaggregation, DeepSeek-V4 (`options.build_refusal`); starting SGLang (verl's Ray actors do).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from verl.workers.rollout import base as _verl_rollout_base

from ...weights import float32_params, handles, quantize
from ...weights.bucket import ALIGNMENT, SUPPORTED_DTYPES
from ..flush_retry import flush_after_sync
from ...topology import SyncTopology, group_ranks
from ...transport import SyncStats
from ...transport.tensor import Call, TensorTransport, engine_reads_outlast
from ...verify import sent_record
from ...wire import flattened_bucket
from .. import module_stream, peer_check, verl_lora
from . import engine_checks, fp8_ignored, metrics as step_metrics
from .options import (build_refusal, dtype_conflict, enabled, get_key, named_actor, options,
                      quantization_conflict, same_server, server_url, sync_config)
from .replica import ROLLOUT_NAME, server_name
from .stream import BucketBuffer, Walked, drained, pulled_in_a_thread, reuses_memory, timed
from .unreached import EngineUnreached, Unreached

__all__ = ["SGLangAdapter", "KEY", "VERL_DEFAULT", "enabled", "sync_config", "register"]

KEY = ("sglang", "async")
OURS = "fsdp_sync.integrations.verl.SGLangAdapter"   # the public path verl resolves

log = logging.getLogger("fsdp_sync.verl")
log.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

VERL_DEFAULT: str = "verl.workers.rollout.sglang_rollout.sglang_rollout.ServerAdapter"


def register() -> None:
    """Point verl's ``("sglang", "async")`` rollout at `SGLangAdapter` (idempotent)."""
    global VERL_DEFAULT
    reg = _verl_rollout_base._ROLLOUT_REGISTRY
    current = reg.get(KEY)
    if current and current != OURS:
        VERL_DEFAULT = current
    reg[KEY] = OURS


def _ipc_device() -> torch.device | None:
    """Where CPU tensors from verl's stream go before they are packed: this rank's GPU where CUDA
    is in use, so every bucket travels by CUDA IPC (None on a CPU host: shared memory)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _resolve(fqdn: str) -> type:
    module, _, name = fqdn.rpartition(".")
    return getattr(importlib.import_module(module), name)


class SGLangAdapter(_verl_rollout_base.BaseRollout):
    """verl's ``("sglang", "async")`` rollout. Without the opt-in, constructing it gives the
    previous adapter (verl's ``ServerAdapter``); with it, see the module docstring."""

    def __new__(cls, config: Any = None, model_config: Any = None, device_mesh: Any = None,
                *args: Any, **kwargs: Any):
        if not enabled(config):
            fallback = _resolve(VERL_DEFAULT)
            if fallback is cls:
                raise RuntimeError(f"{VERL_DEFAULT} resolves to fsdp_sync's adapter itself")
            return fallback(config, model_config, device_mesh, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config: Any, model_config: Any, device_mesh: Any,
                 replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        refusal = (verl_lora.refusal(self.config, self.model_config, ROLLOUT_NAME)
                   or build_refusal(self.config, self.model_config))
        if refusal:
            raise NotImplementedError(f"fsdp_sync's verl adapter: {refusal}")
        # LoRA served as an adapter (verl_lora): the base stays in the engine between syncs
        self.lora = verl_lora.served_as_adapter(self.model_config)
        module_stream.install()   # verl's FSDP engine hands its module along (`module_stream`)
        peer_check.announce()     # this rank runs fsdp_sync's adapter (`module_stream.calls` asks)
        opts = options(self.config)
        self.sync = sync_config(self.config, getattr(self.model_config, "hf_config", None))
        # the layers the FP8 engine keeps unquantized, as verl starts it (refused: a list that
        # SGLang and verl's quantizer read differently, `fp8_ignored`)
        self._fp8_ignored = () if self.sync.quantization is None else fp8_ignored.ignored_layers(
            get_key(self.config, "name"), getattr(self.model_config, "hf_config", None))
        self.base_url = opts.get("base_url")
        self.api_key = opts.get("api_key")
        self.metrics_file = opts.get("metrics_file")
        self.last_stats: dict[str, Any] = {}
        self._sent: Any = None     # what was sent, as the engine is checked (`verify.sent_record`)
        self._syncs = 0
        self._config_checked = False    # the served config matched the actor's (`engine_checks`)
        self._peers_checked = False     # every infer-TP rank runs this adapter (`peer_check`)
        self._pack_s = self._digest_s = 0.0
        self._buffer_hint = 0     # bytes the last sync's bucket buffer filled (`BucketBuffer`)
        self._ipc_device: torch.device | None = None   # where CPU tensors go first (`_ipc_device`)
        # the module export's exactness comparison, kept while the module is unchanged
        self._decision = module_stream.ExportDecision()
        self._topo: SyncTopology | None = None     # built once per device mesh (`_topology`)
        self._engine = None
        self._server_actor = None
        self._base_url_checked = False    # base_url is the server verl generates from (`_client`)
        self._unreached: str | None = None    # rank 0's error before a sync (`_unreachable`)
        tp = int(self.config.tensor_model_parallel_size)
        rollout_world = tp * int(self.config.data_parallel_size) * int(
            self.config.pipeline_model_parallel_size)
        rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
        local_world = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", rollout_world))
        self.replica_rank = rank // rollout_world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world
        self.node_rank = self.rollout_rank // local_world
        self.sleep_level = 1 if self.lora else 2    # verl's: 1 releases the KV cache only

    # ------------------------------------------------------------------ topology
    def _mesh(self):
        if self.device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            infer_tp = int(self.config.tensor_model_parallel_size) * int(self.config.data_parallel_size)
            infer_pp = int(self.config.pipeline_model_parallel_size)
            dp = dist.get_world_size() // (infer_tp * infer_pp)
            self.device_mesh = init_device_mesh("cpu", mesh_shape=(dp, infer_tp, infer_pp),
                                                mesh_dim_names=["dp", "infer_tp", "infer_pp"])
        return self.device_mesh["infer_tp"]

    def _is_leader(self) -> bool:
        return self._mesh().get_local_rank() == 0

    async def _client(self):
        """The SGLang client on infer-TP rank 0 (None elsewhere). With ``base_url``, every rank
        first checks once that it is the server verl generates from (`_check_base_url`)."""
        if self.base_url and not self._base_url_checked:
            await self._check_base_url()
        if self._engine is not None or not self._is_leader() or self._unreached:
            return self._engine
        from ...engines.sglang import SGLangEngine

        url = self.base_url
        if not url:
            import ray

            name = self._server_name()
            try:
                self._server_actor = ray.get_actor(name)
                url = server_url(*await self._server_actor.get_server_address.remote())
            except Exception as exc:  # noqa: BLE001 - told to the group (`_unreachable`)
                self._server_actor = None
                return self._unreachable(
                    f"verl's SGLang server of rollout replica {self.replica_rank} (Ray actor "
                    f"{name}) cannot be reached: {type(exc).__name__}: {exc}; it died or never "
                    f"started (see that replica's log), or no verl server runs it: then set "
                    f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url to the server's URL")
        # one payload per rank of verl's infer_tp mesh dim (tp x dp of the server), as verl sends
        # verl's replicas also release and resume SGLang's memory themselves (sleep_replicas), so
        # the adapter cannot know SGLang's state: verl's tags go as verl gives them
        self._engine = SGLangEngine(base_url=url, api_key=self.api_key, tp_size=self._mesh().size(),
                                    track_memory=False)
        return self._engine

    def _unreachable(self, why: str) -> None:
        """Infer-TP rank 0 could not reach its server: raised here where it is the group's only
        rank, else kept and raised on every rank at the sync's first agreement (`unreached`)."""
        why = f"fsdp_sync's verl adapter on infer-TP rank 0 (global rank {dist.get_rank()}): {why}"
        if self._mesh().size() == 1:
            raise EngineUnreached(why)
        log.error("%s (told to the infer-TP group at the sync's first agreement)", why)
        self._unreached = why

    def _server_name(self) -> str:
        """The Ray actor of this replica's server, the one verl's agent loop generates from."""
        if get_key(self.config, "name") == ROLLOUT_NAME:
            return server_name(self.replica_rank, self.node_rank)
        return f"sglang_server_{self.replica_rank}_{self.node_rank}"

    async def _check_base_url(self) -> None:
        """``base_url`` may name the server verl generates from (its actor's address), or stand
        where no such actor runs (a server of the caller's own, no Ray); a server beside verl's
        would be synced while rollouts come from stale weights in verl's: refused, on every rank
        (each looks the actor up), naming both. The same server is also told the step."""
        name = self._server_name()
        actor = named_actor(name)
        if actor is not None:
            served = server_url(*await actor.get_server_address.remote())
            if not same_server(self.base_url, served):
                raise ValueError(
                    f"rollout.custom.fsdp_sync.base_url={self.base_url!r} is not the server verl "
                    f"generates from: verl's Ray actor {name} serves replica {self.replica_rank} at "
                    f"{served}, and a sync to base_url would leave that server's weights unsynced "
                    f"while verl's agent loop generates from them; drop base_url (the adapter then "
                    f"syncs {name}) or set it to {served}")
            # verl's server runs rollout.quantization and rollout.dtype
            why = quantization_conflict(self.config) or (
                dtype_conflict(self.config, self.sync.dtype,
                               getattr(self.model_config, "hf_config", None))
                if "dtype" in options(self.config) else None)
            if why:
                raise ValueError(f"{why}; base_url={self.base_url!r} is verl's own server ({name})")
            self._server_actor = actor
        self._base_url_checked = True

    # ------------------------------------------------------------------ memory
    # the engine's HTTP calls run off the worker's event loop, as verl awaits its own
    async def resume(self, tags: list[str]):
        engine = await self._client()
        if engine is not None and self.config.free_cache_engine:
            try:
                await asyncio.to_thread(engine.resume_memory_occupation, tags=list(tags))
            except Exception as exc:    # verl's sync comes next: told to the group there
                if "weights" not in tags:
                    raise
                self._unreachable(f"resume_memory_occupation(tags={list(tags)}) of verl's SGLang "
                                  f"server failed: {type(exc).__name__}: {exc}")

    async def release(self):
        engine = await self._client()
        if engine is not None and self.config.free_cache_engine:
            await asyncio.to_thread(engine.release_memory_occupation,
                                    tags=["kv_cache"] if self.sleep_level == 1 else ["kv_cache", "weights"])

    # ------------------------------------------------------------------ the sync
    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                             global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs: Any):
        peft_config, base_sync_done = kwargs.get("peft_config"), kwargs.get("base_sync_done", False)
        try:
            engine = await self._ready(wire_format, peft_config)
            if self._unreached:     # rank 0: the group's first agreement raises it (`unreached`)
                engine, self._unreached = Unreached(self._unreached), None
        except Exception:
            self._unreached = None
            # verl's checkpoint engines' sender waits in its broadcast for every receiver: walked
            # to its end, so it ends now instead of after its timeout (`stream.drained`)
            await drained(weights)
            raise
        # the engine commits the weights named by verl's step, as SGLang's weight_version
        version = None if global_steps is None else str(global_steps)
        # verl's nccl receiver (and its kin) overwrite a yielded tensor's memory after a later pull
        reused = reuses_memory(weights)
        if peft_config and base_sync_done:      # the adapter only (verl's LoRA-as-adapter syncs)
            def run(it):
                return self._sync_adapter(it, engine, peft_config)
        else:
            def run(it):      # full weights; a LoRA run's base: peft's .base_layer. dropped
                if peft_config:
                    it = ((verl_lora.base_name(n), t) for n, t in it)
                return dict(self._sync(it, engine, version, reused=reused, walk_rest=not hasattr(
                    weights, "__aiter__"), peft_config=peft_config), kind="base" if peft_config else "full")
        if hasattr(weights, "__aiter__"):
            # verl's checkpoint engines (nccl, nixl, ...) hand an async generator: walked on this
            # loop, consumed by the sync in a thread
            stats = await pulled_in_a_thread(weights, run)
        else:
            stats = run(weights)
        if engine is not None:
            # retried as verl's own adapter does, off the event loop while it waits; refused
            # every time, the sync fails (a stale prefix cache would be a wrong result)
            await asyncio.to_thread(flush_after_sync, engine)
            if global_steps is not None and self._server_actor is not None:
                await self._server_actor.set_global_steps.remote(global_steps)
        stats["global_steps"] = global_steps
        self.last_stats = stats
        metrics = {f"fsdp_sync/{k}": v for k, v in stats.items()
                   if k in ("sync_s", "export_s", "pack_s", "digest_s", "transport_s", "bytes",
                            "tensors", "buckets", "engine_calls", "gbps", "verify_tensors",
                            "verify_s", "quantize_s")}
        if engine is not None:
            log.info("fsdp_sync verl %ssync (step %s): %.3f s (%s's export %.3f, packing %.3f, "
                     "hashing %.3f, handles + gather + engine %.3f), %s in %d tensors, "
                     "%d buckets, %d engine calls (%s)%s",
                     "" if stats["kind"] == "full" else stats["kind"] + " ", global_steps, stats["sync_s"],
                     stats.get("export", "verl"), stats["export_s"], stats["pack_s"], stats["digest_s"],
                     stats["transport_s"],
                     f"{stats['bytes'] / 2**20:.1f} MiB" if stats["bytes"] >= 2**20 / 10 else
                     f"{stats['bytes'] / 2**10:.1f} KiB", stats["tensors"], stats["buckets"],
                     stats["engine_calls"], stats["strategy"],
                     f", verify {stats['verify']}: {stats['verify_tensors']} tensors equal in "
                     f"{stats['verify_s']:.3f} s" if stats.get("verify_tensors") else "")
            if self.metrics_file:    # one line per replica and sync, whole (`metrics.append`)
                step_metrics.append(self.metrics_file, stats, self.replica_rank)
            await step_metrics.publish(stats)      # into verl's step metrics (`metrics`)
        return metrics

    async def _ready(self, wire_format: str, peft_config: Any) -> Any:
        """What is refused before verl's stream is walked (a wire format other than named tensors;
        a LoRA-as-adapter run's sync without its adapter; an adapter config the engine would serve
        otherwise than the trainer computes, `verl_lora.normalize_peft_config`, so at the base's
        sync too), then the engine's client (`_client`)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"fsdp_sync's verl adapter takes wire_format "
                                      f"'named_tensors', got {wire_format!r}; drop "
                                      f"rollout.custom.fsdp_sync.enable for verl's delta engine")
        if self.lora and not peft_config:
            raise NotImplementedError(f"fsdp_sync's verl adapter: {verl_lora.no_adapter_refusal(self.model_config)}")
        if peft_config:     # an adapter SGLang would serve otherwise: refused before the base goes
            verl_lora.normalize_peft_config(peft_config)
        return await self._client()

    def _topology(self) -> SyncTopology:
        """verl's ``infer_tp`` mesh dim as the tensor transport's topology (built once per
        device mesh: slicing the mesh costs about a millisecond a sync)."""
        tp = self._mesh()
        if self._topo is not None and self._topo.mesh is self.device_mesh:
            return self._topo
        dp = self.device_mesh["dp"]
        group = tp.get_group()      # tp_ranks in group-rank order, as get_local_rank counts
        self._topo = SyncTopology(mesh=self.device_mesh, rank=dist.get_rank(),
                            world_size=dist.get_world_size(), dp_rank=dp.get_local_rank(),
                            dp_size=dp.size(), tp_rank=tp.get_local_rank(), tp_size=tp.size(),
                            tp_ranks=group_ranks(group), tp_group=group)
        return self._topo

    def _sync(self, weights: Iterable[tuple[str, torch.Tensor]], engine: Any,
              version: str | None = None, reused: bool = False,
              walk_rest: bool = False, peft_config: Any = None) -> dict[str, Any]:
        """Every rank of the infer-TP group runs this in step; rank 0 holds ``engine``. The calls
        go through the tensor transport's send loop (`TensorTransport.send`): the update bracket,
        then per bucket gather to infer-TP rank 0, deliver, agree over the infer-TP group, free.
        ``reused``: the stream may overwrite a tensor once the next is pulled
        (`stream.reuses_memory`); what is held across a pull is then a copy. ``walk_rest``: after a
        failure, verl's colocated export is walked to its end (`stream.Walked`; fsdp_sync's own
        export of it: `module_stream`). ``peft_config``: a LoRA run's base, refused before it goes
        where the engine would refuse the adapter (`verl_lora.engine_refusal`)."""
        cfg, topo = self.sync, self._topology()
        counted = SyncStats()
        self._ipc_device = _ipc_device()
        if not self._peers_checked:     # before any weight moves: one protocol on every rank
            peer_check.check_group(topo.tp_ranks, cfg.dist_timeout_s)
            self._peers_checked = True
        # verify: infer-TP rank 0 records what it sends as it is sent (digests for fsdp-sync
        # serve, SGLang's per-rank hashes for SGLang), and after the sync compares what the
        # engine reports it serves (`verify.sent_record`); both agreed by the send loop
        self._sent = None
        self._pack_s = self._digest_s = 0.0
        figures: dict[str, Any] = {}

        def before(eng: Any) -> str | None:     # infer-TP rank 0, before any byte moves
            if isinstance(eng, Unreached):
                return eng.why
            why = peft_config and verl_lora.engine_refusal(
                eng, verl_lora.normalize_peft_config(peft_config), verify=cfg.verify)
            if why:     # a LoRA run's base, to an engine that would refuse every adapter sync
                return f"{why}; its base weights were not sent either: the engine keeps its weights"
            if cfg.verify != "off":
                refused = engine_checks.verify_refusal(self.config, self.sync, eng, topo)
                if refused:
                    return refused
                # the server's TP: verl starts SGLang with tp_size = tp x dp, infer_tp's size
                self._sent = sent_record(
                    eng, cfg.verify, self._syncs,
                    hf_config=getattr(self.model_config, "hf_config", None),
                    tp_size=topo.tp_size, dtype=cfg.dtype, quantization=cfg.quantization)
            # until a sync passed: the served model's math against the actor's
            return None if self._config_checked else engine_checks.config_error(
                self.model_config, self.sync, eng, topo)

        def check(eng: Any) -> str | None:
            err, more = self._sent.check(eng)
            figures.update(more)
            return err

        t0 = time.perf_counter()
        phases = {"export_s": 0.0, "pack_s": 0.0}
        # fsdp_sync's bucketed export from verl's FSDP module where it sends exactly what verl's
        # stream would (agreed by every rank), else verl's generator (`module_stream`)
        # SGLang at TP > 1 may answer before every rank read a CUDA bucket: buffers take turns
        lag = engine_reads_outlast(engine, topo, torch.cuda.is_available() and torch.cuda.is_initialized())
        steps = module_stream.calls(weights, cfg, topo, counted, phases, self._prepare,
                                    quantized=cfg.quantization is not None,
                                    decision=self._decision, lag=lag)
        exported_by = module_stream.EXPORT_VERL if steps is None else module_stream.EXPORT_MODULE
        quant = self._quantizer(topo) if cfg.quantization is not None else None
        walked = None
        if steps is None:
            walked = Walked(weights)
            stream = timed(walked, phases)
            if quant is not None:  # rollout.quantization: block FP8, after the cast, tensor by tensor
                stream = quant.named((n, self._cast(n, t) if n in quant.hf else t) for n, t in stream)
            # flattened copies each tensor into its bucket before the next pull: safe as it is
            steps = (self._flattened_calls(stream, topo, counted, lag=lag) if cfg.strategy == "flattened"
                     else self._per_tensor_handle_calls(stream, topo, counted, copy_held=reused))
        try:
            TensorTransport(cfg).send(steps, topo=topo, engine=engine, stats=counted,
                                      group=topo.tp_group, what="fsdp_sync verl sync",
                                      check=check if cfg.verify != "off" else None,
                                      version=version,
                                      # nothing to check or record: no agreement to pay for
                                      # (_config_checked is the same on every rank: set after
                                      # a sync that passed everywhere; a LoRA base: the adapter's
                                      # limits, asked at each base sync, a retry's too)
                                      before=before if cfg.verify != "off" or peft_config
                                      or not self._config_checked else None)
            self._config_checked = True
            sync_s = time.perf_counter() - t0 - figures.get("verify_s", 0.0)
        except Exception:
            if walk_rest:   # other replicas' ranks are in the export with this one
                walked.rest() if walked is not None else steps.close()   # (`module_stream`'s walks)
            raise
        finally:
            sent, self._sent = self._sent, None
            self._syncs += 1
        # where the seconds went on this rank: pulling verl's export (its full_tensor per
        # parameter), packing (casts, the copy into the bucket), hashing what is sent (verify
        # only), and the rest: handles, gather to infer-TP rank 0, the engine's calls, agreements
        phases["pack_s"] = self._pack_s
        phases["digest_s"] = self._digest_s
        phases["transport_s"] = max(0.0, sync_s - phases["export_s"] - phases["pack_s"]   # and FP8's
                                    - phases["digest_s"] - (quant.seconds if quant else 0.0))
        if exported_by == module_stream.EXPORT_MODULE:   # the comparison made, or kept
            phases["export_decision"] = "kept" if self._decision.kept else "made"
        out = {"strategy": cfg.strategy, "export": exported_by, "sync_s": sync_s, **phases,
               "bytes": counted.bytes,
               "tensors": counted.tensors, "buckets": counted.buckets,
               "engine_calls": counted.engine_calls, "bucket_bytes": cfg.bucket_bytes,
               "gbps": counted.bytes / sync_s / 1e9 if sync_s else 0.0, **figures}
        if quant is not None:
            out.update(quant.figures())
        if getattr(sent, "digests", None) is not None:
            out["digests"] = sent.digests
        return out

    def _sync_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], engine: Any,
                      peft_config: Any) -> dict[str, Any]:
        """One adapter-only sync (see the module docstring), on every rank of the infer-TP group:
        every rank walks verl's stream (full tensors already: verl gathered the adapter), rank 0
        checks the served model where no sync did yet (an adapter-only first sync), loads the
        adapter and, with ``verify``, reads it back (`verl_lora.sync_adapter`: a failure raises
        the same `SyncError` on every rank)."""
        cfg, topo = self.sync, self._topology()
        if not self._peers_checked:
            peer_check.check_group(topo.tp_ranks, cfg.dist_timeout_s)
            self._peers_checked = True
        phases, t0, named = {"export_s": 0.0, "pack_s": 0.0}, time.perf_counter(), []
        for name, t in timed(weights, phases):
            if engine is not None:
                t1 = time.perf_counter()
                named.append((name, self._cast(name, t).contiguous()))
                phases["pack_s"] += time.perf_counter() - t1
            del t
        check = None if self._config_checked or engine is None else (
            lambda: engine_checks.config_error(self.model_config, cfg, engine, topo))
        try:
            figures = verl_lora.sync_adapter(engine, named, peft_config, topo.tp_group, verify=cfg.verify, check=check)
            self._config_checked = True
        finally:
            self._syncs += 1
        sync_s = time.perf_counter() - t0 - figures.get("verify_s", 0.0)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        out = {"kind": "adapter", "strategy": "lora_adapter", "sync_s": sync_s, **phases,
               "digest_s": 0.0, "transport_s": figures["load_s"], "bytes": nbytes, "tensors": len(named),
               "buckets": 1 if named else 0, "engine_calls": figures["engine_calls"],
               "bucket_bytes": cfg.bucket_bytes, "gbps": nbytes / sync_s / 1e9 if sync_s else 0.0,
               "lora_name": verl_lora.LORA_NAME, "lora_r": figures["r"]}
        if cfg.verify != "off" and engine is not None:
            out.update(verify=cfg.verify, verify_tensors=figures.get("verify_tensors", 0),
                       verify_s=figures.get("verify_s", 0.0), digests=figures.get("digests", {}))
        return out

    def _quantizer(self, topo: SyncTopology) -> "quantize.StreamQuantizer":
        """The block-FP8 quantizer of verl's stream, from the model's HF config at the rollout's
        TP (a split that cuts a 128 block is refused, naming the tensor), leaving the engine's
        ignored layers in the rollout dtype (`fp8_ignored`)."""
        hf = getattr(self.model_config, "hf_config", None)
        if hf is None:
            raise ValueError("rollout.quantization=fp8: verl's model config has no hf_config to read "
                             "which tensors to quantize from")
        return fp8_ignored.quantizer(get_key(self.config, "name"), hf, self.sync, topo.tp_size,
                                     self._fp8_ignored)

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the rollout dtype, or float32 where SGLang keeps it so (`float32_params`)."""
        t = t.detach()
        want = float32_params.out_dtype(name, t.dtype, self.sync.dtype)
        return t.to(want) if t.dtype != want else t

    def _prepare(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        t = t.detach()
        device = getattr(self, "_ipc_device", None)
        if device is not None and t.device.type == "cpu":
            # verl hands a LoRA run's base (and QAT's weights) over on the CPU: on a GPU host they
            # go by CUDA IPC, as verl's own adapter sends them, not through /dev/shm (a container's
            # is often 64 MiB, a bucket up to 2 GiB)
            t = t.to(device)
        if (self.sync.dtype is not None and t.is_floating_point() and t.dtype != self.sync.dtype
                and t.element_size() > 1 and not name.endswith("_scale_inv")):   # not FP8 pairs
            t = self._cast(name, t)       # float32 where SGLang keeps it (`float32_params`)
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fsdp_sync cannot send {name!r}: dtype {t.dtype} is not supported")
        t = t.contiguous()
        t1 = time.perf_counter()
        self._pack_s += t1 - t0
        if self._sent is not None:
            self._sent.add(name, t)
            self._digest_s += time.perf_counter() - t1
        return t

    def _flattened_calls(self, weights, topo: SyncTopology, stats: SyncStats,
                         lag: bool = False) -> Iterator[Call]:
        """verl's stream packed into one reused flat buffer; one call per full bucket. The send
        loop takes the next call only after this one's payloads are released, so the buffer is
        refilled only then. ``lag`` (`transport.tensor.engine_reads_outlast`): two buffers take turns, so a
        bucket's is refilled only once the next bucket was answered."""
        stream = BucketBuffer(self.sync.bucket_bytes, hint=self._buffer_hint)
        spare = BucketBuffer(self.sync.bucket_bytes, hint=self._buffer_hint) if lag else None

        def call(s: BucketBuffer) -> Call:
            bucket = s.bucket()
            obj = flattened_bucket(s.buf, bucket)
            ps = handles.make_payloads(obj, topo.tp_size, ranks=[topo.tp_rank], tagged=False,
                                       output_str=True)
            del obj
            stats.buckets += 1
            stats.tensors += len(bucket.entries)
            stats.bytes += bucket.payload_bytes
            # one flush_cache after the last bucket (`update_weights`), not one per call
            return Call([ps], ps.payloads[0], lambda g: g, "flattened_bucket", False,
                        f"bucket {stats.buckets - 1} ({bucket.names[0]}…)", on_release=s.reset)

        big = BucketBuffer(0)
        try:
            for name, t in weights:
                t = self._prepare(name, t)
                n = t.numel() * t.element_size()
                if n > stream.capacity:          # its own bucket, its own buffer, one call
                    if stream.metas:
                        yield call(stream)
                    stream.buf = None            # the bucket buffer goes before the big one comes
                    big = BucketBuffer(-(-n // ALIGNMENT) * ALIGNMENT)
                    t0 = time.perf_counter()
                    big.add(name, t)
                    self._pack_s += time.perf_counter() - t0
                    del t
                    yield call(big)
                    big.buf = None
                    continue
                if stream.metas and (not stream.fits(n) or stream.buf.device != t.device):
                    yield call(stream)
                    if spare is not None:        # released; refilled after the next one's answer
                        stream, spare = spare, stream
                t0 = time.perf_counter()
                stream.add(name, t)
                self._pack_s += time.perf_counter() - t0
                del t
            if stream.metas:
                yield call(stream)
        finally:
            # freed here, not when the frames go: an exception's traceback (kept by asyncio, say)
            # would otherwise hold the shared buffers until the process exits, and a segment
            # still referenced then outlives it
            high = max(stream.high, spare.high if spare is not None else 0)
            stream.buf = big.buf = None
            if spare is not None:
                spare.buf = None
            if high:
                self._buffer_hint = -(-high // ALIGNMENT) * ALIGNMENT

    def _per_tensor_handle_calls(self, weights, topo: SyncTopology, stats: SyncStats,
                                 copy_held: bool = False) -> Iterator[Call]:
        """verl's own algorithm (``bucketed``): tensors grouped by bytes, one handle per tensor,
        one engine call per group; ``per_tensor``: one tensor per call.

        A group is closed when the next tensor, already pulled, would overflow it, so its tensors
        are held across pulls: with ``copy_held`` (a stream that overwrites what it yielded once
        the next is pulled, `stream.reuses_memory`) each is copied as it joins the group, unless
        the dtype cast already made it a tensor of its own (at most a bucket more memory).
        ``per_tensor`` sends each tensor before pulling the next: nothing held, nothing copied."""
        per_tensor = self.sync.strategy == "per_tensor"
        limit = self.sync.bucket_bytes
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0

        def deliver(engine, gathered):
            # element i of serialized_named_tensors is TP rank i's own list: SGLang's wire for
            # load_format=None, which the engine protocol's update_weights_from_tensor re-wraps
            engine._http_update("update_weights_from_tensor(load_format=None)", gathered, None,
                                False)

        def call() -> Call:
            nonlocal batch, size
            # this rank's list of (name, tensor) for its own TP rank
            ps = handles.make_payloads(list(batch), topo.tp_size, ranks=[topo.tp_rank],
                                       tagged=False, output_str=True)
            stats.buckets += 1
            stats.tensors += len(batch)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in batch)
            what = f"bucket {stats.buckets - 1} ({batch[0][0]}…)"
            batch, size = [], 0
            return Call([ps], ps.payloads[0], None, None, False, what, deliver=deliver)

        for name, pulled in weights:
            t = self._prepare(name, pulled)
            n = t.numel() * t.element_size()
            if batch and size + n > limit:
                yield call()
            if copy_held and not per_tensor and n and t.data_ptr() == pulled.data_ptr():
                t0 = time.perf_counter()
                t = t.clone()            # the stream's memory: overwritten after a later pull
                self._pack_s += time.perf_counter() - t0
            batch.append((name, t))
            size += n
            del t, pulled
            if per_tensor:
                yield call()
        if batch:
            yield call()

    # ------------------------------------------------------------------ serving
    def generate_sequences(self, prompts):
        raise NotImplementedError("verl's server mode generates through its agent loop, not the "
                                  "rollout adapter")
