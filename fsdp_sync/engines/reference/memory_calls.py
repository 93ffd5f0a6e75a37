"""Memory release/resume, cache flush and per-worker read-outs of a reference engine, from the
client's side: SGLang's ``release_memory_occupation`` / ``resume_memory_occupation`` by tag and
``flush_cache``, and fsdp_sync's ``memory_stats`` and ``shard_checksums``, which work on a broken
engine too (each live worker asked on its own). A mixin of `ReferenceEngine`: it uses the
engine's update gate (``_gate``), lock, worker set (``_w``), rounds (``_round``, ``_call``) and
scheduler (``_sched``).

Not here: what the workers free and reallocate and what they report (`regions`), the weights'
validity after a release without a backup (`staging`).
"""

from __future__ import annotations

import math
from typing import Any

from ..base import (RELEASE_ORDER, RESUME_ORDER, EngineClosedError, EngineError, EngineStateError,
                    ordered_tags)

__all__ = ["MemoryCalls"]


class MemoryCalls:
    """`ReferenceEngine`'s memory and per-worker methods (see the module docstring)."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free ``tags`` (None = all) in the order kv_cache → weights → cuda_graph."""
        tags = ordered_tags(tags, RELEASE_ORDER)
        with self._gate(f"release_memory_occupation({tags})"):
            if self._in_txn:
                raise EngineStateError("cannot release memory inside begin/end_weight_update")
            if "kv_cache" in tags and self._sched.holds_kv():
                raise EngineStateError(f"cannot release the KV cache: {self._sched.holds_kv()} requests "
                                       f"paused in place hold it; continue_generation() or pause with "
                                       f"mode 'retract' or 'abort' first")
            self._call_all_or_break("release", {"tags": tags}, f"release_memory_occupation({tags})")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Reallocate ``tags`` (None = all) in the order cuda_graph → weights → kv_cache. Released
        weights come back as zeros (push them again) unless the engine keeps a CPU backup."""
        tags = ordered_tags(tags, RESUME_ORDER)
        with self._gate(f"resume_memory_occupation({tags})"):
            if self._in_txn:
                raise EngineStateError("cannot resume memory inside begin/end_weight_update")
            self._call_all_or_break("resume", {"tags": tags}, f"resume_memory_occupation({tags})")

    def _call_all_or_break(self, cmd: str, args: Any, what: str) -> None:
        """``cmd`` on every worker; where it failed on some ranks and went through on others, the
        ranks hold their memory differently (rank 0's weights released, rank 1's not): the next
        collective step would be refused by a check on some ranks while the others wait in it
        out the process group's timeout, leaving a group that fails every later call. The engine
        is broken at once instead, naming the ranks (`dead_reason`; every later call raises
        `WorkerDiedError` without waiting). A failure on every rank changes no rank's state and
        breaks nothing: it is raised as it is."""
        with self._lock:
            self._check_usable()
            replies = self._round(cmd, args, what=what)
            failed = sorted(r for r, rep in replies.items() if rep[0] != "ok")
            done = sorted(set(replies) - set(failed))
            if failed and done:
                _, _, msg, tb, _ = replies[failed[0]]
                self._broken = self._broken or (
                    f"{what}: failed on TP ranks {failed} ({msg}) and went through on TP ranks {done}: "
                    f"the ranks hold their memory differently, so the engine cannot step; shut it "
                    f"down and start it again")
                raise EngineError(self._broken + f"\n(worker traceback)\n{tb}")
            self._raise_errors(replies, what)

    def flush_cache(self, timeout_s: float = 0.0) -> None:
        """Nothing is cached between requests (no prefix cache); checks the workers answer. As
        SGLang's, done only while no request runs or waits, and otherwise refused at once with
        `EngineStateError` (SGLang answers 400, "Flush cache failed"), also while requests paused
        in place hold the KV cache; requests waiting while generation is paused do not count.
        ``timeout_s`` > 0 (SGLang's ``/flush_cache?timeout=``): wait up to that long for no
        request to run or wait, without holding new ones back ("Timed out waiting for idle
        state" past it). It never waits for running requests the way an update does, nor holds
        new ones back longer than the flush itself (`scheduler.Scheduler.idle`)."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not 0 <= timeout_s < math.inf:
            raise ValueError(f"flush_cache: timeout_s must be a number of seconds >= 0, got "
                             f"{timeout_s!r}")
        with self._sched.idle(float(timeout_s), "flush_cache"):
            with self._gate("flush_cache"):      # the lock, within this thread's `wait_limit`
                self._call("flush_cache")

    def memory_stats(self) -> dict:
        """Per worker: weights/KV/backup/staging bytes, RSS/USS (and CUDA allocator stats), plus totals.

        Works on an engine with a dead worker too (the dead one is listed with ``alive: False``).
        """
        workers = self._per_worker("memory_stats")
        out: dict[str, Any] = {"tp_size": self.tp_size, "device": self.device, "workers": workers}
        for key in ("weights_bytes", "kv_cache_bytes", "cpu_backup_bytes", "staging_bytes", "rss", "uss"):
            out[key] = sum(int(w.get(key, 0)) for w in workers)
        return out

    def shard_checksums(self) -> list[str | None]:
        """sha256 of each worker's own shard (None for a dead or unresponsive one): diagnostics that
        work on a broken engine too, e.g. to see an aborted update left a survivor untouched."""
        return [w if isinstance(w, str) else None for w in self._per_worker("shard_checksum", raw=True)]

    def _per_worker(self, cmd: str, raw: bool = False) -> list:
        """Ask every live worker on its own (no collective); a dead or silent one gets a stub."""
        with self._lock:
            if self._w.closed:
                raise EngineClosedError("the engine was shut down")
            alive = self._responsive()
            replies: dict[int, tuple] = {}
            if not self._broken and len(alive) == self.tp_size:
                try:
                    replies = self._round(cmd, ranks=alive, what=cmd)
                except EngineError:
                    replies = {}
            if not replies:   # broken engine: one at a time, so a stuck survivor costs only its timeout
                for r in alive:
                    try:
                        replies.update(self._round(cmd, ranks=[r], what=cmd))
                    except EngineError:
                        pass
            out: list = []
            for r, p in enumerate(self._w.procs):
                rep = replies.get(r)
                if rep is not None and rep[0] == "ok":
                    out.append(rep[1])
                else:
                    out.append(None if raw else {"rank": r, "pid": p.pid, "alive": p.is_alive(),
                                                 **({"error": rep[2]} if rep else {})})
            return out
