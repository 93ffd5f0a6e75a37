"""Audit H62: a reference worker's side of a sync, in this process (no worker process started).

A `worker.Worker` of TP size 1 is built here (37 ms: the tiny model, a 16-token KV cache) and its
`staging.UpdateStager` driven as the engine drives it (begin, stage, commit, abort, end), so each
check reads the worker's own state and weights; the multi-process paths (a worker dying, timeouts)
have their own tests (test_engine_lifecycle.py, test_refeng_mutants.py).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines.reference import worker as wk
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights.layout import ModelSpec

pytestmark = pytest.mark.timeout(60)

_CFG = load_config("tiny")


@pytest.fixture(scope="module")
def trained() -> list:
    return list(build_model(_CFG, seed=1).state_dict().items())


@pytest.fixture
def w(monkeypatch):
    """A fresh TP-1 worker on CPU: the random start-up weights, nothing pushed yet."""
    monkeypatch.setattr(wk, "_pin_malloc", lambda: None)    # not this test process's malloc
    threads = torch.get_num_threads()
    opts = {"spec": ModelSpec.from_config(_CFG), "device": "cpu", "dtype": torch.float32,
            "kv_cache_tokens": 16, "mem_fraction": None, "weights_cpu_backup": False, "seed": 0,
            "num_threads": threads, "base_gpu_id": 0, "pg_timeout_s": 10, "use_memory_saver": False,
            "update_recv_timeout_s": 10, "ep": 1, "quant": None, "keep_bucket_buffers": True}
    worker = wk.Worker(0, 1, None, opts)
    yield worker
    worker.updates.abort("the test ended")      # (not `close`: its gc.collect() of this whole
    worker.updates.close_ahead()                # process takes seconds, its worker's startup frozen)
    torch.set_num_threads(threads)


def _items(named: list) -> list:
    return [("tensor", "hf", n, t) for n, t in named]


def _weights(worker) -> dict:
    return {k: v.clone() for k, v in worker.model.params.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _push(worker, named: list) -> None:
    """One update outside a transaction: stage, then commit (the engine's two rounds)."""
    worker.updates.stage(_items(named))
    worker.updates.commit()


def test_an_abort_drops_the_staged_copies_at_once_and_leaves_the_weights_bit_exact(w, trained):
    """Loaded weights: a transaction copies each call aside (``staging_bytes``: exactly what was
    pushed) and nothing of it is served before the end; an abort gives the copies back at once
    (not at an ``end`` that may come much later, or never), and the weights stay bit-exact.
    Mutant: the abort kept ``txn.writes`` (the copies held until the end), killed."""
    _push(w, trained)
    before = _weights(w)
    assert w.updates.begin(True) == {"staging": True}
    pushed = trained[:4]
    w.updates.stage(_items([(n, t + 1) for n, t in pushed]))
    w.updates.commit()
    assert w.memory.stats()["staging_bytes"] == sum(t.nbytes for _, t in pushed)
    assert _same(before, _weights(w))                       # nothing served before the end
    w.updates.abort("a later call was refused")
    assert w.memory.stats()["staging_bytes"] == 0
    assert w.updates.end(abort=True) == {"committed": False, "overwritten": None, "dropped": True}
    assert _same(before, _weights(w)) and w.memory.stats()["weights_valid"]


def test_an_abort_gives_the_senders_kept_bucket_buffer_back_at_once(w, trained):
    """A per-rank bucket's buffer is kept mapped between calls of one update (`_keep_mapped`);
    an abort lets go of it at once: the sender's sync failed, and an ``end`` may never come to
    free it. Mutant: the abort kept it mapped, killed."""
    from fsdp_sync.weights import handles
    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets, sglang_metadata

    _push(w, trained)
    part = dict(trained[:3])
    (bucket,) = plan_buckets([TensorMeta.of(n, t) for n, t in part.items()], 1 << 30)
    buf = handles.empty_shared(bucket.nbytes)
    flat = flatten(bucket, part, out=buf[:bucket.nbytes])
    w.updates.begin(True)
    with handles.make_payloads({"flattened_tensor": flat, "metadata": sglang_metadata(bucket)}, 1) as ps:
        w.updates.stage([("bucket", "hf", ps.payloads[0])], keep_mapped=True)
        w.updates.commit()
        assert len(w.updates.mapped) == 1
        w.updates.abort("the sender's sync failed")
        assert len(w.updates.mapped) == 0
    w.updates.end(abort=True)


def test_released_weights_are_reported_as_such_and_refused_until_resumed_and_pushed(w, trained):
    """Released without a backup: the worker reports its weights and KV cache as 0 bytes held and
    its checksum as ``"released"`` (not a digest of nothing, nor an error), refuses an update into
    them naming the call that brings them back, and after the resume (zeros) refuses to serve
    until every tensor is pushed again; pushed, it serves exactly them. Mutant: the checksum of
    released weights taken anyway (a KeyError, the rank reported as unreadable), killed."""
    from fsdp_sync.engines.reference.errors import WorkerError

    _push(w, trained)
    pushed = w.shard_checksum()
    w.memory.release(["kv_cache", "weights"])
    stats = w.memory.stats()
    assert (stats["weights_bytes"], stats["kv_cache_bytes"], stats["weights_valid"]) == (0, 0, False)
    assert w.shard_checksum() == "released"
    with pytest.raises(WorkerError, match=r"weights are released on TP rank 0; call "
                                          r"resume_memory_occupation\(\['weights'\]\)"):
        w.updates.stage(_items(trained[:1]))
    w.memory.resume(["weights"])
    assert w.memory.stats()["weights_bytes"] == w.model.nbytes() > 0
    with pytest.raises(WorkerError, match="released without a CPU backup and not all pushed again: "
                                          f"{len(trained)} of {len(trained)} tensors missing"):
        w.forward_logits([[1, 2, 3]], False)
    _push(w, trained)
    w.memory.resume(["kv_cache"])
    assert w.shard_checksum() == pushed and w.memory.stats()["weights_valid"]
