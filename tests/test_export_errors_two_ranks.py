"""A rank-local export error at TWO ranks is raised on both, naming the tensor and the rank that
failed (not only at four ranks, `test_export.test_a_rank_local_error_is_raised_on_every_rank`):
the errors are agreed over the group whenever it has more than one rank, so the healthy rank does
not block in the next collective or carry on with a stream its peer abandoned. Both
`export.iter_buckets` and `export.iter_params`."""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import export

    # a Shard(0) parameter of 4 rows whose local shard on rank 1 has 1 row, not 2
    mesh = init_device_mesh("cpu", (world,))
    m = nn.Module()
    m.bad = nn.Parameter(DTensor.from_local(torch.zeros(1 if rank == 1 else 2, 4), mesh, [Shard(0)],
                                            run_check=False, shape=(4, 4), stride=(4, 1)))
    out = {}
    for mode in ("buckets", "params"):
        try:
            list(export.iter_buckets(m, 1 << 20) if mode == "buckets" else export.iter_params(m))
            out[mode] = None
        except SyncError as exc:
            out[mode] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            out[mode] = f"unexpected {type(exc).__name__}: {exc}"
    dist.barrier()
    return out


@pytest.mark.timeout(150)
def test_a_rank_local_export_error_at_two_ranks_reaches_both_ranks():
    res = run_ranks(_job, 2, env=spawn_env(), timeout_s=120, pg_timeout_s=30)
    for r, out in enumerate(res):
        for mode, msg in out.items():
            assert msg is not None and not msg.startswith("unexpected"), (r, mode, msg)
            assert "'bad' (rank 1)" in msg, (r, mode, msg)
