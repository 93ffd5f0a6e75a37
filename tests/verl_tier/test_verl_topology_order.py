"""The verl adapter's topology on an ``infer_tp`` mesh row that is not in ascending rank order.

`SGLangAdapter._topology` builds its `SyncTopology` itself (verl hands it the device mesh). torch
numbers a mesh dimension's process group by ascending global rank, and ``get_local_rank()`` is the
rank in that group whatever the order of the mesh's tensor; ``tp_ranks`` read in the tensor's order
made infer-TP rank 0 and ``tp_src`` two ranks on a row ``[1, 0]`` (the gather to it refused by torch
on both ranks; `tests/test_h20_topology.py` shows it for `SyncTopology.from_mesh`). verl's own
meshes come from ``init_device_mesh`` and are ascending; a user's mesh need not be. In-process: the
mesh and the process-group calls answer as torch's do on each rank."""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

GROUP = object()


def _mesh(row: list[int], dist):
    tp = types.SimpleNamespace(
        get_local_rank=lambda: dist.get_group_rank(GROUP, dist.get_rank()),
        size=lambda: len(row), mesh=types.SimpleNamespace(tolist=lambda: list(row)),
        get_group=lambda: GROUP)
    dp = types.SimpleNamespace(get_local_rank=lambda: 0, size=lambda: 1)
    return {"dp": dp, "infer_tp": tp}


@pytest.mark.parametrize("row", [[0, 1], [1, 0], [2, 0, 3, 1]])
def test_the_adapters_infer_tp_rank_0_is_its_tp_src_whatever_the_mesh_order(row, monkeypatch):
    from fsdp_sync import topology
    from fsdp_sync.integrations import verl as plugin
    from fsdp_sync.integrations.verl import adapter as adapter_mod

    ranks = sorted(row)                                   # torch's group order
    for me in row:
        for d in {topology.dist, adapter_mod.dist}:
            monkeypatch.setattr(d, "get_rank", lambda me=me: me)
            monkeypatch.setattr(d, "get_world_size", lambda: len(row))
            monkeypatch.setattr(d, "get_process_group_ranks", lambda g: list(ranks))
            monkeypatch.setattr(d, "get_group_rank", lambda g, r: ranks.index(r))
        a = object.__new__(plugin.SGLangAdapter)     # its __new__ reads a verl config
        mesh = _mesh(row, adapter_mod.dist)
        a.device_mesh, a._topo = mesh, None
        monkeypatch.setattr(a, "_mesh", lambda mesh=mesh: mesh["infer_tp"], raising=False)
        topo = a._topology()
        assert topo.tp_ranks[topo.tp_rank] == me, (row, me, topo)        # this rank is where it says
        assert (topo.tp_src == me) == topo.is_tp_src, (row, me, topo)    # one infer-TP rank 0
        assert topo.tp_ranks == tuple(ranks)
