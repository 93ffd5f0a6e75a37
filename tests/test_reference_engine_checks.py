"""Checks of the reference engine that each guard one case no other test reached:

- a tied model's ``lm_head.weight`` sent alone, outside a transaction, is compared with the
  embedding the engine has loaded (`engines.reference.tied_head`): a head that differs would be
  dropped (the engine's head is its embedding), so it is refused and nothing changes;
- a ``quantization_config`` whose ``weight_block_size`` is not two positive ints is refused naming
  it (`engines.reference.quant.resolve`), zero included: a block of 0 rows has no scale to read;
- a worker takes the checked LoRA pairs of its last payload again (`worker.Worker._lora_pairs`)
  only when the metadata is the last one's too: the same buffer (same pointer and size) whose
  bytes were rewritten in another tensor order is read anew, and the engine serves that adapter.
"""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine, WeightUpdateError
from fsdp_sync.engines.reference.quant import resolve
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import handles
from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets
from fsdp_sync.wire import flattened_bucket
from test_adapter_shard_reuse import QV, adapter
from test_tied_head import EMB, HEAD, _emb, tied_engine  # noqa: F401 - tied_engine: the fixture

pytestmark = pytest.mark.timeout(120)


def test_a_head_sent_alone_outside_a_transaction_is_checked_against_the_loaded_embedding(tied_engine):
    loaded = _emb(tied_engine)
    tied_engine.update_weights_from_tensor([(HEAD, loaded.clone())])        # equal bits: taken
    before = tied_engine.weights_checksum()
    bad = loaded.clone()
    bad[-1, -1] += 1.0
    with pytest.raises(WeightUpdateError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'.*"
                                                "the loaded embedding"):
        tied_engine.update_weights_from_tensor([(HEAD, bad)])
    assert tied_engine.weights_checksum() == before and torch.equal(_emb(tied_engine), loaded)


@pytest.mark.parametrize("block", [[0, 128], [128, 0], [-128, 128], [128], [128, 128, 128], [True, 128],
                                   [128.0, 128], "128"])
def test_a_block_size_that_is_not_two_positive_ints_is_refused_naming_it(block):
    qc = {"quant_method": "fp8", "weight_block_size": block, "activation_scheme": "dynamic"}
    with pytest.raises(ValueError, match=re.escape(f"weight_block_size {block!r}; expected two positive ints")):
        resolve(load_config("tiny-fp8", quantization_config=qc), "fp8")


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


def test_a_kept_buffer_with_other_metadata_is_read_anew(tiny):
    """Three loads of adapter "a" from one host-shared buffer, as `lora_sync.load_adapter` hands
    it over: the second rewrites the bytes under the same metadata (each worker takes its kept
    pairs, which view the buffer: the new bytes are served), the third writes another adapter in
    the reverse tensor order, the buffer's pointer and size unchanged. Reusing the kept pairs
    there would read each tensor at the first order's offset: another adapter than the one sent."""
    t1, cfg = adapter(tiny, 4, QV, 1)
    t1b, _ = adapter(tiny, 4, QV, 2)
    t2, _ = adapter(tiny, 4, QV, 3)
    names = list(t1)
    (forward,) = plan_buckets([TensorMeta.of(n, t1[n]) for n in names], 1 << 30)
    (backward,) = plan_buckets([TensorMeta.of(n, t1[n]) for n in reversed(names)], 1 << 30)
    assert forward.nbytes == backward.nbytes and forward.entries[0].name != backward.entries[0].name
    flat = handles.empty_shared(forward.nbytes)
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2, max_lora_rank=8) as eng:
        def load(bucket, tensors):
            flatten(bucket, tensors, out=flat)
            ps = handles.make_payloads(flattened_bucket(flat, bucket), eng.tp_size)
            try:
                res = eng.load_lora_adapter_from_tensors("a", list(ps.payloads), cfg,
                                                         load_format="flattened_bucket", replace=True)
            finally:
                ps.release(require_ack=False)
            back = eng.lora_tensors("a")
            served = sorted(back) == sorted(k.removeprefix("base_model.model.") for k in tensors) and all(
                torch.equal(back[k.removeprefix("base_model.model.")], v) for k, v in tensors.items())
            return res["kept_check"], served

        assert load(forward, t1) == (0, True)
        assert load(forward, t1b) == (2, True)          # same metadata: both workers' kept pairs
        assert load(backward, t2) == (0, True)          # other metadata: read and checked anew
        eng.unload_lora_adapter("a")
