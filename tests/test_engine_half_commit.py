"""A transaction's commit (``end_weight_update``) that fails on some TP workers of the reference
engine: the engine ends coherent, never serving half-new weights nor stuck with a transaction open.

- one worker fails (``FSDP_SYNC_FAULT=worker:1:end:raise``) after the other applied its staged
  copies: the shards now disagree, so the engine is broken and says so (generate, weights_checksum,
  begin_weight_update all refuse naming the inconsistent weights; before, it answered a checksum
  of neither version and every later begin failed "end_weight_update without begin_weight_update");
- every worker fails before its commit: each drops its transaction untouched, so the engine keeps
  serving the previous weights and takes the next update.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import EngineError, ReferenceEngine, WeightUpdateError, checksum_named_tensors
from fsdp_sync.faultpoint import FAULT_ENV
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(90)


def _model(seed: int) -> list:
    return list(build_model(load_config("tiny"), seed=seed).state_dict().items())


def _sync(e: ReferenceEngine, named: list, version: str) -> None:
    e.begin_weight_update()
    e.update_weights_from_tensor(named)
    e.end_weight_update(weight_version=version)


def _engine(tp_size: int, fault: str, monkeypatch, after: str = "1") -> ReferenceEngine:
    # the workers take the fault from the environment they start with; it passes the first `end`
    monkeypatch.setenv(FAULT_ENV, fault)
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", after)
    try:
        return ReferenceEngine("tiny", tp_size=tp_size, kv_cache_tokens=64, call_timeout_s=60, pg_timeout_s=30)
    finally:
        monkeypatch.delenv(FAULT_ENV)
        monkeypatch.delenv("FSDP_SYNC_FAULT_AFTER")


def test_one_worker_failing_its_commit_after_the_other_committed_breaks_the_engine(monkeypatch):
    v1, v2 = _model(1), _model(2)
    with _engine(2, "worker:1:end:raise", monkeypatch) as e:
        _sync(e, v1, "1")                       # into the start-up weights: written in place
        assert e.weights_checksum() == checksum_named_tensors(v1)
        shards1 = e.shard_checksums()
        with pytest.raises(EngineError, match=r"TP ranks \[0\] committed the update \(version '2'\) and "
                                              r"TP ranks \[1\] did not: the weights are inconsistent"):
            _sync(e, v2, "2")                   # staged copies: rank 0 applies them, rank 1 raises
        shards = e.shard_checksums()
        assert shards[0] != shards1[0] and shards[1] == shards1[1]   # half new: what is refused below
        for call in (e.weights_checksum, lambda: e.generate([[1, 2, 3]], max_new_tokens=2),
                     e.begin_weight_update):
            with pytest.raises(EngineError, match="inconsistent across TP ranks.*shut it down and start a new one"):
                call()
        assert "inconsistent across TP ranks" in e.dead_reason() and "broken" in repr(e)
        assert e.weight_version == "1"


def test_every_worker_failing_before_its_commit_keeps_the_previous_weights(monkeypatch):
    v1, v2 = _model(1), _model(2)
    with _engine(1, "worker:0:end:raise", monkeypatch) as e:
        _sync(e, v1, "1")
        with pytest.raises(WeightUpdateError, match="nothing was committed: the update was dropped on every "
                                                    "TP rank; the engine keeps its previous weights"):
            _sync(e, v2, "2")
        assert e.weights_checksum() == checksum_named_tensors(v1) and e.weight_version == "1"
        assert e.dead_reason() is None
        _sync(e, v2, "2")                       # the worker's transaction was dropped: a new one opens
        assert e.weights_checksum() == checksum_named_tensors(v2) and e.weight_version == "2"
        assert len(e.generate([[1, 2, 3]], max_new_tokens=2, ignore_eos=True)[0]) == 2


def test_ctrl_c_while_the_workers_commit_breaks_the_engine(monkeypatch):
    """A Ctrl-C while end_weight_update waits for the workers' commit: they may have committed (here
    they have), but the weight version was not changed. Before, the engine went on serving the new
    weights under the old version, not broken (manager, engine and SGLang's get_weight_version all
    said the old one); now it is broken and says why, as after an interrupted two-phase commit."""
    from fsdp_sync.engines import WorkerDiedError

    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=60) as e:
        _sync(e, _model(0), "1")
        real = e._collect

        def interrupted(seq, ranks, what, timeout):
            if what == "end":
                real(seq, ranks, what, timeout)       # the workers have committed
                raise KeyboardInterrupt("pressed while the workers committed")
            return real(seq, ranks, what, timeout)

        monkeypatch.setattr(e, "_collect", interrupted)
        e.begin_weight_update()
        e.update_weights_from_tensor(_model(1))
        with pytest.raises(KeyboardInterrupt):
            e.end_weight_update(weight_version="2")
        monkeypatch.setattr(e, "_collect", real)
        assert e.weight_version == "1"
        with pytest.raises(WorkerDiedError, match="interrupted while the TP ranks committed") as info:
            e.generate([[1, 2, 3]], max_new_tokens=2)
        assert "shut it down and start a new one" in str(info.value)


def test_a_copy_aside_failing_in_a_transaction_aborts_it_and_the_engine_serves_on(monkeypatch):
    """A transactional update's call copies what it receives aside (the weights stay as they were
    until end_weight_update). One worker's copy failing (out of memory, say; injected here on TP
    rank 1) marked the engine broken, though no rank's weights had changed: it served nothing more
    until restarted. Now the transaction is aborted on every rank, the call raises a
    WeightUpdateError saying nothing was applied, the previous weights serve, and the next update
    goes through."""
    # the first sync writes the start-up weights in place; the second copies aside
    with _engine(2, "worker:1:stage_aside:raise", monkeypatch, after="0") as e:
        old, new = _model(0), _model(1)
        _sync(e, old, "1")
        before = e.weights_checksum()
        assert before == checksum_named_tensors(old)
        e.begin_weight_update()
        with pytest.raises(WeightUpdateError, match="TP rank 1: copying the update aside failed .*"
                                                    "nothing was applied on this rank"):
            e.update_weights_from_tensor(new)
        assert e.end_weight_update(abort=True) is True
        assert e.weights_checksum() == before and e.weight_version == "1"
        assert len(e.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2
        _sync(e, new, "2")
        assert e.weights_checksum() == checksum_named_tensors(new) and e.weight_version == "2"
