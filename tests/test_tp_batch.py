"""`tp_batch`: a rollout batch gathered over infer-TP and split back (the manager's
`preprocess_data` / `postprocess_data`).

A batch that cannot be put end to end, or split back, exactly is refused on every rank alike,
naming the field and the ranks. Before: a field that was a tensor on one rank and a list on
another raised on rank 0 (``torch.cat``) and succeeded on rank 1 (list concatenation, rank 0's
tensor iterated into it), so the ranks went on out of step; a 0-dim field or ragged widths were
torch's own ``len() of a 0-d tensor`` / ``Sizes of tensors must match``; and `keep_own` split a
batch the gathered sizes did not fit evenly instead (6 samples gathered as [3, 1]: 3 and 3).
One 2-rank job checks the gathers; the split is a pure function of the sizes (no group)."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync import tp_batch
from fsdp_sync.cli.launch import run_ranks, spawn_env


def _gathers(rank, world):
    from fsdp_sync.topology import SyncTopology, make_mesh

    topo = SyncTopology.from_mesh(make_mesh(1, 2))
    cases = {
        "ok": {"ids": torch.ones(1 + rank, 3, dtype=torch.long) * rank, "tags": [f"r{rank}"] * (1 + rank)},
        "ragged": {"ids": torch.ones(2, 5 + rank, dtype=torch.long)},
        "zero_dim": {"ids": torch.ones(2, 3), "step": torch.tensor(7)},
        "tensor_vs_list": {"x": torch.ones(2, 3) if rank == 0 else [[1, 1, 1]] * 2},
        "dtype": {"x": torch.ones(2, 3, dtype=torch.float32 if rank == 0 else torch.float64)},
        "scalar_field": {"x": torch.ones(2, 3), "n": 2},
        "not_a_batch": {"x": torch.ones(2)} if rank == 0 else torch.ones(2),
    }
    out = {}
    for label, batch in cases.items():
        try:
            full, sizes = tp_batch.gather(topo, batch)
            out[label] = ("ok", sizes, {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                                        for k, v in full.items()})
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[label] = (type(exc).__name__, str(exc))
    return out


@pytest.mark.timeout(120)
def test_a_batch_that_does_not_fit_is_refused_on_every_rank_alike():
    r0, r1 = run_ranks(_gathers, 2, timeout_s=110, pg_timeout_s=60, env=spawn_env())
    for label in r0:                                 # every outcome the same on both ranks
        assert r0[label][:1] == r1[label][:1], (label, r0[label], r1[label])
        if r0[label][0] != "ok":                     # but the rank that says it
            assert r0[label][1].rsplit(" (rank ", 1)[0] == r1[label][1].rsplit(" (rank ", 1)[0]
        else:
            assert r0[label] == r1[label]
    assert r0["ok"] == ("ok", [1, 2], {"ids": [[0, 0, 0], [1, 1, 1], [1, 1, 1]], "tags": ["r0", "r1", "r1"]})
    expect = {
        "ragged": ("ValueError", ["field 'ids'", "shape past dim 0", "rank 0: (5,)", "rank 1: (6,)"]),
        "zero_dim": ("ValueError", ["field 'step'", "0-dim tensor on infer-TP ranks [0, 1]"]),
        "tensor_vs_list": ("ValueError", ["field 'x'", "rank 0: tensor", "rank 1: list"]),
        "dtype": ("ValueError", ["field 'x'", "dtype", "rank 0: float32", "rank 1: float64"]),
        "scalar_field": ("ValueError", ["field 'n' is neither a tensor nor a list on infer-TP ranks [0, 1] (int, int)"]),
        "not_a_batch": ("TypeError", ["Tensor on infer-TP rank 1"]),
    }
    for label, (kind, words) in expect.items():
        got_kind, msg = r0[label]
        assert got_kind == kind, (label, r0[label])
        for w in words:
            assert w in msg, (label, w, msg)


def _topo(rank: int, size: int = 2):
    return types.SimpleNamespace(tp_size=size, tp_rank=rank, describe=lambda: f"rank {rank}/{size}")


def test_keep_own_splits_by_the_gathered_sizes_or_refuses():
    batch = {"r": torch.arange(6), "tags": list("abcdef")}
    # the gathered sizes, and k samples per gathered prompt
    assert [tp_batch.keep_own(_topo(r), batch, [4, 2])["tags"] for r in (0, 1)] == [list("abcd"), list("ef")]
    assert [tp_batch.keep_own(_topo(r), batch, [2, 1])["r"].tolist() for r in (0, 1)] == [[0, 1, 2, 3], [4, 5]]
    # no gather before it: an even split
    assert tp_batch.keep_own(_topo(1), batch, None)["tags"] == list("def")
    # sizes that fit neither way: refused (was an even split, 3 and 3, on both ranks)
    for sizes in ([3, 1], [0, 0], [4, 3]):
        with pytest.raises(ValueError, match=rf"6 samples are neither the {sum(sizes)} that preprocess_data "
                                             rf"gathered \(per infer-TP rank \[{sizes[0]}, {sizes[1]}\]\)"):
            tp_batch.keep_own(_topo(0), batch, sizes)
    with pytest.raises(ValueError, match=r"fields \['step'\] are 0-dim tensors"):
        tp_batch.keep_own(_topo(0), {"r": torch.arange(6), "step": torch.tensor(1)}, [3, 3])
    with pytest.raises(ValueError, match="differ in size"):
        tp_batch.keep_own(_topo(0), {"r": torch.arange(6), "tags": list("abc")}, [3, 3])
