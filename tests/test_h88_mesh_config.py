"""The user's own setup meeting fsdp_sync's entry points (audit H88), in-process and cheap:

- `make_mesh` with sizes that are no positive ints (``world / tp`` is a float; ``-1``; a size
  read from the environment as text) is refused naming the argument and what to write; before,
  torch said ``sizes (1.0,) and strides (1,) don't match`` or ``only one dimension can be
  inferred``, or (text) ``dp (1) × infer_tp (1) must equal the world size (1)``. A world that is
  no multiple of the engine's TP says so.
- ``SyncConfig.dist_timeout_s`` under 1 s is refused: trainer rank 0's own connection to the
  update group's store takes milliseconds, and a shorter wait (1e-6 s) failed the first sync with
  "cannot host its store on dist_master_port=None ...; is another program on it?", blaming a port
  the user never set.
"""

from __future__ import annotations

import numpy as np
import pytest

from fsdp_sync.config import SyncConfig
from fsdp_sync.topology import make_mesh


@pytest.mark.parametrize("dp, tp, bad", [(1.0, 1, "dp"), (1, 1.0, "infer_tp"), (-1, -1, "dp"),
                                         ("1", 1, "dp"), (True, 1, "dp"), (0, 1, "dp")])
def test_make_mesh_refuses_sizes_that_are_no_positive_int_naming_them(one_rank, dp, tp, bad):
    with pytest.raises(ValueError) as info:
        make_mesh(dp, tp)
    msg = str(info.value)
    assert msg.startswith(f"make_mesh: {bad} must be an int >= 1, got {(dp if bad == 'dp' else tp)!r}"), msg
    assert "world // tp" in msg, msg


def test_make_mesh_says_when_the_world_is_no_multiple_of_infer_tp(one_rank):
    with pytest.raises(ValueError, match="the world size 1 is not a multiple of infer_tp 2"):
        make_mesh(1, 2)
    with pytest.raises(ValueError, match=r"use dp=1 \(world // infer_tp\)"):
        make_mesh(2, 1)
    mesh = make_mesh(np.int64(1), 1)        # numpy's ints are ints
    assert mesh.size() == 1 and mesh.mesh_dim_names == ("dp", "infer_tp")


@pytest.mark.parametrize("value", [1e-6, 0.01, 0.999])
def test_a_dist_timeout_s_under_a_second_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=rf"dist_timeout_s must be at least 1 second .*got {value!r}"):
        SyncConfig(dist_timeout_s=value)
    with pytest.raises(ValueError, match="dist_timeout_s must be at least 1 second"):
        SyncConfig.from_dict({"method": "distributed", "dist_timeout_s": value})
    assert SyncConfig(dist_timeout_s=1).dist_timeout_s == 1


def test_a_trainers_own_mesh_passed_as_the_managers_is_refused_saying_what_to_make(one_rank):
    """A tensor-parallel trainer's ("dp", "tp") mesh (or HSDP's) given to the manager: before, only
    "expected a mesh with dims ('dp', 'infer_tp'), got ('dp', 'tp')", no word of make_mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_sync.topology import SyncTopology

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError) as info:
        SyncTopology.from_mesh(mesh)
    msg = str(info.value)
    assert "got ('dp', 'tp') (shape (1, 1))" in msg and "make_mesh(dp=world // infer_tp" in msg, msg
