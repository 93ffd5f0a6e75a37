"""`fsdp_sync.engines.base`: the small pieces every engine and the transports share, in process.

- `ordered_tags`: None or empty is every tag, a bare string one tag, any order given comes back
  in the order asked for (SGLang's release/resume orders), an unknown tag is refused naming it;
- `SerializedPerRank`: a tuple is taken as a list, anything else refused naming its type;
- `checksum_named_tensors` (what `Engine.weights_checksum` is compared with): order-free, and
  different for another name, dtype, shape or a single bit; a strided view hashes as its values.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines.base import (RELEASE_ORDER, RESUME_ORDER, TAGS, SerializedPerRank,
                                    checksum_named_tensors, ordered_tags)


def test_ordered_tags_every_tag_one_tag_the_order_and_a_refusal():
    for everything in (None, [], ()):
        assert ordered_tags(everything, RELEASE_ORDER) == list(RELEASE_ORDER)
    assert ordered_tags("weights", RESUME_ORDER) == ["weights"]
    assert ordered_tags(["weights", "kv_cache"], RELEASE_ORDER) == ["kv_cache", "weights"]
    assert ordered_tags(("kv_cache", "cuda_graph", "weights"), RESUME_ORDER) == list(RESUME_ORDER)
    assert sorted(RELEASE_ORDER) == sorted(RESUME_ORDER) == sorted(TAGS)
    with pytest.raises(ValueError) as info:
        ordered_tags(["weights", "kv"], RELEASE_ORDER)
    assert str(info.value) == ("unknown memory tag(s) ['kv']; expected some of ['weights', "
                               "'kv_cache', 'cuda_graph'] or None (all)"), str(info.value)


def test_serialized_per_rank_takes_a_list_or_tuple_only():
    assert SerializedPerRank(values=(b"a", b"b")).values == [b"a", b"b"]
    for bad in (b"payload", "text", None, {0: b"a"}):
        with pytest.raises(TypeError, match=f"one entry per TP rank\\), got {type(bad).__name__}"):
            SerializedPerRank(values=bad)


def test_checksum_is_order_free_and_tells_every_difference():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(5, dtype=torch.bfloat16)
    base = checksum_named_tensors([("a", a), ("b", b)])
    assert checksum_named_tensors([("b", b), ("a", a)]) == base
    flipped = a.clone()
    flipped.view(torch.int32)[2, 3] ^= 1                 # one bit of one element
    for other in ([("a", flipped), ("b", b)],            # bytes
                  [("A", a), ("b", b)],                  # a name
                  [("a", a.reshape(4, 3)), ("b", b)],    # a shape, same bytes
                  [("a", a.view(torch.int32)), ("b", b)],  # a dtype, same bytes
                  [("a", a), ("b", b), ("c", torch.empty(0))],  # one tensor more, even empty
                  [("a", a)]):
        assert checksum_named_tensors(other) != base, other
    one = [("s", torch.tensor([1.0]))]          # a one-element tensor's value counts too
    assert checksum_named_tensors(one) != checksum_named_tensors([("s", torch.tensor([2.0]))])
    # the values count, not the layout in memory: a transposed view hashes as its copy
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert not t.is_contiguous()
    assert checksum_named_tensors([("t", t)]) == checksum_named_tensors([("t", t.contiguous())])
