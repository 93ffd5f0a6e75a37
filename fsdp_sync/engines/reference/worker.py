"""A reference-engine worker: one process per TP rank, driven over a Pipe by `ReferenceEngine`.

`serve` is the process entry point (started by `procs.start` in a fresh interpreter). It sets up
the process (threads; glibc's mmap threshold pinned so freed weights and KV cache go back to the
OS), joins the TP process group (gloo on CPU, NCCL on CUDA, with a timeout), builds its `TPModel`
shard with deterministic random weights (quantized, for a block-FP8 engine) and a KV cache, then
answers requests one at a time: ``("cmd", args)`` in, ``("ok", result)`` or ``("err", kind,
message, traceback)`` out, both as plain pickles (tensors travel by value here, float8 ones as
their bytes; only weight payloads travel as handles, see `fsdp_sync.weights.handles`). Commands
are looked up in a table (`COMMANDS`); the benchmark floor ``receive_raw`` lives in `bench_floor`.

The `Worker` owns two collaborators: `staging.UpdateStager` (two-phase weight updates: stage,
commit, abort, transactions, disk checkpoints) and `regions.MemoryRegions` (release/resume of the
weights, KV cache and CUDA-graph regions). It keeps generation, logits, digests and the
``update_weights_from_distributed`` receive.

Not here: choosing ranks, sending payloads or deciding commit vs abort (that is `engine`).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import hashlib
import math
import os
import pickle
import signal
import sys
import traceback
from typing import Any, Callable

import torch

from ...faultpoint import fault_point
from ...weights.bucket import unflatten
from ...weights.layout import rank_digest
from .readback import piece_digest
from ...weights import handles
from ...wire import open_flattened_bucket
from . import lora as lora_mod
from .errors import KIND_OTHER, KIND_STATE, KIND_UNAVAILABLE, KIND_UPDATE, WorkerError
from .generation import Decode
from .quant import engine_layout
from .regions import MemoryRegions
from .staging import UpdateStager
from .tp_model import Span, TPModel

__all__ = ["main", "serve"]

# --------------------------------------------------------------------------- process setup

def _pin_malloc() -> Any:
    """Make glibc serve every allocation >= 128 KiB with its own mmap, and keep it so.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
    which same-sized blocks come from the heap and are not returned on free: released weights
    would stay in RSS. Setting the threshold explicitly turns that adjustment off.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)        # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)        # M_TRIM_THRESHOLD
        return libc
    except (OSError, AttributeError):       # not glibc: nothing to pin
        return None


