"""`payloads.bucket_payloads` refuses a bucket whose tensor starts at a byte offset that is not a
multiple of its item size before any payload is made: SGLang views each tensor of a flattened
bucket out of the uint8 buffer (``flattened_tensor[start:end].view(dtype)``), which torch refuses
at such an offset, so the update would fail inside SGLang (after the payloads were sent, with the
bucket's earlier tensors loaded) instead of here. (`weights.bucket.plan_buckets` never plans one;
a hand-made `Bucket` can.)"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines.sglang.payloads import bucket_payloads
from fsdp_sync.weights.bucket import Bucket, BucketEntry

pytestmark = pytest.mark.timeout(30)


def test_a_misaligned_tensor_is_refused_before_any_payload():
    bucket = Bucket(entries=(BucketEntry("a", torch.uint8, (3,), 0, 3),
                             BucketEntry("b", torch.float32, (2,), 3, 11)), nbytes=11)
    flat = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"tensors \['b'\] start at a byte offset"):
        bucket_payloads(flat, bucket, 1)
    # what SGLang's view of it would do: torch refuses the offset
    with pytest.raises(RuntimeError):
        flat[3:11].view(torch.float32)
    ok = Bucket(entries=(BucketEntry("a", torch.uint8, (3,), 0, 3),
                         BucketEntry("b", torch.float32, (2,), 4, 12)), nbytes=12)
    payloads = bucket_payloads(flat, ok, 1)
    assert len(payloads) == 1 and payloads.names == ["a", "b"]
    payloads.release(unopened=True)            # nobody opened it: its reference given back


def test_a_buffer_shorter_than_its_bucket_is_refused():
    """A ``flat`` shorter than the bucket's ``nbytes``: SGLang would slice the last tensor short
    and fail reshaping it, after the earlier ones loaded; refused here first."""
    bucket = Bucket(entries=(BucketEntry("a", torch.float32, (2,), 0, 8),
                             BucketEntry("b", torch.float32, (4,), 8, 24)), nbytes=24)
    with pytest.raises(ValueError, match="at least 24 bytes"):
        bucket_payloads(torch.zeros(16, dtype=torch.uint8), bucket, 1)
    with pytest.raises(RuntimeError):             # SGLang's view of the short last tensor
        torch.zeros(16, dtype=torch.uint8)[8:24].view(torch.float32).reshape(4)


def test_tensors_on_two_devices_are_refused_by_name():
    from fsdp_sync.engines.sglang.payloads import flattened_bucket_payloads

    with pytest.raises(ValueError, match=r"one device, got \['cpu', 'meta'\]"):
        flattened_bucket_payloads([("a", torch.ones(2)), ("b", torch.empty(2, device="meta"))], 1)
