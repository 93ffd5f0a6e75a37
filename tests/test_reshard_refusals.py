"""Per-rank buckets need exactly the model's Hugging Face tensors: a module that lacks one (or
holds one the layout does not know) is refused before anything is built, with a ValueError that
names the layout, the TP size and the unknown and missing names, not a bare KeyError.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import reshard
from fsdp_sync.weights.layout import layout_for

pytestmark = pytest.mark.timeout(60)


def _first(module, layout):
    it = reshard.iter_rank_buckets(module, layout, 64 << 10, alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    try:
        return next(it)
    finally:
        it.close()


def test_a_module_missing_a_tensor_is_refused_naming_it():
    cfg = load_config("tiny")
    layout = layout_for(cfg, 2)
    model = build_model(cfg, seed=0)
    assert _first(model, layout).bucket.entries          # the whole model: buckets are built
    model.model.norm = torch.nn.Identity()               # no model.norm.weight
    with pytest.raises(ValueError, match=r"do not match the \w+ layout at tp 2: unknown \[\], "
                                         r"missing \['model\.norm\.weight'\]"):
        _first(model, layout)


def test_a_module_with_an_unknown_tensor_is_refused_naming_it():
    cfg = load_config("tiny")
    layout = layout_for(cfg, 2)
    model = build_model(cfg, seed=0)
    model.model.extra = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"unknown \['model\.extra\.weight'\], missing \[\]"):
        _first(model, layout)
