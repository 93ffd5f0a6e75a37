"""`tp_batch` on the edges its two-rank test does not reach: batches whose keys differ between the
infer-TP ranks, a batch no `gather` preceded that does not split evenly, and a DataProto-like
batch whose ranks gave different sizes.

`gather` is run in one process with the group's all-gather stood in for (each rank's batch as the
collective would hand it back); `keep_own` needs no collective. What is checked: a field one rank
has and another lacks is refused naming both key sets (not dropped from the gathered batch, not a
KeyError); an uneven batch with no gathered sizes is refused (not split so that a sample is lost);
a DataProto of uneven gathered sizes is split by those sizes (not in equal chunks, which would hand
a rank another rank's samples).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from fsdp_sync import tp_batch


def _topo(rank: int, size: int = 2):
    return types.SimpleNamespace(tp_size=size, tp_rank=rank, tp_group=None,
                                 describe=lambda: f"rank {rank}/{size} (infer_tp {rank}/{size})")


def _gather_as(monkeypatch, batches: list, rank: int = 0):
    """`tp_batch.gather` on ``rank`` where the infer-TP ranks hold ``batches``."""
    def all_gather_object(out, obj, group=None):
        out[:] = [obj if r == rank else b for r, b in enumerate(batches)]

    monkeypatch.setattr(tp_batch, "cpu_group", lambda group: group)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return tp_batch.gather(_topo(rank, len(batches)), batches[rank])


def test_gather_joins_matching_batches_in_rank_order(monkeypatch):
    a = {"ids": torch.tensor([[1, 2]]), "tags": ["a"]}
    b = {"ids": torch.tensor([[3, 4], [5, 6]]), "tags": ["b", "c"]}
    full, sizes = _gather_as(monkeypatch, [a, b], rank=1)
    assert sizes == [1, 2]
    assert full["ids"].tolist() == [[1, 2], [3, 4], [5, 6]] and full["tags"] == ["a", "b", "c"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_field_only_one_rank_has_is_refused_not_dropped(monkeypatch, rank):
    a = {"ids": torch.ones(2, 3, dtype=torch.long)}
    b = {"ids": torch.ones(1, 3, dtype=torch.long), "mask": torch.ones(1, 3, dtype=torch.bool)}
    with pytest.raises(ValueError) as info:
        _gather_as(monkeypatch, [a, b], rank=rank)
    assert ("preprocess_data: the infer-TP ranks' batches have different keys: rank 0 has ['ids'], "
            "rank 1 differs in ['mask']") in str(info.value)


def test_fields_of_other_names_on_each_rank_are_refused_naming_them(monkeypatch):
    a = {"ids": torch.ones(2, 3), "tags": ["x", "y"]}
    b = {"ids": torch.ones(2, 3), "labels": ["x", "y"]}
    with pytest.raises(ValueError, match=r"rank 0 has \['ids', 'tags'\], rank 1 differs in \['labels', 'tags'\]"):
        _gather_as(monkeypatch, [a, b])


def test_an_uneven_batch_with_no_gathered_sizes_is_refused_not_cut_short():
    batch = {"r": torch.arange(5), "tags": list("abcde")}
    for rank in (0, 1):
        with pytest.raises(ValueError, match="postprocess_data: 5 samples do not split into 2 infer-TP parts"):
            tp_batch.keep_own(_topo(rank), batch, None)
    assert [tp_batch.keep_own(_topo(r, 3), {"r": torch.arange(6)}, None)["r"].tolist()
            for r in range(3)] == [[0, 1], [2, 3], [4, 5]]


class _Proto:
    """What `keep_own` uses of a verl DataProto: ``len``, ``chunk`` (equal parts only), ``slice``."""

    def __init__(self, rows: list) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def chunk(self, n: int) -> list:
        assert len(self.rows) % n == 0, "DataProto.chunk needs equal parts"
        k = len(self.rows) // n
        return [_Proto(self.rows[i * k:(i + 1) * k]) for i in range(n)]

    def slice(self, start: int, end: int) -> "_Proto":
        return _Proto(self.rows[start:end])

    @classmethod
    def concat(cls, parts: list) -> "_Proto":
        return cls([x for p in parts for x in p.rows])


def test_a_data_proto_of_uneven_gathered_sizes_is_split_by_them():
    batch = _Proto(["a0", "a1", "a2", "a3", "b0", "b1"])
    assert [tp_batch.keep_own(_topo(r), batch, [4, 2]).rows for r in (0, 1)] == \
        [["a0", "a1", "a2", "a3"], ["b0", "b1"]]
    # k = 2 samples per gathered prompt: sizes [1, 2] become [2, 4]
    assert [tp_batch.keep_own(_topo(r), batch, [1, 2]).rows for r in (0, 1)] == \
        [["a0", "a1"], ["a2", "a3", "b0", "b1"]]
    # equal sizes: DataProto's own chunk
    assert [tp_batch.keep_own(_topo(r), batch, [3, 3]).rows for r in (0, 1)] == \
        [["a0", "a1", "a2"], ["a3", "b0", "b1"]]
