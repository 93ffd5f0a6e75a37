"""Per-rank buckets refuse a tensor whose shape is not the layout's, naming it and both shapes,
before any buffer is built (H9 mutation pass: the shape check in `reshard` dropped survived
tests/test_reshard.py and tests/test_reshard_refusals.py, which change names only; the stream
then cut the wrong-sized tensor by the layout's element ranges). In-process, one rank."""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import reshard
from fsdp_sync.weights.layout import layout_for


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.self_attn.k_proj.weight"])
def test_a_tensor_of_another_shape_is_refused_naming_it(name):
    cfg = load_config("tiny")
    layout = layout_for(cfg, 2)
    model = build_model(cfg, seed=0)
    mod, attr = model.get_submodule(name.rsplit(".", 1)[0]), "weight"
    old = tuple(getattr(mod, attr).shape)
    bad = (old[0] + 16,) + old[1:]                       # 16 more rows (one more KV head of 16)
    setattr(mod, attr, torch.nn.Parameter(torch.zeros(bad)))
    built = []
    with pytest.raises(ValueError, match=re.escape(f"expected shape {old} for {name!r} (the layout's), got {bad}")):
        for rb in reshard.iter_rank_buckets(model, layout, 64 << 10,
                                            alloc=lambda n: built.append(n) or torch.empty(n, dtype=torch.uint8)):
            pass
    assert built == []                                   # refused before any buffer
