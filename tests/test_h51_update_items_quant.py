"""In-process checks of `update_items` and `quant` the engine tests do not reach: a flattened
distributed bucket whose tensors would sit at offsets their dtype cannot be read at is refused
naming the tensor, and a quantization config whose ``ignored_layers`` is one string (not a list
of names) is refused rather than read as its characters (which would quantize that layer)."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.engines import WeightUpdateError
from fsdp_sync.engines.reference.quant import resolve
from fsdp_sync.engines.reference.update_items import build_items, distributed_entries

pytestmark = pytest.mark.timeout(60)


def test_a_misaligned_flattened_bucket_is_refused_naming_the_tensor():
    names, dtypes = ["a.weight", "b.weight"], ["bfloat16", "float32"]
    with pytest.raises(WeightUpdateError, match=r"'b.weight' \(float32\) would start at byte 6 .* not a multiple "
                                                r"of its dtype size 4") as info:
        distributed_entries(names, dtypes, [[3], [2]], "flattened_bucket")
    assert info.value.name == "b.weight"
    # aligned, or not flattened (each tensor its own broadcast): taken
    assert distributed_entries(names, dtypes, [[4], [2]], "flattened_bucket") == [
        ("a.weight", torch.bfloat16, (4,)), ("b.weight", torch.float32, (2,))]
    assert len(distributed_entries(names, dtypes, [[3], [2]], None)) == 2


@pytest.mark.parametrize("shape", [[-1, 4], ["x", 4], None, [64.0, 64], [True, 64], "64"])
def test_a_shape_that_is_no_shape_is_refused_naming_the_tensor(shape):
    with pytest.raises(WeightUpdateError, match=r"bad shape .* for 'a.weight'"):
        distributed_entries(["a.weight"], ["float32"], [shape], None)


def test_shapes_of_ints_are_taken_whatever_holds_them():
    import numpy as np

    for shape in ([64, 32], (64, 32), torch.Size([64, 32]), np.array([64, 32]), [np.int64(64), 32]):
        assert distributed_entries(["a.weight"], ["float32"], [shape], None) == [("a.weight", torch.float32, (64, 32))]
    assert distributed_entries(["a.weight"], ["float32"], [[]], None) == [("a.weight", torch.float32, ())]


def config(**qc):
    return types.SimpleNamespace(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], **qc})


def test_ignored_layers_as_one_string_is_refused_not_read_as_characters():
    with pytest.raises(ValueError, match=r"ignored_layers / modules_to_not_convert 'lm_head'; expected a list"):
        resolve(config(ignored_layers="lm_head"), None)
    assert resolve(config(ignored_layers=["lm_head"]), None)["ignored"] == ("lm_head",)
    assert resolve(config(modules_to_not_convert=["lm_head"]), "fp8")["ignored"] == ("lm_head",)


@pytest.mark.parametrize("fmt", ["flattened_bucket", "direct"])
def test_a_bucket_count_other_than_the_tp_size_names_the_load_format_given(fmt):
    """``direct`` takes per-rank flattened buckets too; its refusal named 'flattened_bucket'."""
    with pytest.raises(WeightUpdateError, match=rf"load_format='{fmt}' with flattened buckets takes one payload "
                                                r"per TP rank \(2\), got 3"):
        build_items([b"x"] * 3, fmt, 2, [])
