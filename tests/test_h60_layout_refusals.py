"""The layout map's refusals of a split SGLang cannot make evenly, each naming the config field,
its value and the TP size (H60's mutation pass: dropping the dense MLP's or Qwen2-MoE's shared
expert's divisibility check, or taking TP 0, survived every test that covers `weights.layout`).
A model whose MoE layers leave ``intermediate_size`` unused is not refused for it. In process,
no engine: each case builds one `TPLayout`.
"""

from __future__ import annotations

import re

import pytest

from fsdp_sync.models import load_config
from fsdp_sync.weights.layout import ModelSpec, TPLayout


def _spec(recipe: str, **overrides) -> ModelSpec:
    return ModelSpec.from_config(load_config(recipe, **overrides))


def test_a_dense_mlp_that_does_not_split_is_refused_naming_the_field_its_size_and_tp():
    spec = _spec("tiny", intermediate_size=130)
    with pytest.raises(ValueError, match=re.escape("intermediate_size (130) must be divisible by tp_size (4)")):
        TPLayout(spec, 4)
    assert TPLayout(spec, 2).inter_local == 65          # it splits in two: taken


def test_an_uneven_intermediate_size_matters_only_where_a_layer_is_dense():
    # Qwen3-MoE: every layer sparse uses moe_intermediate_size only; one dense layer uses it
    sparse = _spec("tiny-qwen3-moe", intermediate_size=130, mlp_only_layers=[])
    assert not [i for i in range(sparse.num_layers) if i not in sparse.moe_layers]
    TPLayout(sparse, 4)
    dense = _spec("tiny-qwen3-moe", intermediate_size=130, mlp_only_layers=[0])
    with pytest.raises(ValueError, match=re.escape("intermediate_size (130) must be divisible by tp_size (4)")):
        TPLayout(dense, 4)


def test_a_shared_expert_that_does_not_split_is_refused_naming_the_field_its_size_and_tp():
    spec = _spec("tiny-qwen2-moe", shared_expert_intermediate_size=66)
    with pytest.raises(ValueError, match=re.escape("shared_expert_intermediate_size (66) must be divisible "
                                                   "by tp_size (4)")):
        TPLayout(spec, 4)
    assert TPLayout(spec, 2).shared_local == 33


@pytest.mark.parametrize("tp", [0, -2])
def test_a_tp_size_below_one_is_refused_naming_it(tp):
    with pytest.raises(ValueError, match=re.escape(f"tp_size must be >= 1, got {tp}")):
        TPLayout(_spec("tiny"), tp)
