"""`experts.hub_parts` refuses a fused ``gate_up_proj`` whose row count is odd, naming it and its
shape, instead of cutting it into gate and up halves that leave a row out (H9 mutation pass: the
check dropped survived tests/test_moe.py; the cut then silently lost each expert's last up row
and shifted the next expert's gate). Down projections and even splits are cut as before."""

from __future__ import annotations

import pytest

from fsdp_sync.weights.experts import hub_parts

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def test_an_odd_fused_gate_up_is_refused_by_name_and_shape():
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj': a fused "
                                         r"gate_up_proj of shape \(2, 5, 4\) has an odd row count"):
        hub_parts(NAME, (2, 5, 4), "qwen3_moe")
    parts = hub_parts(NAME, (2, 6, 4), "qwen3_moe")
    assert [(n.rsplit(".", 3)[-3:], s, off) for n, s, off in parts] == [
        (["0", "gate_proj", "weight"], (3, 4), 0), (["0", "up_proj", "weight"], (3, 4), 12),
        (["1", "gate_proj", "weight"], (3, 4), 24), (["1", "up_proj", "weight"], (3, 4), 36)]
    # Mixtral's names; its down projection (w2) is one range per expert, odd or not
    down = hub_parts("model.layers.1.mlp.experts.down_proj", (2, 4, 3), "mixtral")
    assert down == [("model.layers.1.block_sparse_moe.experts.0.w2.weight", (4, 3), 0),
                    ("model.layers.1.block_sparse_moe.experts.1.w2.weight", (4, 3), 12)]
