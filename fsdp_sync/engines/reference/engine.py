"""`ReferenceEngine`: a small tensor-parallel rollout engine that speaks SGLang's ``Engine`` API.

It exists so the whole sync can be run and checked without a GPU or SGLang: one worker process
per TP rank (a fresh interpreter started by `procs`, which works without a main guard, in a
notebook, under torchrun / ``accelerate launch`` and in a Ray actor), each holding only its shard of a
decoder (`tp_model`: Llama, Qwen2, Qwen3, and MoE families with expert parallelism) and a
preallocated KV cache, driven over pipes. The engine lives in the caller's process; the workers are
its children.

Weight updates are all or nothing, in two phases: every worker opens its payloads and checks every
name, shape and dtype without touching a weight (``stage``); only when every worker said yes does
the engine send ``commit``, otherwise ``abort``. A worker that dies during an update aborts it on
the others. Plain tensors handed to the engine travel to the workers as one flattened bucket per
call (one shared-memory copy, one handle per worker).

``update_weights_from_disk(path)`` goes through the same two phases: the engine resolves the
checkpoint's files (`fsdp_sync.weights.hf_checkpoint.resolve`: index, missing shards, manifest), each
worker checks its share of the files' digests and every tensor's header, and reads only its own
slices into staging memory, so a torn or corrupt checkpoint changes nothing. A per-rank checkpoint
(``SyncConfig.layout="engine"``) is checked the same way, each worker hashing only its own files
(`weights.verified_file`), then read at the commit straight from them into the weights (no staging);
files it was told of while the trainer wrote them (``hash_files_ahead``) are hashed then (`disk_calls`).

``begin_weight_update()`` … ``end_weight_update()`` is one transaction (``transactional_updates``,
the default): each call is checked as above; while the engine holds weights worth protecting
(loaded, valid) its tensors are copied aside on CPU and applied together at ``end_weight_update()``
— one extra copy of what is pushed — and a failed call aborts the whole transaction, so the
previous weights stay. A commit that fails on some workers after others applied their copies leaves
shards of two versions: the engine is then broken, as after a failed commit of one call (every
call says the weights are inconsistent across TP ranks); a failed worker's open transaction is
dropped either way, and where every worker failed before writing, the previous weights stay. Where there is nothing to protect (the random start-up weights, or weights
released without a backup and resumed as zeros) calls write in place at no extra memory. After a
release without backup, or an aborted transaction that wrote over the start-up weights, the engine
refuses to serve until every tensor has been pushed again. ``end_weight_update(abort=True)`` drops
a transaction and says whether the weights are those of its begin (a plain ``end_weight_update()``
after a failed call drops it too, and raises: nothing was committed); ``begin_weight_update(transactional=False)``
makes each call commit on its own, as SGLang does.

Liveness: every wait on a worker polls its pipe and its process sentinel, so a dead worker is
reported within about half a second; from then on every call raises `WorkerDiedError` at once.
A worker that answers no call within ``call_timeout_s`` breaks the engine the same way; it is not
asked anything again (the abort round that follows goes to the others only, so a stalled worker
costs one reply timeout, not more) and `shutdown()` ends it without waiting for it to read.
`shutdown()` (also on ``with`` exit, garbage collection and interpreter exit) stops every worker
and closes every pipe; payload buffers are acknowledged by the workers and released by their owner.

Generation runs in the engine's scheduler (`scheduler`): concurrent generate calls are batched
continuously and hold the lock one step at a time, so weight updates run between steps. Without a
pause an update (tensor, disk, distributed, begin/end, memory release/resume) waits for the running
requests and holds new ones until it ends, as SGLang's writer lock does; while generation is paused
(``pause_generation``, SGLang's three modes) it runs at once. ``weight_version`` names the loaded
weights: an update's ``weight_version=`` is taken at its commit, ``end_weight_update(weight_version=)``
in the same critical section as the transaction's commit, so every token is tagged with the version
of the weights that made it.

``quantization="fp8"`` holds the weights in block FP8, as SGLang's ``--quantization fp8``: every
quantized weight as float8_e4m3fn plus its float32 ``weight_scale_inv`` (`weights.fp8.FP8Layout`),
and each tensor of every update must come in the dtype the layout says (`quant`).

Not here: the model math (`tp_model`), the worker loop (`worker`), generation calls, pause and
versions (`rollout`), batching requests (`scheduler`), the update-group calls of
``update_weights_from_distributed`` (`group_calls`), weight read-back (`readback`), per-rank update
items, the checks of a distributed call's entries and the disk update's checkpoint resolution
(`update_items`), which quantization a config and argument make (`quant`), the constructor's
argument checks (`engine_args`), memory release/resume and per-worker stats (`memory_calls`), the
transaction's begin/end bookkeeping and the judging of an end that failed on some workers
(`transaction`).

Why ~600 lines, one module: the engine's side of every protocol call (startup, updates, two-phase
rounds, the update gate), sharing the lock, the workers and the broken/transaction state.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import sys
import threading
import time
import weakref
from multiprocessing import connection as mp_connection
from typing import Any, Iterator, Sequence

import torch

from ...models import load_config
from ...weights import handles
from ...weights.layout import ModelSpec
from ...wire import host_store
from ..base import (EngineClosedError, EngineError, EngineStateError, EngineUnavailableError,
                    WeightUpdateError, WorkerDiedError)
from . import procs, quant, transaction
from .disk_calls import DiskCalls
from .engine_args import check_engine_args, check_target_modules
from .errors import NOTHING_APPLIED
from .gpu_calls import GPUCalls
from .group_calls import UpdateGroupCalls
from .lora_calls import LoRACalls
from .memory_calls import MemoryCalls
from .readback import WeightReadback
from .rollout import GenerationCalls
from .scheduler import Scheduler, check_version
from .transaction import RESTART
from .update_items import build_items, worker_figures

__all__ = ["ReferenceEngine"]


class ReferenceEngine(GenerationCalls, UpdateGroupCalls, DiskCalls, WeightReadback, LoRACalls, GPUCalls,
                      MemoryCalls):
    """A TP rollout engine in worker processes. See the module docstring.

    Args:
        model_config: a ``transformers`` config, a recipe name, or a path (`fsdp_sync.models.load_config`).
        tp_size: number of TP workers.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; worker i on GPU ``base_gpu_id + i``,
            refused past the last GPU).
        dtype: weight and activation dtype (float32, bfloat16 or float16). Updates must match it.
        kv_cache_tokens: KV-cache slots per worker (default 4096 when ``mem_fraction`` is not given).
        mem_fraction: instead of a token count, size weights + KV cache to this fraction of the
            device memory (CUDA: the GPU's total; CPU: the host's total divided by ``tp_size``).
        weights_cpu_backup: keep released weights' contents. On CUDA they are copied to CPU and
            back; on a CPU engine the "backup" is the weight tensors themselves, so releasing
            weights then frees no memory (reported as ``cpu_backup_bytes``).
        seed: initial random weights (the same full model for every ``tp_size``) and sampling.
        num_threads: torch threads per worker (default 1: workers share the cores with the trainer
            ranks, and oversubscribed OpenMP threads slow a decode step by 5-10x).
        pg_timeout_s: timeout of the workers' process group.
        call_timeout_s: a worker that answers no call within this long makes the engine unusable.
        transactional_updates: whether begin/end_weight_update make one all-or-nothing transaction
            (costs a CPU copy of what is pushed while loaded weights are being replaced).
        update_recv_timeout_s: how long a worker waits in a weight-update group (joining it, or an
            ``update_weights_from_distributed`` broadcast): a sender that died mid-broadcast costs
            this long, then the update is refused and the previous weights serve (SGLang: 30 min).
        ep_size: MoE expert parallelism inside the TP group, as SGLang's ``--ep-size``
            (`weights.layout.TPLayout`); 1 splits every expert over all TP ranks.
        quantization: None, or ``"fp8"``: block-wise FP8 as SGLang's ``--quantization fp8``
            (`weights.fp8.FP8Layout`): each quantized weight is held as float8_e4m3fn with a
            float32 ``weight_scale_inv`` per 128x128 block, the start-up weights are quantized,
            updates must send them so, and the forward dequantizes them. A config whose
            ``quantization_config`` is block FP8 makes it ``"fp8"`` (`quant.resolve`).
        base_gpu_id: the workers' first GPU (SGLang's ``--base-gpu-id``): a disaggregated engine
            beside trainer ranks on GPUs 0..n-1 starts at n (NCCL refuses one GPU on both ends).
        max_lora_rank, lora_target_modules: bound the LoRA adapters the engine loads (SGLang's
            server arguments; `lora_calls`): None takes any rank / any of `lora.TARGETS`. Target
            modules compare as SGLang's (`peft_names.sglang_targets`: q/k/v stack into qkv_proj,
            gate/up into gate_up_proj; ``"all"`` takes every module).
        keep_bucket_buffers: keep a sender's per-rank bucket buffer mapped (CPU) or its CUDA IPC
            handle open until the update ends, as it is reused bucket after bucket (`load_rank_bucket`);
            False opens each bucket's anew and lets it go after the call (`dev/gpu_profile.py`).
    """

    accepts_tagged_payloads = True
    accepts_rank_buckets = True     # per-rank buckets (`load_rank_bucket`): layout "auto" picks them
    accepts_rank_checkpoints = True
    """``update_weights_from_disk`` loads per-rank checkpoints (each worker its own files): the
    disk method's `SyncConfig.layout` "auto" writes them."""
    accepts_distributed_rank_buckets = True
    """``update_weights_from_distributed(load_format="per_rank_bucket")``: each worker receives
    only its own shard (`transport.group.PER_RANK_BUCKET`); "auto" picks it for method distributed."""

    def __init__(self, model_config: Any = "tiny", tp_size: int = 1, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, kv_cache_tokens: int | None = None,
                 mem_fraction: float | None = None, weights_cpu_backup: bool = False, seed: int = 0,
                 *, num_threads: int | None = None, pg_timeout_s: float = 60.0,
                 startup_timeout_s: float = 180.0, call_timeout_s: float | None = 900.0,
                 use_memory_saver: bool = True, transactional_updates: bool = True,
                 update_recv_timeout_s: float = 60.0, ep_size: int = 1, quantization: str | None = None,
                 base_gpu_id: int = 0, max_lora_rank: int | None = None,
                 lora_target_modules: Sequence[str] | None = None, keep_bucket_buffers: bool = True):
        a = check_engine_args(
            dtype=dtype, device=device, tp_size=tp_size, base_gpu_id=base_gpu_id,
            kv_cache_tokens=kv_cache_tokens, mem_fraction=mem_fraction, weights_cpu_backup=weights_cpu_backup,
            seed=seed, num_threads=num_threads, pg_timeout_s=pg_timeout_s, startup_timeout_s=startup_timeout_s,
            call_timeout_s=call_timeout_s, use_memory_saver=use_memory_saver,
            transactional_updates=transactional_updates, update_recv_timeout_s=update_recv_timeout_s,
            max_lora_rank=max_lora_rank, keep_bucket_buffers=keep_bucket_buffers)
        device, dtype, tp_size = a.device, a.dtype, a.tp_size
        self.max_lora_rank = a.max_lora_rank
        self.lora_target_modules = check_target_modules(lora_target_modules)
        self.config = load_config(model_config)
        self.spec = ModelSpec.from_config(self.config)
        self._quant = quant.resolve(self.config, quantization)
        # refuses an impossible split up front (and, quantized, one that cuts an FP8 block)
        self.layout = quant.engine_layout(self.spec, tp_size, ep_size, self._quant)
        self.quantization: str | None = self.layout.quantization
        self.ep_size = self.layout.ep
        self.base_gpu_id = a.base_gpu_id
        self.disk_bytes_read: list[int] = []   # per TP rank: bytes the last disk update read
        self.disk_seconds: dict[str, float] = {}   # the last disk update: read_hash_s, copy_s (slowest rank)
        self.last_call_figures: dict[str, float] = {}
        """The last tensor update in the workers (`worker_figures`): where its time went, each
        part the slowest rank's, and the bucket buffers found still open (`transport.call_times`)."""
        self.disk_tensors_loaded = 0           # checkpoint tensors the last disk update loaded
        self.tp_size = int(tp_size)
        self.device, self.dtype = device, dtype
        self.weights_cpu_backup = a.weights_cpu_backup
        self.call_timeout_s = a.call_timeout_s
        self.transactional_updates = a.transactional_updates
        self.staged_on_host_bytes = 0     # the last transaction's copies kept off the GPU (no room)
        self._lock = threading.RLock()
        self._wait = threading.local()          # this thread's `wait_limit` deadline
        self._seq = itertools.count(1)
        self._broken: str | None = None
        self._in_txn = False
        self._txn_transactional = True
        self._txn_aborted: str | None = None
        self._txn_version: str | None = None     # weight_version to take at the transaction's commit
        self._txn_heads = False       # a sent tied lm_head awaits its embedding (`tied_head`)
        self.weight_version = "default"
        """SGLang's weight version: what the loaded weights are called (`update_weight_version`, or
        ``weight_version=`` of an update). Changes only holding the lock, so a step's tokens carry
        the version of the weights that made them."""
        opts = {
            "spec": self.spec, "device": device, "dtype": dtype,
            "kv_cache_tokens": a.kv_cache_tokens, "mem_fraction": a.mem_fraction,
            "weights_cpu_backup": a.weights_cpu_backup, "seed": a.seed,
            "num_threads": a.num_threads, "base_gpu_id": a.base_gpu_id,
            "pg_timeout_s": a.pg_timeout_s, "use_memory_saver": a.use_memory_saver,
            "update_recv_timeout_s": a.update_recv_timeout_s, "ep": self.layout.ep, "quant": self._quant,
            "keep_bucket_buffers": a.keep_bucket_buffers,
        }
        self._update_groups: dict[str, dict] = {}   # weight-update groups the workers joined
        from . import worker as worker_mod

        self._w = procs.WorkerSet()
        self._finalizer = weakref.finalize(self, self._w.stop)
        try:
            # the TP workers' store, listening before they are told its port (`wire.host_store`)
            self._w.store = host_store(self.tp_size, a.pg_timeout_s) if self.tp_size > 1 else None
            store_port = self._w.store.port if self._w.store is not None else None
            for rank in range(self.tp_size):
                # a fresh interpreter, not multiprocessing's spawn: see `procs`
                p, parent = procs.start(f"{worker_mod.__name__}:serve",
                                        (rank, self.tp_size, store_port, opts),
                                        name=f"fsdp_sync-engine-tp{rank}")
                self._w.procs.append(p)
                self._w.conns.append(parent)
            try:
                ready = self._collect(0, range(self.tp_size), "engine startup", a.startup_timeout_s)
            except WorkerDiedError as exc:
                raise WorkerDiedError(f"{exc}. The worker's own error, if it printed one, is on "
                                      f"this process's stderr above; a worker runs "
                                      f"`{sys.executable} -c ...` with this process's sys.path "
                                      f"and must be able to import fsdp_sync and torch",
                                      rank=exc.rank, exitcode=exc.exitcode) from None
            errs = {r: rep for r, rep in ready.items() if rep[0] != "ok"}
            if errs:
                r = min(errs)
                raise EngineError(f"TP rank {r} failed to start: {errs[r][2]}\n{errs[r][3]}")
        except BaseException:
            self._w.silent.update(range(self.tp_size))    # no grace: a starting worker reads nothing
            self._finalizer()
            raise
        self.worker_pids = [ready[r][1]["pid"] for r in range(self.tp_size)]
        self.kv_cache_tokens = ready[0][1]["kv_cache_tokens"]
        self._sched = Scheduler(self, self.kv_cache_tokens)
        weakref.finalize(self, self._sched.close, EngineClosedError("the engine was shut down"))

    # ------------------------------------------------------------------ context / lifetime
    def __enter__(self) -> "ReferenceEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop every worker (gracefully, then terminate/kill) and close every pipe. Idempotent.
        Requests still generating, and a call waiting on a worker, raise `EngineClosedError`."""
        self._w.closing = True    # a step stuck on a worker lets go of the lock now, not at its timeout
        if getattr(self, "_sched", None) is not None:
            self._sched.close(EngineClosedError("the engine was shut down"))
        with self._lock:
            self._finalizer()
        if self.device == "cuda" and torch.cuda.is_initialized():
            # the workers released what they opened: free the CUDA IPC blocks whose counts are now
            # zero, and with them this process's counter file once none is in use
            torch.cuda.ipc_collect()

    @property
    def closed(self) -> bool:
        return not hasattr(self, "_w") or self._w.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if getattr(self, "_broken", None) else "running")
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        q = f", {self.quantization}" if self.quantization else ""
        return (f"ReferenceEngine({self.spec.model_type}, tp={self.tp_size}{ep}, {self.device}, "
                f"{str(self.dtype).removeprefix('torch.')}{q}, {state})")

    def dead_reason(self) -> str | None:
        """Why this engine can serve nothing more (shut down, a worker died or went silent), or
        None while every worker runs. Cheap and lock-free, so a health check can ask it while a
        long call holds the engine: it only polls the worker processes."""
        if self.closed:
            return "the engine was shut down"
        if self._broken:
            return self._broken
        for r, p in enumerate(self._w.procs):
            code = p.exitcode
            if code is not None:
                return (f"TP rank {r} (pid {p.pid}) exited (exit code {code}{procs.signame(code)}); "
                        f"the engine cannot serve any more: shut it down and start a new one")
        return None

    # ------------------------------------------------------------------ worker calls
    def _check_usable(self) -> None:
        if self._w.closed:
            raise EngineClosedError("the engine was shut down")
        if self._broken:
            raise WorkerDiedError(self._broken)
        for r, p in enumerate(self._w.procs):
            if not p.is_alive():
                self._mark_dead(r, "idle time (noticed by the next call)")
                raise WorkerDiedError(self._broken or "a worker died")

    def _check_not_aborted(self, what: str) -> None:
        """An open transaction an earlier call aborted takes no more updates until it ends."""
        if self._txn_aborted is not None:
            raise WeightUpdateError(f"{what}: this weight update was aborted by an earlier failure "
                                    f"({self._txn_aborted}); call end_weight_update(abort=True) and "
                                    f"start again")

    def _mark_dead(self, rank: int, what: str) -> WorkerDiedError:
        p = self._w.procs[rank]
        p.join(timeout=1.0)
        code = p.exitcode
        msg = (f"TP rank {rank} (pid {p.pid}) died during {what} (exit code {code}{procs.signame(code)}); "
               f"the engine cannot serve any more: shut it down and start a new one")
        if self._broken is None:
            self._broken = msg
        return WorkerDiedError(msg, rank=rank, exitcode=code)

    def _send(self, rank: int, seq: int, cmd: str, args: Any, what: str) -> None:
        try:
            self._w.conns[rank].send_bytes(pickle.dumps((seq, cmd, args), protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, EOFError):
            raise self._mark_dead(rank, what) from None

    def _collect(self, seq: int, ranks: Sequence[int], what: str,
                 timeout: float | None) -> dict[int, tuple]:
        """Replies of ``ranks`` to request ``seq``; raises `WorkerDiedError` as soon as one dies."""
        pending = set(ranks)
        replies: dict[int, tuple] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if self._w.closing:            # shutdown() waits for the lock this call holds
                raise EngineClosedError("the engine was shut down")
            waitables = [self._w.conns[r] for r in pending] + [self._w.procs[r].sentinel for r in pending]
            mp_connection.wait(waitables, timeout=0.5)
            for r in sorted(pending):
                conn = self._w.conns[r]
                try:
                    while conn.poll(0):
                        msg = pickle.loads(conn.recv_bytes())
                        if msg[0] == seq:
                            replies[r] = msg[1:]
                            pending.discard(r)
                            break
                except (EOFError, OSError):
                    raise self._mark_dead(r, what) from None
                if r in pending and not self._w.procs[r].is_alive():
                    raise self._mark_dead(r, what)
            if pending and deadline is not None and time.monotonic() > deadline:
                msg = (f"TP ranks {sorted(pending)} did not answer {what} within {timeout:.0f}s; "
                       f"the engine cannot serve any more: shut it down and start a new one")
                self._broken = self._broken or msg
                self._w.silent |= pending
                raise EngineError(msg)
        return replies

    def _round(self, cmd: str, args: Any = None, *, per_rank: Sequence[Any] | None = None,
               ranks: Sequence[int] | None = None, what: str | None = None,
               timeout: float | None | str = "default") -> dict[int, tuple]:
        ranks = list(range(self.tp_size)) if ranks is None else list(ranks)
        what = what or cmd
        seq = next(self._seq)
        for r in ranks:
            self._send(r, seq, cmd, per_rank[r] if per_rank is not None else (args or {}), what)
        return self._collect(seq, ranks, what, self.call_timeout_s if timeout == "default" else timeout)

    def _raise_errors(self, replies: dict[int, tuple], what: str, *, collective: bool = False) -> None:
        errs = {r: rep for r, rep in replies.items() if rep[0] != "ok"}
        if not errs:
            return
        r = min(errs)
        _, kind, msg, tb, name = errs[r]
        others = sorted(set(errs) - {r})
        text = f"{what}: {msg}" + (f" (also on TP ranks {others})" if others else "")
        odd = sorted(q for q in replies if q not in errs or errs[q][1] != kind)
        if collective and odd:
            # ranks a check refused left a collective the others finished or timed out in (a gloo
            # group that timed out fails every later collective): the group cannot be trusted
            self._broken = (f"{text}; TP ranks {odd} did not fail as TP rank {r} did, so the process "
                            f"group is out of step: shut the engine down")
            raise EngineError(self._broken + f"\n(worker traceback)\n{tb}")
        if kind == "update":
            raise WeightUpdateError(text, rank=r, name=name)
        if kind == "state":
            raise EngineStateError(text)
        if kind == "unavailable":
            raise EngineUnavailableError(text)
        raise EngineError(f"{text}\n(worker traceback)\n{tb}")

    def _call(self, cmd: str, args: Any = None, *, what: str | None = None, collective: bool = False,
              per_rank: Sequence[Any] | None = None) -> dict[int, Any]:
        with self._lock:
            self._check_usable()
            replies = self._round(cmd, args, per_rank=per_rank, what=what)
            self._raise_errors(replies, what or cmd, collective=collective)
            return {r: rep[1] for r, rep in replies.items()}

    @contextlib.contextmanager
    def wait_limit(self, seconds: float | None) -> Iterator[None]:
        """Within the block, a call of this thread that changes the engine (an update, begin/end,
        release/resume, flush, joining a group) and cannot start within ``seconds`` (requests
        still running, another call holding the engine) raises `EngineUnavailableError` having
        changed nothing, instead of starting later (`fsdp-sync serve`'s ``--update-wait-s``;
        SGLang waits without a limit). None: no limit."""
        prev = getattr(self._wait, "deadline", None)
        self._wait.deadline = None if seconds is None else time.monotonic() + max(0.0, float(seconds))
        try:
            yield
        finally:
            self._wait.deadline = prev

    @contextlib.contextmanager
    def _gate(self, what: str, *, exclusive: bool = True) -> Iterator[None]:
        """A changing call's hold on the engine: the scheduler's writer gate (``exclusive``: no
        request running unless generation is paused), then the lock; both waits end at this
        thread's `wait_limit`."""
        deadline = getattr(self._wait, "deadline", None)
        with self._sched.exclusive(deadline, what) if exclusive else contextlib.nullcontext():
            left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._lock.acquire(timeout=left):
                raise EngineUnavailableError(f"{what}: another call held the engine past the wait "
                                             f"limit; nothing was changed (retry)")
            try:
                yield
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ weight updates
    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, *, weight_version: str | None = None) -> None:
        """Load weights; all or nothing (see the module docstring). Raises `WeightUpdateError`
        naming the parameter, the rank and the values; the engine then serves its previous weights.
        ``weight_version``: what the new weights are called, from their commit on."""
        self._update_from_tensor(named_tensors, load_format, flush_cache, keep_mapped=False,
                                 weight_version=weight_version)

    def _update_from_tensor(self, named_tensors: Any, load_format: str | None, flush_cache: bool,
                            keep_mapped: bool, weight_version: str | None = None) -> None:
        what = f"update_weights_from_tensor(load_format={load_format!r})"
        check_version(weight_version, what)
        with self._gate(what):
            self._check_usable()
            self._check_not_aborted(what)
            sets: list[handles.PayloadSet] = []
            try:
                try:
                    per_rank = build_items(named_tensors, load_format, self.tp_size, sets)
                except WeightUpdateError as exc:
                    self._abort_all(what, str(exc))   # a refused call ends an open transaction too
                    raise
                staged = self._two_phase(per_rank, what, keep_mapped=keep_mapped)
                self.last_call_figures = worker_figures(staged, self._committed)
            finally:
                for s in sets:
                    s.release(require_ack=False)
            self._after_update(weight_version, flush_cache)

    def _after_update(self, weight_version: str | None, flush_cache: bool) -> None:
        """After a call that loaded weights (holding the lock): take ``weight_version`` now, or at
        the commit of the open transaction; flush the cache unless requests paused in place hold
        it (there is no prefix cache to drop: their KV is theirs, as SGLang's in_place keeps it)."""
        if weight_version is not None:
            if self._in_txn and self._txn_transactional:
                self._txn_version = weight_version
            else:
                self.weight_version = weight_version
        if flush_cache and not (self._sched.paused == "in_place" and self._sched.holds_kv()):
            self._raise_errors(self._round("flush_cache"), "flush_cache")

    def load_rank_bucket(self, bucket: Any, payloads: list, *, flush_cache: bool = True,
                         weight_version: str | None = None) -> None:
        """One per-rank bucket (`reshard.RankBucket`): ``payloads[i]`` opens to TP rank i's
        ``{"flattened_tensor", "metadata"}`` in engine names (``load_format="direct"``).

        The per-rank buffers are the sync's own, reused bucket after bucket: inside
        ``begin_weight_update``/``end_weight_update`` each worker keeps its buffer mapped until the
        end (at most ``worker.MAX_MAPPED``) rather than mapping it anew every bucket (TP 2,
        qwen2-160m: a worker's page faults per sync 10 k -> 2 k, its load 0.085 -> 0.070 s)."""
        self._update_from_tensor(list(payloads), "direct", flush_cache, keep_mapped=True,
                                 weight_version=weight_version)

    def _two_phase(self, per_rank: list, what: str, cmd: str = "stage",
                   keep_mapped: bool = False) -> dict[int, tuple]:
        """Stage on every worker, then commit (or abort everywhere); returns the stage replies. One
        worker has no other rank's stage to wait for: it stages and commits in one round trip."""
        phase = "stage"
        fused = cmd == "stage" and len(per_rank) == 1
        try:
            args = [{"items": it, "keep_mapped": keep_mapped} for it in per_rank] if cmd == "stage" else per_rank
            staged = self._round("stage_commit" if fused else cmd, per_rank=args, what=what)
            errs = {r: rep for r, rep in staged.items() if rep[0] != "ok"}
            if errs:
                phase = "aborted"
                self._abort_all(what, str(errs[min(errs)][2]))
                self._raise_errors(staged, what)
            phase = "commit"
            committed = self._committed = ({r: rep[1].pop("committed") for r, rep in staged.items()} if fused
                                           else self._round("commit", what=what + " (commit)"))
            phase = "done"
            # tied heads a later call's embedding (or the commit's check) must still meet
            self._txn_heads = any(isinstance(rep[1], dict) and rep[1].get("pending_heads")
                                  for rep in staged.values())
            failed = [rep for rep in committed.values() if rep[0] != "ok"]
            if failed and self._in_txn and all(NOTHING_APPLIED in str(rep[2]) for rep in failed):
                # a staging transaction's copies aside: no rank's weights changed, so the
                # transaction is aborted (every rank drops what it put aside), the engine serves on
                phase = "aborted"
                self._abort_all(what, str(failed[0][2]))
                self._raise_errors(committed, what + " (commit)")
            if failed:
                # copies only fail on e.g. out-of-memory; ranks may now disagree on their weights
                self._broken = (f"{what}: commit failed on TP ranks "
                                f"{sorted(r for r, rep in committed.items() if rep[0] != 'ok')}; the "
                                f"weights are inconsistent across TP ranks, so the engine serves nothing "
                                f"more: {RESTART}")
                self._raise_errors(committed, what + " (commit)")
            return staged
        except BaseException as exc:
            if phase == "stage":           # a dead worker, an interrupt: nobody may keep the update
                self._abort_all(what, f"{type(exc).__name__}: {exc}")
            elif phase == "commit" and not isinstance(exc, EngineError):
                self._broken = self._broken or (f"{what}: interrupted while committing ({exc!r}); "
                                                f"the TP ranks may hold different weights, so the "
                                                f"engine serves nothing more: {RESTART}")
            raise

    def _responsive(self) -> list[int]:
        """TP ranks alive that have not let a call time out: the ones worth asking."""
        return [r for r, p in enumerate(self._w.procs) if p.is_alive() and r not in self._w.silent]

    def _abort_all(self, what: str, reason: str) -> None:
        """Tell every live worker to drop the update (and the open transaction). A worker that let
        a call time out is not asked (it would only cost another timeout: the engine is broken
        already); the others answer once their current command ends, which the worker's own
        timeouts bound (a receive: ``update_recv_timeout_s``), so the wait is ``call_timeout_s``."""
        if self._in_txn and self._txn_transactional:
            self._txn_aborted = reason
        try:
            self._round("abort", {"reason": reason}, ranks=self._responsive(), what=what + " (abort)")
        except EngineError:
            pass   # already broken: the caller raises the first error

    def begin_weight_update(self, *, transactional: bool | None = None) -> None:
        """Open an update. Transactional (the engine's default, see ``transactional_updates``):
        the calls until `end_weight_update` are committed together, or not at all. Otherwise each
        call commits on its own, as outside begin/end (no extra memory). (`transaction.begin`)"""
        transaction.begin(self, transactional=transactional)

    def end_weight_update(self, *, abort: bool = False, weight_version: str | None = None) -> bool:
        """Commit the open transaction (``abort=True``: drop it). After a failed update in it, it
        is dropped either way and a commit is refused (`WeightUpdateError`: nothing committed).
        Returns, after an abort, whether what the engine serves (or counts as pushed again) is as
        at ``begin_weight_update``: False where calls written in place changed it (not
        transactional; over the start-up weights, then not served until every tensor is pushed
        again; over tensors pushed again since a release without a backup), else True. A commit
        takes ``weight_version`` (else an update call's in the transaction) in the same critical
        section: no step runs between the new weights and their version. A commit that fails on
        some workers (`transaction.end_failed`): `WeightUpdateError` where every failed worker
        dropped its transaction unwritten and none applied staged copies; else the engine is broken."""
        return transaction.end(self, abort=abort, weight_version=weight_version)

    # ------------------------------------------------------------------ serving
    def _receive_raw(self, group_name: str, nbytes: int, count: int, p2p: bool = False) -> None:
        """Benchmark hook: every worker receives ``count`` bare broadcasts (``p2p``: sends) of
        ``nbytes`` from update-group rank 0 and drops them (`update_weights_from_distributed`'s floor)."""
        self._call("receive_raw", {"group_name": group_name, "nbytes": nbytes, "count": count, "p2p": p2p})

    def _set_fault(self, rank: int, fault: str | None) -> None:
        """Test hook: ``"die_in_stage"``/``"die_in_commit"`` (``"stall_in_…"``) kill (stall) worker ``rank``."""
        with self._lock:
            self._raise_errors(self._round("set_fault", {"fault": fault}, ranks=[rank]), "set_fault")
