"""A reference-engine round that fails on one TP rank only must not leave the ranks in different
states that later calls trip over (H1 fault audit).

- ``begin_weight_update`` refused on rank 1 alone: before, rank 0 kept the transaction it began
  while the engine opened none, so the next plain update was staged aside on rank 0 (old weights
  kept) and applied on rank 1, and generate served that mix silently; every later begin was
  refused ("called twice") for good.
- ``release_memory_occupation`` failing on rank 1 alone (rank 0 released its weights): the next
  generate's step was refused on rank 0 before the forward's collective, in which rank 1 then
  waited out the process-group timeout; the engine stayed "healthy" (``dead_reason`` None) and
  every later generate failed with gloo's "Connection closed by peer". Now the release itself
  breaks the engine, naming the ranks that released and those that failed, and every later call
  says so at once (a first fix broke it only at that step, after the process-group timeout).
"""

from __future__ import annotations

import time

import psutil
import pytest

from fsdp_sync.engines import EngineError, ReferenceEngine, WorkerDiedError
from fsdp_sync.faultpoint import FAULT_ENV
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[11, 27, 93, 5], [7, 8]]


def _gone(pids):
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_begin_refused_on_one_rank_leaves_no_transaction_open_on_the_others(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "worker:1:begin:raise")     # the workers inherit it; fires once
    old = list(build_model(load_config("tiny"), seed=7).state_dict().items())
    new = list(build_model(load_config("tiny"), seed=9).state_dict().items())
    with ReferenceEngine("tiny", tp_size=2, kv_cache_tokens=64, call_timeout_s=60, pg_timeout_s=30) as ref:
        ref.update_weights_from_tensor(new)
        want_shards, want_tokens = ref.shard_checksums(), ref.generate(PROMPTS, 4)
    with ReferenceEngine("tiny", tp_size=2, kv_cache_tokens=64, call_timeout_s=60, pg_timeout_s=30) as e:
        pids = list(e.worker_pids)
        e.update_weights_from_tensor(old)          # loaded weights: a transaction would stage aside
        with pytest.raises(EngineError, match=r"begin_weight_update: InjectedFault.*worker 1 at begin"):
            e.begin_weight_update()
        assert e.dead_reason() is None
        e.update_weights_from_tensor(new)          # a plain update: committed on every rank
        assert e.shard_checksums() == want_shards
        assert e.generate(PROMPTS, 4) == want_tokens
        e.begin_weight_update()                    # and a transaction can be opened again
        e.update_weights_from_tensor(old)
        assert e.end_weight_update(abort=True) is True
        assert e.shard_checksums() == want_shards
    assert _gone(pids)


def test_a_release_failed_on_one_rank_breaks_the_engine_at_once_naming_the_ranks(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "worker:1:release:raise")
    model = list(build_model(load_config("tiny"), seed=7).state_dict().items())
    pg_s = 6.0
    with ReferenceEngine("tiny", tp_size=2, kv_cache_tokens=64, call_timeout_s=60, pg_timeout_s=pg_s) as e:
        pids = list(e.worker_pids)
        e.update_weights_from_tensor(model)
        # released on rank 0 only: broken at once, naming the ranks (before the first fix the
        # next generate hung until the process group's timeout and left a dead group with no
        # dead_reason; after it, that generate still waited out the timeout before breaking)
        with pytest.raises(EngineError, match=r"release_memory_occupation\(\['weights'\]\): failed on "
                                              r"TP ranks \[1\] \(.*worker 1 at release.*\) and went "
                                              r"through on TP ranks \[0\]"):
            e.release_memory_occupation(["weights"])
        assert "hold their memory differently" in (e.dead_reason() or "")
        for call in (lambda: e.generate(PROMPTS, 4), e.resume_memory_occupation,
                     lambda: e.update_weights_from_tensor(model)):
            t0 = time.monotonic()
            with pytest.raises(WorkerDiedError, match="hold their memory differently"):
                call()
            assert time.monotonic() - t0 < 2
    assert _gone(pids)