class Worker:
    def __init__(self, rank: int, tp: int, store_port: int | None, opts: dict):
        self.rank, self.tp, self.opts = rank, tp, opts
        libc = _pin_malloc()
        torch.set_num_threads(int(opts.get("num_threads") or 1))
        self.device = torch.device(opts["device"])
        if self.device.type == "cuda":
            idx = (int(opts.get("base_gpu_id", 0)) + rank) % torch.cuda.device_count()
            self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        self.dtype: torch.dtype = opts["dtype"]
        self.group = None
        if tp > 1:
            import torch.distributed as dist

            from ...wire import join_store

            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            timeout_s = float(opts["pg_timeout_s"])
            # the engine's process hosts the TP group's store (`wire.host_store`)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    store=join_store("127.0.0.1", store_port, tp, timeout_s),
                                    rank=rank, world_size=tp,
                                    timeout=datetime.timedelta(seconds=timeout_s), **kw)
            self.group = dist.group.WORLD
        # plain data (a spec dataclass, the quantization dict): workers never import transformers
        self.layout = engine_layout(opts["spec"], tp, int(opts.get("ep", 1)), opts.get("quant"))
        self.model = TPModel(self.layout, rank, dtype=self.dtype, device=self.device, group=self.group)
        self.hf_set = self.layout.rank_names(rank)   # under EP: only the experts this rank holds
        self.engine_shapes = self.layout.engine_shapes()
        self.gen = torch.Generator().manual_seed(int(opts["seed"]))
        self.decode = Decode(self.model, self.device, self.gen)   # the running batch (`gen_step`)
        self.update_groups: dict[str, Any] = {}     # weight-update groups (group name -> ProcessGroup)
        self.closed = False
        self.lora_pending: Any = None    # a staged LoRA adapter (`lora_stage`) awaiting commit
        self.lora_spare: dict[str, Any] = {}   # per adapter name, the shard it replaced (reused)
        self.lora_in: Any = None         # the last LoRA payload's checked tensors (`_lora_pairs`)
        self.updates = UpdateStager(self)
        self.memory = MemoryRegions(self, libc)   # allocates the weights and the KV cache
        self.model.init_random(int(opts["seed"]))



    # ----------------------------------------------------------------- serving
    def _require_weights(self) -> None:
        if self.memory.weights_released:
            raise WorkerError(KIND_UNAVAILABLE, "weights are released; resume_memory_occupation(['weights']) "
                                          "and push weights before serving")
        if not self.updates.valid:
            missing = [n for n in self.layout.hf_names() if n in self.hf_set and n not in self.updates.coverage]
            why = self.updates.overwritten or "weights were released without a CPU backup"
            raise WorkerError(KIND_UNAVAILABLE, f"{why} and not all pushed again: {len(missing)} of "
                                                f"{len(self.hf_set)} tensors missing (e.g. {missing[0]!r}); "
                                                f"push every tensor again before serving")

    @torch.no_grad()
    def forward_logits(self, prompts: list[list[int]], all_positions: bool, lora: str | None = None) -> Any:
        self._require_weights()
        if lora is not None and lora not in self.model.adapters:
            raise WorkerError(KIND_STATE, f"LoRA adapter {lora!r} is not loaded on TP rank {self.rank} "
                                          f"(loaded: {sorted(self.model.adapters)})")
        ids, pos, spans, rows = self._pack(prompts, [0] * len(prompts), all_positions)
        logits = self.model.forward(ids, pos, spans, None, rows, lora={lora: None} if lora else None)
        if self.rank != 0:
            return None
        logits = logits.cpu()
        if not all_positions:
            return logits
        return list(logits.split([len(p) for p in prompts]))

    def _pack(self, chunks: list[list[int]], starts: list[int], all_positions: bool,
              slots: list[int] | None = None):
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        pos = torch.cat([torch.arange(s, s + len(c)) for c, s in zip(chunks, starts)])
        spans, off, rows = [], 0, []
        for i, (c, s) in enumerate(zip(chunks, starts)):
            spans.append(Span(off, len(c), slots[i] if slots else 0, s))
            rows.extend(range(off, off + len(c)) if all_positions else [off + len(c) - 1])
            off += len(c)
        return ids.to(self.device), pos.to(self.device), spans, torch.tensor(rows, device=self.device)

    @torch.no_grad()
    def gen_step(self, a: dict) -> dict | None:
        """One step of the running batch (`generation.Decode`): drop ``remove``, admit ``add``
        (``(rid, tokens, sampling, slot, produced, want_logprobs)`` each), run one forward. The
        engine's scheduler decides all of it; rank 0 answers the tokens."""
        self.decode.remove(a.get("remove") or ())
        adds = a.get("add") or ()
        if adds or self.decode.rows:
            self._require_weights()
            if self.memory.kv_released:
                raise WorkerError(KIND_UNAVAILABLE, "the KV cache is released; call "
                                              "resume_memory_occupation(['kv_cache']) before generating")
        for spec in adds:
            self.decode.add(*spec)
        out = self.decode.step(self.memory.kv)
        return out if self.rank == 0 else {}

    def pieces(self, names: list[str], replicas: bool = False, every: bool = False) -> Any:
        """This rank's owned pieces of full HF tensors: ``{name: [(src slices, tensor), ...]}``.
        A float8 piece travels as its bytes (a uint8 view: torch 2.13 pickles a float8 tensor it
        cannot load back); the engine views them as the dtype the layout holds them in.
        ``replicas``: also the digest (`readback.piece_digest`) of each piece this rank holds but
        does not own, ``(pieces, {name: [(src slices, digest), ...]})``, so the engine checks every
        replica against the owner's piece with only digests crossing (`readback._gather`).
        ``every``: the pieces this rank holds, owned or not (`readback.rank_pieces`)."""
        self._require_weights()
        out, reps = {}, {}
        for name in names:
            if not self.layout.accepts(name):
                raise WorkerError(KIND_OTHER, f"unknown parameter {name!r}; HF names of this model are "
                                              f"e.g. {self.layout.hf_names()[:2]}")
            if name == "lm_head.weight" and self.layout.spec.tie_word_embeddings:
                name_src = "model.embed_tokens.weight"
            else:
                name_src = name
            pls = self.layout.placements(name_src, self.rank)
            out[name] = [(pl.src, _bytes_of_fp8(self.model.params[pl.engine][pl.dst].cpu().clone()))
                         for pl in pls if pl.owner or every]
            if replicas:
                reps[name] = [(pl.src, piece_digest(self.model.params[pl.engine][pl.dst]))
                              for pl in pls if not pl.owner]
        return (out, reps) if replicas else out

    def rank_digests(self, names: list[str]) -> dict:
        """``{name: layout.rank_digest}`` of the pieces of each HF tensor this rank serves."""
        self._require_weights()
        bad = [n for n in names if not self.layout.accepts(n)]
        if bad:
            raise WorkerError(KIND_OTHER, f"unknown parameter {bad[0]!r}; HF names of this model are "
                                          f"e.g. {self.layout.hf_names()[:2]}")
        params = self.model.params
        return {n: rank_digest(self.layout, n, self.rank, lambda pl: params[pl.engine][pl.dst])
                for n in names}

    def shard_checksum(self) -> str:
        h = hashlib.sha256()
        if self.memory.weights_released:
            return "released"
        for k in self.engine_shapes:
            t = self.model.params[k].detach().cpu().contiguous()
            h.update(k.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()

    # ----------------------------------------------------------------- loop
    def handle(self, cmd: str, args: dict) -> Any:
        tags = args.get("tags") if cmd in ("resume", "release") and isinstance(args, dict) else None
        point = "stage" if cmd == "stage_commit" else cmd     # (one worker's stage, its commit with it)
        fault_point("worker", self.rank, point + (":" + ",".join(tags) if tags else ""))  # FSDP_SYNC_FAULT
        fn = COMMANDS.get(cmd)
        if fn is None:
            raise WorkerError(KIND_OTHER, f"unknown command {cmd!r}")
        return fn(self, args)

    def end_generate(self) -> None:
        self.decode.clear()

    def set_fault(self, fault: str | None) -> None:
        """Arm a fault the stager fires while staging (the `fsdp-sync faults` drills)."""
        self.updates.fault = fault

    # ----------------------------------------------------------------- update_weights_from_distributed
    def join_group(self, a: dict) -> dict:
        from ...wire import new_update_group

        self.leave_group(a["group_name"])
        try:
            self.update_groups[a["group_name"]] = new_update_group(
                backend=a["backend"], master_address=a["master_address"], master_port=a["master_port"],
                world_size=a["world_size"], rank=a["rank"], group_name=a["group_name"],
                timeout_s=float(self.opts.get("update_recv_timeout_s", 60.0)))
        except Exception as exc:  # noqa: BLE001 - reported to the engine
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank} could not join weight-update group "
                                           f"{a['group_name']!r} at {a['master_address']}:{a['master_port']} "
                                           f"as rank {a['rank']}/{a['world_size']}: {exc}") from exc
        return {}

    def leave_group(self, group_name: str) -> dict:
        from ...wire import destroy_update_group

        pg = self.update_groups.pop(group_name, None)
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - destroying it is what matters
                pass
            destroy_update_group(pg)
        return {}

    def receive_broadcast(self, a: dict) -> list:
        """Receive one ``update_weights_from_distributed`` call's tensors from group rank 0, as
        SGLang's receiver does (per tensor, or one tight flattened buffer; or fsdp_sync's
        ``per_rank_bucket``: only this rank's shard, one ``recv``), into fresh buffers;
        returns stage items. Nothing is written to the weights here."""
        import torch.distributed as dist

        from ...wire import PER_RANK_BUCKET, per_rank_bucket_plan

        name = a["group_name"]
        pg = self.update_groups.get(name)
        if pg is None:
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank} is not in weight-update group {name!r}")
        entries = a["entries"]
        try:
            if a["load_format"] == PER_RANK_BUCKET:   # only this rank's shard, sent to it alone
                bkt = per_rank_bucket_plan(entries)
                flat = torch.empty(bkt.nbytes, dtype=torch.uint8, device=self.device)
                if bkt.nbytes:
                    dist.recv(flat, group=pg, group_src=0)
                return [("tensor", "direct", n, t) for n, t in unflatten(flat, bkt.entries)]
            if a["load_format"] == "flattened_bucket":
                total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
                if total:
                    dist.broadcast(flat, src=0, group=pg)
                out, off = [], 0
                for n, d, s in entries:
                    nb = math.prod(s) * d.itemsize
                    out.append((n, flat[off:off + nb].view(d).view(s)))
                    off += nb
            else:
                out = [(n, torch.empty(s, dtype=d, device=self.device)) for n, d, s in entries]
                # float8 received as its bytes: the same bytes whatever type the sender names them by
                works = [dist.broadcast(_bytes_of_fp8(t), src=0, group=pg, async_op=True)
                         for _, t in out if t.numel()]
                for w in works:
                    w.wait()
        except Exception as exc:  # noqa: BLE001 - a torn receive: the group is unusable now
            self.leave_group(name)
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank}: receiving {len(entries)} tensors "
                                           f"(first {entries[0][0]!r}) over weight-update group {name!r} "
                                           f"failed, nothing was loaded and the group was left: "
                                           f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        return [("tensor", "hf", n, t) for n, t in out]

    # ----------------------------------------------------------------- LoRA adapters
    def lora_stage(self, a: dict) -> dict:
        """Phase one of loading adapter ``a["name"]``: open its full tensors (payload items, as
        `update_items.build_items` makes them), check them against the base model, build this
        rank's shard (`lora.shard_adapter`, copies: the payloads are acknowledged at once) into the
        spare shard of that name where one is kept (the one the last commit replaced). The loaded
        adapters are untouched until ``lora_commit``."""
        cfg = lora_mod.LoRAConfig.from_dict(a["config"])
        self.lora_abort()
        recs = []
        try:
            for item in a["items"]:
                if item[0] != "bucket":
                    raise WorkerError(KIND_UPDATE, f"LoRA tensors travel as one bucket per call, got {item[0]!r}")
                try:
                    recs.append(handles.open_payload(item[2], self.rank))
                except Exception as exc:  # noqa: BLE001 - a bad payload is a refused load
                    raise WorkerError(KIND_UPDATE, f"could not open the LoRA payload for TP rank {self.rank}: "
                                                   f"{type(exc).__name__}: {exc}") from exc
            try:
                kept = self.lora_in
                pairs = self._lora_pairs(cfg, [rec.value for rec in recs])
                spare = self.lora_spare.pop(a["name"], None)
                shard = lora_mod.shard_adapter(self.layout, self.rank, a["name"], cfg, pairs, self.dtype,
                                               self.device, reuse=spare)
            except ValueError as exc:
                raise WorkerError(KIND_UPDATE, f"LoRA adapter {a['name']!r} on TP rank {self.rank}: {exc}") from exc
        finally:
            handles.ack_all(recs)      # the shard's copies done (stream synchronized), then acknowledged
        self.lora_pending = shard
        return {"nbytes": shard.nbytes(), "kept_check": kept is not None and self.lora_in is kept,
                "in_place": spare is not None and shard.mats is spare.mats}

    def _lora_pairs(self, cfg: Any, values: list) -> dict:
        """The checked ``{HF weight: (A, B)}`` of opened LoRA payloads (`lora.check_adapter`).
        The last ones are kept, with the buffer they view (so it stays mapped): a payload of the
        same buffer with equal metadata under an equal config (an adapter sync from a trainer that
        keeps its buffer, `lora_sync`) takes them again instead of reading and checking 2 x
        modules x layers entries anew; its bytes are read by the copy into the shard."""
        key = meta = flat = None
        if len(values) == 1 and isinstance(values[0], dict):
            flat, meta = values[0].get("flattened_tensor"), values[0].get("metadata")
            if isinstance(flat, torch.Tensor) and flat.device.type == "cpu":
                key = (flat.data_ptr(), flat.numel(), cfg)
                kept = self.lora_in
                if kept is not None and kept[0] == key and kept[1] == meta:
                    return kept[2]
        named = [pair for v in values for pair in open_flattened_bucket(v)]
        pairs = lora_mod.check_adapter(self.layout, cfg, named)
        self.lora_in = (key, meta, pairs, flat) if key is not None else None
        return pairs

    def lora_commit(self, a: dict) -> dict:
        shard, self.lora_pending = self.lora_pending, None
        if shard is None or shard.name != a["name"]:
            raise WorkerError(KIND_STATE, f"no staged LoRA adapter {a['name']!r} on TP rank {self.rank}")
        old = self.model.adapters.get(shard.name)
        self.model.adapters[shard.name] = shard
        if old is not None:          # nobody serves it now: the next stage of this name writes into it
            self.lora_spare[shard.name] = old
        return {}

    def lora_abort(self, a: dict | None = None) -> None:
        """Drop a staged adapter; its memory is kept as the spare of its name."""
        shard, self.lora_pending = self.lora_pending, None
        if shard is not None and shard.name not in self.lora_spare:
            self.lora_spare[shard.name] = shard

    def lora_unload(self, a: dict) -> None:
        self.model.adapters.pop(a["name"], None)
        self.lora_spare.pop(a["name"], None)

    def lora_pieces(self, a: dict) -> dict:
        shard = self.model.adapters.get(a["name"])
        if shard is None:
            raise WorkerError(KIND_STATE, f"LoRA adapter {a['name']!r} is not loaded on TP rank {self.rank}")
        return lora_mod.unshard_pieces(shard)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name in list(self.update_groups):
            try:
                self.leave_group(name)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.updates.abort("shutdown")
        self.updates.txn = None
        self.updates.in_update = False
        self.updates.mapped.clear()
        self.updates.close_ahead()
        self.model.params, self.memory.kv, self.memory.backup = {}, None, None
        self.model.adapters, self.lora_pending, self.lora_spare, self.lora_in = {}, None, {}, None
        # storages opened from CUDA IPC handles give their producer's reference counts back when
        # freed: free them now, before the engine is told this worker is gone (a producer that exits
        # while a count is up leaves its counter file in /dev/shm)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass


