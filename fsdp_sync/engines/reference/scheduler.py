"""The reference engine's request scheduler: continuous batching, SGLang's pause modes, a weight
version on every token, the weight-update gate and the out-of-service state.

`Scheduler` owns every request a `ReferenceEngine` is generating: concurrent ``generate_requests``
calls (any threads) `submit` their rows, and one scheduler thread runs the steps. Each step holds
the engine's lock for one round trip to the workers (`generation.Decode.step`): rows waiting for
KV-cache room are admitted first come, first served, prefilled in the same forward as one decode
token of every running row, and a row that ends leaves the batch and frees its slots at once. So
a request that arrives while others decode joins at the next step, and any engine call (a weight
update, a read) runs between two steps. KV-cache slots are one contiguous run per row (prompt +
``max_new_tokens`` - 1), taken first fit; the engine decides them here so every TP worker writes
the same places.

Weight versions, as SGLang 0.5.23 keeps them: every token is tagged with the engine's
``weight_version`` read in the same critical section as its step, and `weight_version_spans`
turns a row's tags into SGLang's ``weight_versions`` (``{"version", "start", "end"}`` spans over
the output tokens, one per change).

Weight updates (`exclusive`), as SGLang's writer lock: without a pause an update waits until the
running rows have finished and holds new ones back until it ends; while generation is paused it
runs at once. `pause` takes SGLang's three modes: ``abort`` ends every request now (finish reason
``abort``, with the tokens it had); ``retract`` frees the running rows' KV and queues them again
at the front, to be recomputed after `resume` (a prefill of prompt + the tokens so far, with
whatever weights are loaded then); ``in_place`` only stops stepping: rows keep their KV and go on
from it. While paused, new requests queue; none is refused.

Cache flushes (`idle`), as SGLang's: a flush runs only while no request runs or waits, and is
refused at once otherwise (or, given a timeout, waits for that without holding new requests back);
it never waits behind running requests the way an update does.

Out of service (`set_out_of_service`, the fleet's quarantine): new requests are refused with
`EngineUnavailableError` naming the reason, and the requests in flight end as aborted, so nothing
computed with weights the fleet gave up on is served.

The scheduler reaches its engine through a weak reference (so an engine nobody holds is still
collected and shut down) and uses only its ``_lock``, ``_call``, ``weight_version`` and
``dead_reason``.

Not here: the decode math and sampling (`generation`, in each worker), checking a call's prompts
and sampling parameters (`rollout`), the HTTP routes (`serve`, `serve_control`).
"""

from __future__ import annotations

import collections
import copy
import itertools
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..base import (EngineClosedError, EngineError, EngineStateError, EngineUnavailableError,
                    WorkerDiedError)
from .generation import Sampling, input_token_logprobs

__all__ = ["Scheduler", "Call", "Row", "StepRecord", "PAUSE_MODES", "weight_version_spans", "kv_need",
           "check_version"]

PAUSE_MODES = ("abort", "retract", "in_place")
RECORDS = 4096        # step records kept (`Scheduler.records`)


def weight_version_spans(tags: Sequence[str], current: str) -> list[dict]:
    """SGLang's ``weight_versions`` of one output: a ``{"version", "start", "end"}`` span per
    change of the per-token version ``tags``, contiguous over ``[0, len(tags))``; with no tokens,
    one empty span of ``current`` (what `compute_weight_version_spans` gives in SGLang 0.5.23)."""
    spans: list[dict] = []
    for i, v in enumerate(tags):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def check_version(value: object, what: str, *, optional: bool = True) -> None:
    """Refuse a weight version that is not a string (None allowed when ``optional``), naming it."""
    if (value is None and optional) or isinstance(value, str):
        return
    raise ValueError(f"{what}: weight_version must be a string{' or None' if optional else ''}, "
                     f"got {value!r} ({type(value).__name__})")


def kv_need(prompt_len: int, sampling: Sampling) -> int:
    """KV-cache slots a row holds at most: its prompt and every token but the last."""
    return prompt_len + max(sampling.max_new_tokens, 1) - 1


@dataclass(frozen=True)
class StepRecord:
    """One step the workers ran: which requests it prefilled and which decoded one token, and the
    weight version their new tokens carry."""

    index: int
    version: str
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, ...]:
        return self.prefill + self.decode


