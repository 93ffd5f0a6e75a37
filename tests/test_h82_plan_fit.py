"""The plan's refusal of a bucket that does not fit suggests one that does, down to a sub-MiB
bucket (``--bucket-mb`` takes fractions), and says what the memory rule needs at its least when
none fits; its figures below one MiB read in KiB, not "0 MiB"."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_sync.plan import MiB, Cluster, PlanError, PlanJob, plan_row

SMALL = Cluster("small-gpu", "cuda", 8, 10 * MiB, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
JOB = PlanJob("tiny", "tensor", "full", 64 * MiB, "float32", None, 2, 2, 2, trainer_resident_bytes=0)


def test_a_sub_mib_bucket_that_fits_is_suggested_not_no_bucket():
    """tiny (largest tensor 128 KiB in float32) on a GPU leaving 1.5 MiB: 2 x 1 MiB + 128 KiB does
    not fit, 2 x 704 KiB + 128 KiB does. Before: "no bucket fits: the largest tensor alone needs
    0 MiB" and no suggestion, though a 0.6875 MiB bucket plans within the memory left."""
    with pytest.raises(PlanError) as info:
        plan_row(JOB, SMALL)
    msg, best = str(info.value), info.value.suggested_bucket_bytes
    assert "no bucket fits" not in msg and "0 MiB" not in msg and "largest tensor 128 KiB" in msg, msg
    assert best == 704 * 1024 and "the largest bucket that fits is 0.6875 MiB (--bucket-mb 0.6875)" in msg, msg
    ok = plan_row(dataclasses.replace(JOB, bucket_bytes=int(0.6875 * MiB)), SMALL)     # the flag's bytes fit
    assert ok["memory_budget_bytes"] <= ok["memory_free_bytes"]
    with pytest.raises(PlanError):                                                     # and are the largest KiB
        plan_row(dataclasses.replace(JOB, bucket_bytes=best + 1024), SMALL)


def test_when_none_fits_the_refusal_says_what_the_rule_needs_at_its_least():
    """Nothing left beside a 90 GiB resident trainer: the refusal says the rule needs 3 x 64 KiB
    (bf16 tiny, buckets no larger than its largest tensor) over 0 KiB left, not that "the largest
    tensor alone needs 0 MiB" (which read as if it fit)."""
    job = PlanJob("tiny", "distributed", "full", MiB, "bfloat16", None, 2, 2, 2, trainer_resident_bytes=90 * 2**30)
    with pytest.raises(PlanError) as info:
        plan_row(job, "h100-node")
    msg = str(info.value)
    assert info.value.suggested_bucket_bytes is None
    assert "no bucket fits: at any bucket up to the largest tensor (64 KiB) it needs 192 KiB, over the 0 KiB left" \
        in msg, msg