def _bytes_of_fp8(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as a uint8 view of its bytes (anything else as it is): gloo has no float8
    type, and torch 2.13 pickles a float8 tensor it cannot load back."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _receive_raw(w: Worker, a: dict) -> None:
    from .bench_floor import receive_raw     # benchmark floor: loaded only when a bench asks

    receive_raw(w.device, w.update_groups[a["group_name"]], int(a["nbytes"]), int(a["count"]),
                p2p=bool(a.get("p2p")))


def _stage_commit(w: Worker, a: dict) -> dict:
    """An update's two phases in one command (an engine of one worker): the stage's reply, with
    the commit's (``("ok", figures)`` or its error reply) as ``"committed"``."""
    staged = w.updates.stage(a["items"], bool(a.get("keep_mapped")))
    try:
        staged["committed"] = ("ok", w.updates.commit())
    except Exception as exc:  # noqa: BLE001 - the engine takes it as a failed commit (broken)
        staged["committed"] = _error_reply(exc)
    return staged


# Each command the engine sends: cmd -> handler(worker, args). `flush_cache` does nothing: there is
# no prefix cache; the running batch's KV is its requests' own (the engine refuses a flush that
# would have to drop it, as SGLang does while paused in place).
COMMANDS: dict[str, Callable[[Worker, Any], Any]] = {
    "stage": lambda w, a: w.updates.stage(a["items"], bool(a.get("keep_mapped"))),
    "commit": lambda w, a: w.updates.commit(),
    "stage_commit": _stage_commit,
    "abort": lambda w, a: w.updates.abort(a.get("reason", "")),
    "begin": lambda w, a: w.updates.begin(bool(a.get("transactional", True))),
    "end": lambda w, a: w.updates.end(bool(a.get("abort"))),
    "check_heads": lambda w, a: w.updates.heads.check_pending(),
    "gen_step": lambda w, a: w.gen_step(a),
    "gen_remove": lambda w, a: w.decode.remove(a["rids"]),
    "gen_end": lambda w, a: w.end_generate(),
    "forward_logits": lambda w, a: w.forward_logits(a["prompts"], a["all_positions"], a.get("lora")),
    "lora_stage": lambda w, a: w.lora_stage(a),
    "lora_commit": lambda w, a: w.lora_commit(a),
    "lora_abort": lambda w, a: w.lora_abort(a),
    "lora_unload": lambda w, a: w.lora_unload(a),
    "lora_pieces": lambda w, a: w.lora_pieces(a),
    "pieces": lambda w, a: w.pieces(a["names"], bool(a.get("replicas")), bool(a.get("every"))),
    "release": lambda w, a: w.memory.release(a["tags"]),
    "resume": lambda w, a: w.memory.resume(a["tags"]),
    "flush_cache": lambda w, a: None,
    "memory_stats": lambda w, a: w.memory.stats(),
    # CUDA allocator peaks from here on (a bench row's engine peak); nothing to do on CPU
    "reset_peak_memory": lambda w, a: (torch.cuda.reset_peak_memory_stats(w.device)
                                       if w.device.type == "cuda" else None),
    "shard_checksum": lambda w, a: w.shard_checksum(),
    "rank_digests": lambda w, a: w.rank_digests(a["names"]),
    "join_group": lambda w, a: w.join_group(a),
    "leave_group": lambda w, a: w.leave_group(a["group_name"]),
    "stage_broadcast": lambda w, a: w.updates.stage(w.receive_broadcast(a)),
    "receive_raw": _receive_raw,
    "set_fault": lambda w, a: w.set_fault(a["fault"]),
    "hash_ahead": lambda w, a: w.updates.hash_ahead(a),
    "drop_ahead": lambda w, a: w.updates.drop_ahead(str(a["dir"])),
}
NO_REPLY = {"hash_ahead"}
"""Commands the engine sends without waiting for them (a hint): no reply, a failure ignored."""


def _send(conn: Any, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _error_reply(exc: BaseException) -> tuple:
    kind = exc.kind if isinstance(exc, WorkerError) else KIND_OTHER
    name = exc.name if isinstance(exc, WorkerError) else None
    msg = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"
    return ("err", kind, msg, traceback.format_exc(), name)


def main(rank: int, tp: int, store_port: int | None, conn: Any, opts: dict) -> None:
    """Process entry point: build the shard, say ready, serve until shutdown or the parent is gone.

    Requests are ``(seq, cmd, args)``; replies ``(seq, "ok", result)`` or
    ``(seq, "err", kind, message, traceback, name)``. The engine drops replies of an older ``seq``.
    """
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine's process handles Ctrl-C and stops us
    try:
        worker = Worker(rank, tp, store_port, opts)
    except BaseException as exc:  # noqa: BLE001 - the engine shows this to its caller
        try:
            _send(conn, (0, *_error_reply(exc)))
        except OSError:                 # the engine's process is gone (its start-up was cut short)
            pass
        finally:
            conn.close()
        return
    # what startup made (the interpreter, torch, the model: ~170k objects) lives as long as the
    # worker: frozen, a full collection walks only what came since (walking it all took 0.25 s in
    # the middle of a LoRA load on 2 shared cores, and 0.3-3 s in `close` at every shutdown)
    gc.collect()
    gc.freeze()
    try:
        _send(conn, (0, "ok", {"pid": os.getpid(), "kv_cache_tokens": worker.memory.kv_tokens}))
    except OSError:                     # the engine's process is gone: nobody to serve
        worker.close()
        conn.close()
        return
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:   # orphaned: the engine's process is gone
                    break
                continue
            try:
                seq, cmd, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if cmd == "shutdown":
                worker.close()
                try:
                    _send(conn, (seq, "ok", None))
                except OSError:
                    pass
                break
            if cmd in NO_REPLY:
                try:
                    worker.handle(cmd, args)
                except Exception:  # noqa: BLE001 - a hint; the update it helps checks everything
                    pass
                continue
            try:
                reply = (seq, "ok", worker.handle(cmd, args))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the engine
                if cmd in ("stage", "stage_broadcast", "stage_commit"):   # nothing of a failed stage survives
                    worker.updates.drop_call()
                reply = (seq, *_error_reply(exc))
            try:
                _send(conn, reply)
            except OSError:
                break
    finally:
        try:
            worker.close()
        finally:
            conn.close()
            sys.stdout.flush()


def serve(conn: Any, rank: int, tp: int, store_port: int | None, opts: dict) -> None:
    """`procs.start`'s entry point: ``main`` with the connection first."""
    main(rank, tp, store_port, conn, opts)
