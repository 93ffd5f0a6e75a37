"""`SyncTopology.from_mesh` on a mesh whose infer_tp row is not in ascending rank order.

torch numbers a mesh dimension's process group by ascending global rank (``new_group`` sorts the
ranks), and ``get_local_rank()`` is the rank in that group, whatever the order of the mesh's
tensor. Before, ``tp_ranks`` was read in the tensor's order: on ``DeviceMesh("cpu", [[1, 0]])``
rank 0 was infer-TP rank 0 (``is_tp_src``) while ``tp_src`` said rank 1, and the first gather was
refused by torch on both ranks (``gather_list must NOT be specified on non-destination ranks`` /
``must be specified on destination rank``; seen on 2 gloo ranks, torch 2.13). In-process: the
mesh and the process-group calls answer as torch's do on those two ranks."""

from __future__ import annotations

import types

import pytest

from fsdp_sync import topology

GROUP = object()


class _Mesh:
    """A ``("dp", "infer_tp")`` mesh of one dp row ``row``, answering as torch's DeviceMesh does."""

    def __init__(self, row: list[int]):
        self.mesh_dim_names, self.row = ("dp", "infer_tp"), row

    def size(self) -> int:
        return len(self.row)

    def __getitem__(self, name: str):
        if name == "dp":
            return types.SimpleNamespace(get_local_rank=lambda: 0, size=lambda: 1)
        return types.SimpleNamespace(        # the rank in the (sorted) group, not in the row
            get_local_rank=lambda: topology.dist.get_group_rank(GROUP, topology.dist.get_rank()),
            size=lambda: len(self.row), mesh=types.SimpleNamespace(tolist=lambda: list(self.row)),
            get_group=lambda: GROUP)


@pytest.mark.parametrize("row", [[0, 1], [1, 0], [2, 0, 3, 1]])
def test_infer_tp_rank_0_is_tp_src_whatever_the_mesh_order(row, monkeypatch):
    ranks = sorted(row)                                   # torch's group order
    for me in row:
        monkeypatch.setattr(topology.dist, "get_rank", lambda me=me: me)
        monkeypatch.setattr(topology.dist, "get_world_size", lambda: len(row))
        monkeypatch.setattr(topology.dist, "get_process_group_ranks", lambda g: list(ranks))
        monkeypatch.setattr(topology.dist, "get_group_rank", lambda g, r: ranks.index(r))
        topo = topology.SyncTopology.from_mesh(_Mesh(row))
        assert topo.tp_ranks[topo.tp_rank] == me, (row, me, topo)        # this rank is where it says
        assert (topo.tp_src == me) == topo.is_tp_src, (row, me, topo)    # one infer-TP rank 0
        assert topo.tp_ranks == tuple(ranks)
