"""Host-shared buckets (`export.iter_buckets(share_host_memory=True)`): the ranks of one host write
their shards into one shared buffer instead of all-gathering. The bytes must be identical to the
all-gather path's, no all-gather may run, and the buffer must be one segment that all ranks map."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _digests(rank, world, dtype_name, bucket_bytes):
    import torch.distributed as dist

    from fsdp_sync.weights import export, gather
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=3), 2)
    out = {}
    for share in (False, True):
        gathers = 0
        real = gather.all_gather

        def counting(*a, **k):
            nonlocal gathers
            gathers += 1
            return real(*a, **k)

        gather.all_gather = counting
        try:
            digests, ptrs = [], set()
            for bkt, flat in export.iter_buckets(module, bucket_bytes, dtype=dtype, share_host_memory=share):
                digests.append((bkt.names, hashlib.sha256(flat.numpy().tobytes()).hexdigest()))
                ptrs.add(flat.untyped_storage().data_ptr())
                del flat
        finally:
            gather.all_gather = real
        out[share] = {"digests": digests, "gathers": gathers, "buffers": len(ptrs)}
    # the reference: the unsharded model's tensors, cast and laid out by the same plan
    ref = build_model(load_config("tiny"), seed=3)
    dist.barrier()
    from fsdp_sync.weights import bucket

    metas = export.param_metas(module, dtype)
    sd = {k: (v if dtype is None else v.to(dtype)) for k, v in ref.state_dict().items()}
    out["reference"] = [(b.names, hashlib.sha256(bucket.flatten(b, sd).numpy().tobytes()).hexdigest())
                        for b in bucket.plan_buckets(metas, bucket_bytes)]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,dtype", [(2, None), (4, "bfloat16")])
def test_host_shared_buckets_match_the_gather_bit_for_bit(world, dtype):
    results = run_ranks(_digests, world, dtype, 64 << 10, timeout_s=110, env=spawn_env())
    for r in results:
        assert len(r["reference"]) > 3                        # several buckets
        assert r[False]["digests"] == r["reference"]          # the gather path is exact
        assert r[True]["digests"] == r["reference"]           # and so is the shared path
        assert r[False]["gathers"] == len(r["reference"])     # one gather per bucket ...
        assert r[True]["gathers"] == 0                        # ... and none when sharing
        assert r[True]["buffers"] == 1                        # one buffer, reused by every bucket


def _no_shm_on_rank0(rank, world, bucket_bytes):
    """share_host_memory=True when group rank 0 cannot make shared memory: every rank must take the
    gather path (the one host-shared buffer, `hostbuf.HostShared`, says so to all ranks)."""
    import torch.distributed as dist

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import bucket, export, gather, handles

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=3), 2)
    real_empty, real_gather = handles.empty_shared, gather.all_gather
    gathers = 0

    def no_shm(n):
        raise RuntimeError("torch_shm_manager cannot start (test)")

    def counting(*a, **k):
        nonlocal gathers
        gathers += 1
        return real_gather(*a, **k)

    if rank == 0:
        handles.empty_shared = no_shm     # iter_buckets' own alloc is bound at definition
    gather.all_gather = counting
    try:
        digests = [(b.names, hashlib.sha256(flat.numpy().tobytes()).hexdigest())
                   for b, flat in export.iter_buckets(module, bucket_bytes, share_host_memory=True)]
    finally:
        handles.empty_shared, gather.all_gather = real_empty, real_gather
    ref = build_model(load_config("tiny"), seed=3)
    dist.barrier()
    sd = ref.state_dict()
    want = [(b.names, hashlib.sha256(bucket.flatten(b, sd).numpy().tobytes()).hexdigest())
            for b in bucket.plan_buckets(export.param_metas(module), bucket_bytes)]
    return {"digests": digests, "want": want, "gathers": gathers}


@pytest.mark.timeout(90)
def test_host_shared_falls_back_to_the_gather_when_rank0_has_no_shared_memory():
    results = run_ranks(_no_shm_on_rank0, 2, 64 << 10, timeout_s=80, pg_timeout_s=20, env=spawn_env())
    for r in results:
        assert len(r["want"]) > 3
        assert r["digests"] == r["want"]                      # bit-exact through the gather
        assert r["gathers"] == len(r["want"])                 # one gather per bucket: it fell back
