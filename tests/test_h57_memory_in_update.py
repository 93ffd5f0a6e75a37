"""H57's audit of the reference engine's memory calls (`engines.reference.memory_calls`), in process
on the mixin (no workers): inside ``begin_weight_update`` / ``end_weight_update`` both
``release_memory_occupation`` and ``resume_memory_occupation`` are refused by name before any
worker is asked (mutants: either check dropped survived the reference engine's memory tests), and
outside one the tags go to the workers in SGLang's orders, kv_cache -> weights -> cuda_graph to
release and the reverse to resume (mutant: release in the resume order survived them too)."""

from __future__ import annotations

import contextlib
import threading

import pytest

from fsdp_sync.engines import EngineStateError
from fsdp_sync.engines.reference.memory_calls import MemoryCalls


class _Sched:
    def holds_kv(self) -> int:
        return 0


class _Engine(MemoryCalls):
    def __init__(self, in_txn: bool) -> None:
        self._in_txn, self._broken, self._lock, self._sched = in_txn, None, threading.Lock(), _Sched()
        self.rounds: list = []

    @contextlib.contextmanager
    def _gate(self, what: str, exclusive: bool = True):
        yield

    def _check_usable(self) -> None:
        pass

    def _round(self, cmd, args=None, what=""):
        self.rounds.append((cmd, args))
        return {0: ("ok", None), 1: ("ok", None)}

    def _raise_errors(self, replies, what) -> None:
        assert all(rep[0] == "ok" for rep in replies.values())


def test_memory_calls_inside_an_update_are_refused_before_any_worker_is_asked():
    e = _Engine(in_txn=True)
    with pytest.raises(EngineStateError, match="cannot release memory inside begin/end_weight_update"):
        e.release_memory_occupation(["weights"])
    with pytest.raises(EngineStateError, match="cannot resume memory inside begin/end_weight_update"):
        e.resume_memory_occupation(["weights"])
    assert e.rounds == []


def test_memory_tags_reach_the_workers_in_sglangs_orders():
    e = _Engine(in_txn=False)
    e.release_memory_occupation()
    e.resume_memory_occupation(["kv_cache", "weights"])
    assert e.rounds == [("release", {"tags": ["kv_cache", "weights", "cuda_graph"]}),
                        ("resume", {"tags": ["weights", "kv_cache"]})]
