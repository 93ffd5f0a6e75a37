"""`generation.pick`'s top-p against SGLang's sampler (in process, no engine).

SGLang measures top-p on the distribution before top-k (``top_k_top_p_min_p_sampling_from_probs_torch``:
``probs_sum`` is the cumulative sum of the unfiltered sorted probabilities, and a token is dropped
where the mass ranked above it ``> top_p``; flashinfer's ``filter_apply_order="joint"`` keeps the
same support). Before, `pick` measured it on the top-k survivors renormalized and dropped a token
whose mass above was ``>= top_p``: with probabilities 0.4, 0.3, 0.2, 0.1, ``top_k=2, top_p=0.5``
drew only the first token where SGLang draws either of the first two, and two tokens of 0.5 each
with ``top_p=0.5`` drew only one.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_sync.engines.reference.generation import Sampling, pick

pytestmark = pytest.mark.timeout(60)


def drawn(probs: list[float], **kw) -> set[int]:
    logits = torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])
    out = set()
    for seed in range(64):
        tokens, _ = pick(logits, [Sampling(temperature=1.0, seed=seed, **kw)], [0], None, False)
        out.add(tokens[0])
    return out


def test_top_p_counts_the_mass_before_top_k_as_sglang():
    assert drawn([0.4, 0.3, 0.2, 0.1], top_k=2, top_p=0.5) == {0, 1}
    assert drawn([0.4, 0.3, 0.2, 0.1], top_p=0.5) == {0, 1}
    assert drawn([0.4, 0.3, 0.2, 0.1], top_p=0.35) == {0}
    assert drawn([0.4, 0.3, 0.2, 0.1], top_k=3, top_p=0.75) == {0, 1, 2}


def test_top_p_keeps_a_token_whose_mass_above_is_exactly_top_p():
    assert drawn([0.5, 0.5, 0.0, 0.0], top_p=0.5) == {0, 1}


def test_min_p_is_relative_to_the_most_likely_token():
    assert drawn([0.4, 0.3, 0.2, 0.1], min_p=0.7) == {0, 1}
    assert drawn([0.4, 0.3, 0.2, 0.1], top_k=2, min_p=0.8) == {0}
