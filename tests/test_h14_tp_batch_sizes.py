"""`tp_batch.gather` in one process, the group's all-gather stood in for (H14 mutation pass): a
rank's batch whose fields hold different numbers of samples is refused, naming the rank and each
field's size, on every rank alike (the check runs on the gathered batches). With the check gone
the gathered batch's fields were put end to end at different lengths and the rank's size read
off its first field."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync import tp_batch

pytestmark = pytest.mark.timeout(30)


def test_a_rank_whose_fields_differ_in_size_is_refused_by_name(monkeypatch):
    theirs = {"ids": torch.zeros(3, 2, dtype=torch.long), "tags": ["a", "b", "c"]}

    def all_gather_object(parts, mine, group=None):
        parts[:] = [mine, theirs]

    monkeypatch.setattr(tp_batch.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(tp_batch, "cpu_group", lambda g: g)
    topo = types.SimpleNamespace(tp_size=2, tp_rank=0, tp_group=None, describe=lambda: "rank 0/2")
    ok = {"ids": torch.ones(2, 2, dtype=torch.long), "tags": ["x", "y"]}
    whole, sizes = tp_batch.gather(topo, ok)
    assert sizes == [2, 3] and whole["tags"] == ["x", "y", "a", "b", "c"] and whole["ids"].shape == (5, 2)
    bad = {"ids": torch.ones(2, 2, dtype=torch.long), "tags": ["x", "y", "z"]}
    with pytest.raises(ValueError, match=r"infer-TP rank 0's batch fields differ in size \{'ids': 2, 'tags': 3\}"):
        tp_batch.gather(topo, bad)
