"""`handles.make_payloads` of an empty view of a caller's tensor (``w[5:5]``, a zero-size
parameter viewing a flat parameter): it travels as an empty tensor of its own. Shared as it was,
it moved the whole storage it views into shared memory (the caller's tensor, behind its back) and
handed every byte of that storage to the consumer."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.weights import handles

pytestmark = pytest.mark.timeout(60)


def test_an_empty_view_is_sent_empty_and_leaves_its_storage_alone():
    w = torch.arange(1000, dtype=torch.float32)
    flat = torch.nn.Parameter(torch.ones(4, 3))
    ps = handles.make_payloads({"a": w[5:5], "b": flat[:, 1:1], "c": w[:3]}, 1)
    try:
        # before: both storages were moved into /dev/shm by the pickling
        assert (w.untyped_storage().is_shared(), flat.untyped_storage().is_shared()) == (False, False)
        rec = handles.open_payload(ps.payloads[0], 0)
        got = rec.value
        assert got["a"].shape == (0,) and got["b"].shape == (4, 0) and got["b"].dtype == torch.float32
        assert got["a"].untyped_storage().nbytes() <= 1 and got["b"].untyped_storage().nbytes() <= 1
        assert got["c"].tolist() == [0.0, 1.0, 2.0]
        del got
        rec.ack()
    finally:
        ps.release()