class Row:
    """One request (one sample of one prompt) of a `Call`."""

    def __init__(self, rid: int, call: "Call", index: int, prompt: list[int], sampling: Sampling,
                 logprobs: bool, input_from: int | None = None) -> None:
        self.rid, self.call, self.index = rid, call, index
        self.prompt, self.sampling, self.logprobs = prompt, sampling, logprobs
        self.input_from = input_from       # input logprobs from here on, at its first admission
        self.need = kv_need(len(prompt), sampling)
        self.output: list[int] = []
        self.tags: list[str] = []          # the weight version of each output token
        self.finish: dict | None = None
        self.slot: int | None = None       # first KV slot while it holds the cache
        self.abort: str | None = None      # an abort asked for, done at the next step


class Call:
    """One ``generate_requests`` call: its rows, and the events its caller reads (``("step",
    {row index: change})``, then ``("done", None)``, or ``("error", exception)``)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.left = 0

    def next_event(self, timeout: float) -> tuple[str, Any] | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class _Slots:
    """Free runs of KV-cache slots, first fit."""

    def __init__(self, total: int) -> None:
        self.free = [(0, total)]

    def take(self, n: int) -> int | None:
        for k, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[k] = (start + n, length - n)
                if length == n:
                    del self.free[k]
                return start
        return None

    def give(self, start: int, n: int) -> None:
        runs = sorted(self.free + [(start, n)])
        merged = [runs[0]]
        for s, ln in runs[1:]:
            ps, pl = merged[-1]
            if ps + pl == s:
                merged[-1] = (ps, pl + ln)
            else:
                merged.append((s, ln))
        self.free = merged


class Scheduler:
    """The requests of one engine and the thread that steps them (see the module docstring)."""

    IDLE_WAIT_S = 0.5

    def __init__(self, engine: Any, kv_tokens: int) -> None:
        self._engine = weakref.ref(engine)
        self.kv_tokens = int(kv_tokens)
        self._cond = threading.Condition()
        self._slots = _Slots(self.kv_tokens)
        self._waiting: collections.deque[Row] = collections.deque()
        self._running: list[Row] = []      # in the workers' batch, holding KV
        self._drops: list[Row] = []        # aborts asked for, done at the next step
        self._changes: dict[Call, dict] = {}
        self._paused: str | None = None
        self._held = 0                     # weight updates waiting for, or holding, the engine
        self._flush_waiting = False        # an `idle` wait with a timeout is under way
        self._out: str | None = None       # out of service: why
        self._pause_at: int | None = None  # `pause_after`: the step after which to pause in place
        self._closed: BaseException | None = None
        self._ids = itertools.count(1)
        self._steps = 0
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=RECORDS)
        self._thread: threading.Thread | None = None
        self._local = threading.local()

    # ------------------------------------------------------------------ state
    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None while generating."""
        return self._paused

    @property
    def out_of_service(self) -> str | None:
        return self._out

    def stats(self) -> dict:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running),
                    "paused": self._paused, "updates_waiting": self._held,
                    "out_of_service": self._out, "steps": self._steps,
                    "kv_free": sum(n for _, n in self._slots.free)}

    def records(self) -> list[StepRecord]:
        """The last `RECORDS` steps, oldest first."""
        with self._cond:
            return list(self._records)

    def holds_kv(self) -> int:
        """Rows holding KV-cache slots (running, or paused in place)."""
        with self._cond:
            return len(self._running)

    def rows_using(self, lora: str) -> int:
        """Rows waiting or running (paused ones too) with LoRA adapter ``lora``."""
        with self._cond:
            return sum(r.sampling.lora == lora for r in (*self._waiting, *self._running))

    # ------------------------------------------------------------------ callers
    def submit(self, rows: Sequence[tuple], version: str) -> Call:
        """Queue a call's rows (``(prompt, sampling, logprobs)`` each, or ``(..., input_from)``:
        SGLang's ``input_token_logprobs`` from that position, worked out at the row's first step in
        the same hold of the engine's lock as its prefill, so with the weights of its first token).
        Rows with ``max_new_tokens`` 0 end at once (without input logprobs: the caller's). Raises
        `EngineUnavailableError` out of service."""
        call = Call()
        with self._cond:
            if self._closed is not None:
                raise _copy(self._closed)
            if self._out is not None:
                raise EngineUnavailableError(f"generate: the engine is out of service ({self._out}); "
                                       f"set_serving(True) brings it back")
            for k, (prompt, sampling, logprobs, *start) in enumerate(rows):
                call.rows.append(Row(next(self._ids), call, k, list(prompt), sampling, bool(logprobs),
                                     start[0] if start else None))
            call.left = len(call.rows)
            for r in call.rows:
                if r.sampling.max_new_tokens <= 0:
                    self._finish(r, {"type": "length", "length": 0}, version)
                else:
                    self._waiting.append(r)
            self._publish()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fsdp_sync-scheduler",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return call

    def abort(self, call: Call, index: int, message: str) -> None:
        """End row ``index`` of ``call`` at the next step (at once while paused)."""
        with self._cond:
            r = call.rows[index]
            if r.finish is None and r.abort is None:
                r.abort = message
                self._drops.append(r)
                self._cond.notify_all()

    def cancel(self, call: Call, message: str = "request cancelled by its caller") -> None:
        """Drop every row of ``call`` still going (its caller stopped reading)."""
        for k in range(len(call.rows)):
            self.abort(call, k, message)

    # ------------------------------------------------------------------ engine control
    @contextmanager
    def exclusive(self, deadline: float | None = None, what: str = "update") -> Iterator[None]:
        """A weight update's hold on the engine (SGLang's writer lock): unless generation is
        paused, wait until no row is running, and admit none until the block ends. Nested blocks
        in one thread count once. Enter it before taking the engine's lock. Rows still running
        at ``deadline`` (``time.monotonic()``; None: no limit) raise `EngineUnavailableError`."""
        if getattr(self._local, "depth", 0):
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            self._held += 1
            try:
                while self._running and self._paused is None and self._closed is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise EngineUnavailableError(
                            f"{what}: {len(self._running)} running request(s) did not finish within "
                            f"the wait limit; nothing was changed (pause_generation first, or retry)")
                    self._cond.wait(self.IDLE_WAIT_S if left is None else min(self.IDLE_WAIT_S, left))
            except BaseException:
                self._held -= 1
                self._cond.notify_all()
                raise
        with self._holding():
            yield

    @contextmanager
    def idle(self, timeout_s: float = 0.0, what: str = "flush_cache") -> Iterator[None]:
        """SGLang's flush gate (its scheduler's ``flush_cache`` behind ``SchedulerFlushWrapper``):
        the block runs only while no request runs or waits, and admits none until it ends. With
        ``timeout_s`` 0 it is now or never, and requests waiting while generation is paused (held
        back or retracted: they hold no KV) do not count, as SGLang's ``ignore_waiting``; rows
        paused in place do. Above 0 it waits up to ``timeout_s`` for none to run or wait, holding
        nothing meanwhile (new requests are admitted, as SGLang admits them beside a pending
        flush); one such wait at a time. Refused: `EngineStateError` (SGLang's 400), nothing done.
        Enter it before taking the engine's lock; an `exclusive` block inside counts once."""
        nested = bool(getattr(self._local, "depth", 0))     # inside this thread's `exclusive`
        with self._cond:
            if self._flush_waiting:
                raise EngineStateError(f"{what}: Another flush_cache is already in progress "
                                       f"(one waits for idle with a timeout); nothing was done")
            if timeout_s > 0 and not nested and self._busy(strict=True):
                self._flush_waiting = True
                deadline = time.monotonic() + timeout_s
                try:
                    while self._busy(strict=True) and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(min(self.IDLE_WAIT_S, left))
                finally:
                    self._flush_waiting = False
                if self._busy(strict=True):
                    raise EngineStateError(
                        f"{what}: Timed out waiting for idle state (SGLang's words): after "
                        f"{timeout_s:g} s {self._busy_text()}; nothing was done")
            elif self._busy(strict=False):
                if self._paused == "in_place" and self._running:
                    why = (f"{len(self._running)} request(s) paused in place hold the KV cache "
                           f"(SGLang refuses a flush then); continue_generation() first, or pause "
                           f"with mode 'retract'")
                else:
                    why = (f"{self._busy_text()}; SGLang flushes only when no request runs or "
                           f"waits: retry when they end, or give a timeout to wait for that "
                           f"(?timeout=SECONDS on /flush_cache)")
                raise EngineStateError(f"{what}: Flush cache failed (SGLang's words): {why}; "
                                       f"nothing was done")
            if not nested:
                self._held += 1
        if nested:
            yield
            return
        with self._holding():
            yield

    @contextmanager
    def _holding(self) -> Iterator[None]:
        """The block of a hold `exclusive` or `idle` took (``_held`` counted): blocks nested in
        this thread count once; given back when it ends."""
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def _busy(self, strict: bool) -> bool:
        """Whether a request runs or (``strict``, or not paused) waits; under ``_cond``."""
        return self._closed is None and bool(self._running or (
            self._waiting and (strict or self._paused is None)))

    def _busy_text(self) -> str:
        return f"{len(self._running)} request(s) running and {len(self._waiting)} waiting"

    def pause(self, engine: Any, mode: str) -> None:
        """SGLang's ``pause_generation`` (see the module docstring). Call holding the engine's
        lock, so no step is in flight."""
        removed: list[int] = []
        with self._cond:
            self._paused = mode
            if mode == "abort":
                removed = self._end_all("aborted by pause_generation(mode='abort')",
                                       engine.weight_version)
            elif mode == "retract":
                for r in reversed(self._running):
                    removed.append(r.rid)
                    self._slots.give(r.slot, r.need)
                    r.slot = None
                    self._waiting.appendleft(r)
                self._running.clear()
            self._publish()
            self._cond.notify_all()
        self._remove_on_workers(engine, removed)

    def pause_after(self, steps: int) -> None:
        """Test hook: pause in place once ``steps`` more steps have run, in the critical section
        of that step (a point to act at that does not depend on the machine's speed)."""
        with self._cond:
            self._pause_at = self._steps + int(steps)

    def resume(self) -> None:
        """SGLang's ``continue_generation``: steps run again (retracted rows are recomputed)."""
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    def abort_all(self, engine: Any, message: str) -> int:
        """End every request now, as aborted; returns how many. Call holding the engine's lock."""
        with self._cond:
            n = len(self._running) + len(self._waiting)
            removed = self._end_all(message, engine.weight_version)
            self._publish()
            self._cond.notify_all()
        self._remove_on_workers(engine, removed)
        return n

    def set_out_of_service(self, engine: Any, reason: str | None) -> None:
        """``reason`` None: serve again. Otherwise refuse new requests naming ``reason`` and end
        those in flight as aborted. Call holding the engine's lock."""
        with self._cond:
            self._out = reason
        if reason is not None:
            self.abort_all(engine, f"aborted: the engine was taken out of service ({reason})")

    def close(self, exc: BaseException) -> None:
        """Fail every request with ``exc`` and stop the thread (the engine is going away)."""
        with self._cond:
            if self._closed is None:
                self._closed = exc
            calls = {r.call for r in list(self._running) + list(self._waiting)}
            self._running.clear()
            self._waiting.clear()
            self._drops.clear()
            self._slots = _Slots(self.kv_tokens)
            for c in calls:
                c.events.put(("error", _copy(exc)))
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the step loop
    def _has_work(self) -> bool:
        return bool(self._drops) or (self._paused is None and bool(
            self._running or (self._waiting and self._held == 0)))

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._closed is None and not self._has_work():
                        self._cond.wait(self.IDLE_WAIT_S)
                        if self._engine() is None:
                            break
                    if self._closed is not None:
                        return
                engine = self._engine()
                if engine is None:
                    self.close(EngineClosedError("the engine was garbage-collected"))
                    return
                try:
                    self._step(engine)
                except BaseException as exc:  # noqa: BLE001 - a fault here fails the rows, not the loop
                    self._fail_step(engine, exc)
                finally:
                    engine = None
        except BaseException as exc:  # noqa: BLE001 - no caller may be left waiting for a dead loop
            self.close(EngineError(f"the request scheduler stopped: {type(exc).__name__}: {exc}"))

    def _step(self, engine: Any) -> None:
        with engine._lock:
            with self._cond:
                if self._closed is not None:
                    return
                removed = self._take_drops(engine.weight_version)
                adds: list[Row] = []
                if self._paused is None:
                    while self._waiting and self._held == 0:
                        slot = self._slots.take(self._waiting[0].need)
                        if slot is None:
                            break
                        r = self._waiting.popleft()
                        r.slot = slot
                        adds.append(r)
                    decodes = list(self._running)
                    self._running.extend(adds)
                else:
                    decodes = []
                version = engine.weight_version
                self._publish()
            if not adds and not decodes:
                self._remove_on_workers(engine, removed)
                return
            args = {"remove": removed,
                    "add": [(r.rid, r.prompt + r.output, r.sampling, r.slot, len(r.output), r.logprobs)
                            for r in adds]}
            try:
                inputs = self._input_logprobs(engine, [r for r in adds if r.input_from is not None])
                out = engine._call("gen_step", args, what="generate", collective=True)[0]
            except BaseException as exc:  # noqa: BLE001 - every caller of these rows gets it
                self._fail_step(engine, exc)
                return
            with self._cond:
                for r in adds:
                    if r.rid in inputs:
                        self._change(r, version)["input_logprobs"] = inputs.pop(r.rid)
                self._steps += 1
                self._records.append(StepRecord(self._steps, version, tuple(r.rid for r in adds),
                                                tuple(r.rid for r in decodes)))
                for r in decodes + adds:
                    t = out["tokens"][r.rid]
                    r.output.append(t)
                    r.tags.append(version)
                    ch = self._change(r, version)
                    ch["tokens"].append(t)
                    ch["versions"].append(version)
                    if r.logprobs:
                        ch["logprobs"].append(out["logprobs"][r.rid])
                    why = out["ended"].get(r.rid)
                    if why is not None:
                        self._finish(r, {"type": "stop", "matched": t} if why == "stop" else
                                     {"type": "length", "length": len(r.output)}, version)
                if self._pause_at is not None and self._steps >= self._pause_at:
                    self._paused, self._pause_at = "in_place", None
                self._publish()
                self._cond.notify_all()

    @staticmethod
    def _input_logprobs(engine: Any, rows: list[Row]) -> dict[int, list]:
        """Each row's input logprobs (by row id) from one forward per adapter over the distinct
        prompts; called holding the engine's lock, before the rows' prefill."""
        out: dict[int, list] = {}
        groups: dict[str | None, dict[tuple, list[Row]]] = {}
        for r in rows:
            groups.setdefault(r.sampling.lora, {}).setdefault(tuple(r.prompt), []).append(r)
        for name, by_prompt in groups.items():
            prompts = [list(p) for p in by_prompt]
            got = engine._call("forward_logits", {"prompts": prompts, "all_positions": True, "lora": name},
                               what="generate", collective=True)[0]
            for p, lg in zip(prompts, got):
                for r in by_prompt[tuple(p)]:
                    out[r.rid] = input_token_logprobs(p, lg, r.input_from)
                    r.input_from = None
        return out

    def _fail_step(self, engine: Any, exc: BaseException) -> None:
        """A step failed: its rows' callers get ``exc`` (their other rows are dropped); if the
        engine can serve no more, every caller does."""
        dead = engine.dead_reason() is not None or isinstance(exc, (WorkerDiedError, EngineClosedError))
        with self._cond:
            failed = {r.call for r in self._running}
            if dead:
                failed |= {r.call for r in self._waiting}
            for r in self._running:
                self._slots.give(r.slot, r.need)
                r.slot = None
            self._running.clear()
            self._waiting = collections.deque(r for r in self._waiting if r.call not in failed)
            for c in failed:
                for r in c.rows:
                    if r.finish is None:
                        r.finish = {"type": "abort", "message": f"failed: {exc}"}
                c.left = 0
                self._changes.pop(c, None)
                c.events.put(("error", _copy(exc)))
            self._cond.notify_all()
        if not dead:
            try:          # the workers' batch is gone with the rows
                engine._call("gen_end", what="generate")
            except EngineError:
                pass

    # ------------------------------------------------------------------ helpers (under _cond)
    def _change(self, r: Row, version: str) -> dict:
        per_call = self._changes.setdefault(r.call, {})
        ch = per_call.get(r.index)
        if ch is None:
            ch = per_call[r.index] = {"tokens": [], "logprobs": [], "versions": [], "finish": None,
                                      "version": version}
        ch["version"] = version
        return ch

    def _finish(self, r: Row, reason: dict, version: str) -> None:
        r.finish = reason
        self._change(r, version)["finish"] = reason
        if r.slot is not None:
            self._slots.give(r.slot, r.need)
            r.slot = None
        if r in self._running:
            self._running.remove(r)
        r.call.left -= 1

    def _take_drops(self, version: str) -> list[int]:
        removed = []
        for r in self._drops:
            if r.finish is not None:
                continue
            if r in self._running:
                removed.append(r.rid)
            elif r in self._waiting:
                self._waiting.remove(r)
            self._finish(r, {"type": "abort", "message": r.abort}, version)
        self._drops.clear()
        return removed

    def _end_all(self, message: str, version: str) -> list[int]:
        removed = [r.rid for r in self._running]
        for r in list(self._running) + list(self._waiting):
            self._finish(r, {"type": "abort", "message": message}, version)
        self._waiting.clear()
        self._drops.clear()
        return removed

    def _publish(self) -> None:
        for call, changes in self._changes.items():
            call.events.put(("step", changes))
            if call.left == 0:
                call.events.put(("done", None))
        self._changes = {}

    @staticmethod
    def _remove_on_workers(engine: Any, rids: list[int]) -> None:
        if rids and engine.dead_reason() is None:
            try:
                engine._call("gen_remove", {"rids": rids}, what="generate")
            except EngineError:
                pass      # the engine broke: the next call says so


def _copy(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise in one more thread (a traceback belongs to one raise)."""
    try:
        return copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied is raised as is
        return exc
