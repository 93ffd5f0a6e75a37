"""A bucket buffer that one trainer rank cannot allocate is raised on every rank, at once.

`export.iter_buckets` allocates each bucket's buffer (shared memory by default) right before the
bucket's gather. Where the allocation failed on one rank only (its /dev/shm full, a MemoryError,
an allocator returning the wrong thing), that rank raised its own error while its peers entered
the gather and waited out the process group's timeout, ending with gloo's "Connection closed by
peer": a hang, then an unrelated error. The allocation's success is now agreed over the export's
group first: every rank raises the same `SyncError` naming the failing rank, the bucket and its
size, promptly, and no rank keeps a shared-memory segment of the failed bucket. Likewise a rank
that cannot open the host-shared buffer (``share_host_memory``) no longer leaves group rank 0
waiting in a barrier: every rank gathers instead.
"""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import RankError, run_ranks, spawn_env


def _job(rank: int, world: int) -> dict:
    import gc
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import export, handles

    mesh = init_device_mesh("cpu", (world,))
    m = nn.Module()
    # two Shard(0) parameters of 64 x 64 float32 (16 KiB each): two buckets of 16 KiB
    for name in ("a", "b"):
        local = torch.full((64 // world, 64), float(rank + 1))
        setattr(m, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                         shape=(64, 64), stride=(64, 1))))
    from _util import own_segments as segments, own_segments_left as left

    def failing(kind: str, at: int):
        calls = [0]

        def alloc(n: int):
            calls[0] += 1
            if rank == 1 and calls[0] == at:
                if kind == "memory":
                    raise MemoryError(f"cannot allocate {n} bytes")
                return torch.empty(n, dtype=torch.float32)      # not a uint8 buffer
            return handles.empty_shared(n)
        return alloc

    out = {}
    for case, kind, at in (("memory-first", "memory", 1), ("wrong-second", "wrong", 2)):
        gc.collect()
        before = segments()
        t0 = time.monotonic()
        got, held = [], None
        try:
            for _, flat in export.iter_buckets(m, 16 << 10, alloc=failing(kind, at)):
                got.append(flat.clone())            # the caller's copy: the buffer itself goes
                del flat
            msg = None
        except SyncError as exc:
            msg, held = str(exc), exc     # kept, as a caller reporting it does: its traceback too
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
            msg = f"unexpected {type(exc).__name__}: {exc}"
        seconds = time.monotonic() - t0
        gc.collect()
        out[case] = {"msg": msg, "seconds": seconds, "buckets": len(got),
                     "left": left(before)}
        del held
        dist.barrier()

    # share_host_memory: rank 1 cannot open rank 0's host-shared buffer (its shm manager out of
    # reach): both ranks gather instead, at once, rather than rank 0 waiting for it in a barrier
    import logging

    warned: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("fsdp_sync").addHandler(handler)
    opener = handles.open_payload

    def cannot_open(*args, **kwargs):
        raise RuntimeError("cannot reach the shm manager")

    if rank == 1:
        handles.open_payload = cannot_open
    gc.collect()
    before = segments()
    t0 = time.monotonic()
    try:
        sums = [flat.view(torch.float32).view(64, 64).sum(dim=1).tolist()
                for _, flat in export.iter_buckets(m, 16 << 10, share_host_memory=True)]
        msg = None
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
        sums, msg = [], f"unexpected {type(exc).__name__}: {exc}"
    finally:
        handles.open_payload = opener
    seconds = time.monotonic() - t0
    gc.collect()
    out["host-open"] = {"msg": msg, "seconds": seconds, "sums": sums, "left": left(before),
                        "warned": [w for w in warned if "host-shared" in w]}
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_a_bucket_allocation_failing_on_one_rank_is_raised_on_every_rank_at_once():
    # pg timeout 30 s: before the fix rank 0 waited in the gather that long, then gloo's error;
    # an agreed failure takes well under half of it even on a loaded machine (about 0.1 s idle)
    try:
        res = run_ranks(_job, 2, env=spawn_env(), timeout_s=45, pg_timeout_s=30)
    except RankError as exc:
        pytest.fail(f"a rank failed: {exc}")
    for r, out in enumerate(res):
        row = out.pop("host-open")
        assert row["msg"] is None, (r, row)
        # gathered: every row of each parameter, rank 0's 1.0s then rank 1's 2.0s (64 columns)
        assert row["sums"] == [[64.0] * 32 + [128.0] * 32] * 2, (r, row)
        assert row["seconds"] < 15 and row["left"] == 0, (r, row)
        assert len(row["warned"]) == 1 and "group ranks [1] could not open" in row["warned"][0] \
            and "cannot reach the shm manager" in row["warned"][0], (r, row)
        for case, row in out.items():
            msg = row["msg"]
            assert msg is not None and not msg.startswith("unexpected"), (r, case, row)
            assert "export failed on group rank 1" in msg, (r, case, msg)
            assert "on rank 1" in msg and "16384-byte buffer" in msg, (r, case, msg)
            if case == "memory-first":
                assert "bucket 0 ('a'...)" in msg and "MemoryError: cannot allocate 16384 bytes" in msg, msg
                assert row["buckets"] == 0, (r, row)
            else:
                assert "bucket 1 ('b'...)" in msg and "must return a 1-D uint8 tensor" in msg, msg
                assert row["buckets"] == 1, (r, row)     # the first bucket went through
            assert row["seconds"] < 15, (r, case, row)  # agreed, not a gather's timeout
            assert row["left"] == 0, (r, case, row)    # no segment of the failed bucket kept,
            #                                            even while the error is kept
