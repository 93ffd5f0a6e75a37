"""A cast the export rule forbids (an integer parameter asked to become the rollout dtype) is
refused before the stream yields anything, not after the tensors before it were sent (H60's
mutation pass: dropping `export.resolve`'s up-front check survived every export test, because
the same error came anyway, later: after the float tensors ahead of it had been yielded, and on a
sharded module outside the refusal every rank agrees on). In process, a plain module.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fsdp_sync.weights import export


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.count = nn.Module()          # a child registered after proj: exported after it
        self.count.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


@pytest.mark.parametrize("stream", ["iter_params", "iter_buckets"])
def test_a_forbidden_cast_is_refused_before_the_first_item(stream):
    model = _Model()
    if stream == "iter_params":
        it = export.iter_params(model, dtype=torch.bfloat16)
    else:
        it = export.iter_buckets(model, 64, dtype=torch.bfloat16, alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    with pytest.raises(TypeError, match=re.escape("cannot cast parameter 'count.steps' of dtype int64 to bfloat16")):
        next(it)
    # without a cast nothing is refused: every tensor as it is held
    assert [n for n, _ in export.iter_params(model)] == ["proj.weight", "proj.bias", "count.steps"]
