"""Audit H28: the reference engine's update transaction, bit-exact, in one TP-1 engine.

- A staging transaction copies each call aside (`staging.stage_aside`): the sender reuses one
  shared buffer call after call (as the sync's bucket pool does), so a staged write that kept a
  view of it would commit the last call's bytes (or the zeros the sender left) in place of every
  earlier call's. Mutant: the copy aside skipped; every earlier bucket then committed wrong.
- An aborted transaction leaves the served weights bit-exact as before, its version unchanged;
  a committed one is bit-exact the sent weights, its last call included, under the version sent.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine, WeightUpdateError, checksum_named_tensors
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import handles
from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets, sglang_metadata

pytestmark = pytest.mark.timeout(120)


def _named(seed: int) -> list:
    return list(build_model(load_config("tiny"), seed=seed).state_dict().items())


@pytest.fixture(scope="module")
def eng():
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=256, call_timeout_s=60, pg_timeout_s=30) as e:
        e.update_weights_from_tensor(_named(0), weight_version="v0")
        yield e


def _push_reusing_one_buffer(e: ReferenceEngine, named: list, bucket_bytes: int = 96 * 1024) -> int:
    """Flattened buckets of ``named``, every one in the same shared buffer, zeroed after each call."""
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in named], bucket_bytes)
    assert len(plan) >= 3
    tensors = dict(named)
    buf = handles.empty_shared(max(b.nbytes for b in plan))
    for b in plan:
        flat = flatten(b, tensors, out=buf[:b.nbytes])
        with handles.make_payloads({"flattened_tensor": flat, "metadata": sglang_metadata(b)}, 1) as ps:
            e.update_weights_from_tensor(ps.payloads, load_format="flattened_bucket")
        buf.zero_()             # the sender takes its buffer back for the next bucket
    return len(plan)


def test_a_transaction_over_one_reused_buffer_commits_every_call_bit_exact(eng):
    v0, v1 = _named(0), _named(1)
    assert eng.weights_checksum() == checksum_named_tensors(v0)
    eng.begin_weight_update()
    _push_reusing_one_buffer(eng, v1)
    assert eng.weights_checksum() == checksum_named_tensors(v0)     # nothing served before the end
    assert eng.end_weight_update(weight_version="v1") is True
    assert eng.weights_checksum() == checksum_named_tensors(v1) and eng.weight_version == "v1"
    eng.update_weights_from_tensor(v0, weight_version="v0")         # as the module found it


def test_an_aborted_transaction_leaves_the_weights_and_version_bit_exact(eng):
    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    _push_reusing_one_buffer(eng, v1)
    eng.update_weights_from_tensor(v1[:2], weight_version="v1")     # a pending version, dropped too
    assert eng.end_weight_update(abort=True) is True
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"


def test_an_abort_given_a_weight_version_is_refused_and_leaves_the_update_open(eng):
    """In process it was taken as an abort and the version dropped without a word; SGLangEngine
    and `fsdp-sync serve` refuse the pair. Refused before anything changes: the update stays open."""
    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:2])
    with pytest.raises(ValueError, match=r"an abort commits no weights.*'v9'.*not both"):
        eng.end_weight_update(abort=True, weight_version="v9")
    assert eng.end_weight_update(abort=True) is True                 # still open: dropped now
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"


def test_a_failed_call_aborts_the_transaction_nothing_of_it_served(eng):
    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:3], weight_version="v1")
    name, t = v1[3]
    with pytest.raises(WeightUpdateError, match="shape"):
        eng.update_weights_from_tensor([(name, t.reshape(-1)[:-1].clone())])
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update(weight_version="v1")
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"
    # the last call of a committed transaction is in the weights too
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:-1])
    eng.update_weights_from_tensor(v1[-1:], weight_version="v1")
    assert eng.weights_checksum() == checksum_named_tensors(v0)
    eng.end_weight_update()
    assert eng.weights_checksum() == checksum_named_tensors(v1) and eng.weight_version == "v1"
    eng.update_weights_from_tensor(v0, weight_version="v0")


def test_a_refused_disk_call_aborts_the_transaction_it_is_in(eng, tmp_path):
    """disk_calls, mutant: a checkpoint refused before any worker stages (no such file) did not
    abort the open transaction, so its end committed the calls before it: part of an update that
    failed, served under the version sent."""
    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:3])
    with pytest.raises(WeightUpdateError, match="update_weights_from_disk"):
        eng.update_weights_from_disk(str(tmp_path / "missing"))
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update(weight_version="v1")
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"


def test_a_disk_call_failing_other_than_a_refused_checkpoint_aborts_the_transaction(eng, tmp_path, monkeypatch):
    """disk_calls (H55): only a CheckpointError from resolving the directory aborted the open
    transaction; anything else (a non-root user's unreadable directory: ``os.listdir`` raises
    PermissionError) left it open and raw, so its end committed the calls before it."""
    from fsdp_sync.engines.reference import disk_calls

    def unreadable(model_path, *a, **k):
        raise PermissionError(13, "Permission denied", str(model_path))

    monkeypatch.setattr(disk_calls, "disk_items", unreadable)
    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:3])
    with pytest.raises(WeightUpdateError, match=r"update_weights_from_disk\(.*\): PermissionError: .*Permission denied"):
        eng.update_weights_from_disk(str(tmp_path))
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update(weight_version="v1")
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"




def test_a_second_begin_is_refused_and_the_open_update_goes_on_whole(eng):
    """transaction (H55 mutation pass): ``begin_weight_update`` twice is refused by the client
    before any worker hears of it, so the open update keeps every call staged so far and commits
    them all. A mutant without the check survived (no test called begin twice)."""
    from fsdp_sync.engines import EngineStateError

    v0, v1 = _named(0), _named(1)
    eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[:3])
    with pytest.raises(EngineStateError, match="begin_weight_update called twice"):
        eng.begin_weight_update()
    eng.update_weights_from_tensor(v1[3:])
    assert eng.weights_checksum() == checksum_named_tensors(v0)
    assert eng.end_weight_update(weight_version="v1") is True
    assert eng.weights_checksum() == checksum_named_tensors(v1) and eng.weight_version == "v1"
    eng.update_weights_from_tensor(v0, weight_version="v0")


def test_a_hash_ahead_hint_naming_files_of_ranks_the_engine_lacks_is_ignored(eng, tmp_path):
    """disk_calls (H55 mutation pass): `hash_files_ahead` is a hint and never fails its caller;
    files of engine ranks beyond this engine's TP size (a version cut for a larger engine, refused
    at its load) are dropped from it. A mutant without that filter survived: it raised IndexError
    to the trainer mid-write after hinting rank 0."""
    v0 = _named(0)
    eng.hash_files_ahead(str(tmp_path), ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors",
                                         "model-rank-7-part-3.safetensors"], "sha256")
    eng.drop_files_ahead(str(tmp_path))
    eng.update_weights_from_tensor(v0[:2], weight_version="v0")
    assert eng.weights_checksum() == checksum_named_tensors(v0) and eng.weight_version == "v0"
