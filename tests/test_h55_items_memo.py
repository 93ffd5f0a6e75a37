"""H55 audit (mutation pass) of `weights.items_memo`: two checks of a reused item that no test
needed before, in process on the tiny model (a few milliseconds).

- A tensor that keeps its object, address and shape but not its dtype (a parameter cast twice
  between syncs, the allocator handing the first cast's freed address to the second; shown here
  with a same-size ``.data`` view) is worked out again, as the module docstring promises: a kept
  item would say the old dtype (``src_dtype``, which decides casts and the float32 rule) while its
  data is the new one. Dropping the dtype check survived (the stream itself cast from the live
  tensor, so the bytes stayed right in this case).
- A reused item's data is detached, as a freshly worked out one's: the tensors the export yields
  never require grad (an in-place change by the caller would raise, and a kept graph would hold
  the module's activations). Dropping the ``detach()`` survived.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export

from _util import SEED, perturb_

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def model():
    m = build_model(load_config("tiny"), seed=SEED)
    perturb_(m.parameters())
    return m


def test_a_tensor_retyped_at_the_same_address_is_worked_out_again(model):
    model.half()
    list(export.iter_params(model))
    w = model.model.layers[0].mlp.up_proj.weight
    ptr = w.data_ptr()
    w.data = w.data.view(torch.bfloat16)          # the same object, address and shape; another dtype
    assert w.data_ptr() == ptr and w.dtype == torch.bfloat16
    hits, misses = export._MEMO.hits, export._MEMO.misses
    got = {n: t.clone() for n, t in export.iter_params(model)}
    assert (export._MEMO.hits, export._MEMO.misses) == (hits, misses + 1)
    t = got["model.layers.0.mlp.up_proj.weight"]
    assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), w.detach().view(torch.int16))


def test_reused_items_yield_tensors_that_do_not_require_grad(model):
    first = [(n, t.requires_grad) for n, t in export.iter_params(model)]
    hits = export._MEMO.hits
    again = [(n, t.requires_grad) for n, t in export.iter_params(model)]
    assert export._MEMO.hits == hits + 1                  # the kept items, reused
    assert first == again and not any(rg for _, rg in again), again
