"""A per-rank disk update is read straight into the weights: no staged copy of the shard.

Each reference-engine worker hashes its files through one small buffer (`weights.verified_file`),
and only once every worker's files check out does the commit read them into the weights, from the
descriptors it hashed them through. Checked here: a worker's peak memory during the update stays far
below its shard (it used to stage the whole shard); the weights are the trainer's bit for bit; a
corrupt file still changes nothing; a file rewritten after its check is refused before any weight
changes, a removed one is still read as it was hashed; hostile headers are refused; and the sync's
split (`stats.extra`: export, writes, fsync, read+hash, copy) is filled in.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch


def _sync(module, engines, d, step, bucket_bytes=8 << 20, **kw):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    sc = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=bucket_bytes, **kw)
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=engines, step=step,
                      stats=SyncStats())
    DiskTransport(sc).sync(ctx)
    return ctx.stats


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc clear_refs")
def test_per_rank_disk_update_reads_into_the_weights_without_staging_the_shard(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import WeightUpdateError, checksum_named_tensors
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("small")
    module = build_model(cfg, seed=3)
    shard = sum(p.numel() * 4 for p in module.parameters())          # TP 1: the whole model
    assert shard > 30 << 20
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        stats = _sync(module, [engine], str(tmp_path / "v"), 0)        # the warm-up: weights loaded
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-0.5)
        pid = engine.worker_pids[0]
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")                                                 # peak RSS := RSS now
        before = _status_kib(pid, "VmRSS")
        stats = _sync(module, [engine], str(tmp_path / "v"), 1)
        rise = (_status_kib(pid, "VmHWM") - before) << 10
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        # staged, the worker's peak rose by the whole shard (34 MiB); read straight into the
        # weights, by the hashing buffer (4 MiB) and small change
        assert rise < shard // 4, (rise, shard)
        assert stats.extra["layout"] == "engine"
        for k in ("export_s", "file_write_s", "write_wait_s", "fsync_s", "read_hash_s", "copy_s"):
            assert isinstance(stats.extra[k], float) and stats.extra[k] >= 0, (k, stats.extra)
        assert stats.extra["read_hash_s"] + stats.extra["copy_s"] <= stats.extra["load_s"]
        assert stats.extra["write_s"] >= stats.extra["export_s"]

        # a corrupt file: refused, nothing applied, the files it opened are closed again
        served = engine.weights_checksum()
        good = stats.extra["path"]
        bad = str(tmp_path / "bad")
        shutil.copytree(good, bad)
        victim = os.path.join(bad, sorted(f for f in os.listdir(bad) if f.startswith("model-rank-0-"))[-1])
        with open(victim, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(WeightUpdateError, match="checksum mismatch"):
            engine.update_weights_from_disk(bad)
        assert engine.weights_checksum() == served
        fds = os.listdir(f"/proc/{pid}/fd")
        assert not any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(tmp_path))
                       for fd in fds if os.path.exists(f"/proc/{pid}/fd/{fd}"))


def _file(tmp_path, name="f.safetensors"):
    from fsdp_sync.weights import bucket as _bucket
    from fsdp_sync.weights import hf_checkpoint as ckpt

    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    metas = [_bucket.TensorMeta.of(n, t) for n, t in tensors.items()]
    bkt = _bucket.plan_buckets(metas, 1 << 20)[0]
    path = str(tmp_path / name)
    digest, _, _ = ckpt.write_safetensors(path, _bucket.flatten(bkt, tensors), bkt.entries)
    return path, digest, tensors


@pytest.mark.timeout(30)
def test_verified_file_reads_what_it_hashed_and_refuses_a_rewritten_file(tmp_path):
    from fsdp_sync.weights.hf_checkpoint import CheckpointError
    from fsdp_sync.weights.verified_file import VerifiedFile

    path, digest, tensors = _file(tmp_path)
    with VerifiedFile(path, digest, "xxh3_128") as vf:
        assert sorted(vf.tensors) == ["a", "b"] and vf.size == os.path.getsize(path)
        os.remove(path)                           # pruned after the check: the open file is read
        out = torch.empty(3, 5, dtype=torch.bfloat16)
        vf.tensors["b"].read_into(out)
        assert torch.equal(out, tensors["b"])
        strided = torch.zeros(1000, 2)[:, 1]        # not contiguous: through a temporary
        vf.tensors["a"].read_into(strided)
        assert torch.equal(strided, tensors["a"])
        vf.check_unchanged()
    path, digest, tensors = _file(tmp_path, "g.safetensors")
    with VerifiedFile(path, digest, "xxh3_128") as vf:
        with open(path, "r+b") as f:              # rewritten in place after the check
            f.seek(-4, os.SEEK_END)
            f.write(b"\0\0\0\0")
            os.utime(f.fileno(), ns=(0, 1))
        with pytest.raises(CheckpointError, match="changed after it was checked"):
            vf.check_unchanged()
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        VerifiedFile(path, digest, "xxh3_128")
    with pytest.raises(ValueError, match="shape"):
        VerifiedFile(path, None).tensors["b"].read_into(torch.empty(5, 3, dtype=torch.bfloat16))


def _raw(path, header, data=b"", declared=None):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if declared is None else declared) + text + data)


@pytest.mark.timeout(30)
def test_verified_file_refuses_hostile_headers_and_closes(tmp_path):
    from fsdp_sync.weights.hf_checkpoint import CheckpointError
    from fsdp_sync.weights.verified_file import VerifiedFile

    p = str(tmp_path / "h.safetensors")
    cases = {
        "does not fit": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"", 10 ** 9),
        "offsets": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None),
        "dtype": ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None),
        "overlap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None),
        "JSON object": ([1, 2], b"", None),
    }
    for what, (header, data, declared) in cases.items():
        _raw(p, header, data, declared)
        with pytest.raises(CheckpointError, match=what):
            VerifiedFile(p, None)
    with open(p, "wb") as f:
        f.write(b"\1\0")
    with pytest.raises(CheckpointError, match="no safetensors header"):
        VerifiedFile(p, None)
    # a header longer than one read chunk is taken whole
    big = {f"t{i:04d}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(300)}
    _raw(p, big, bytes(range(256)) + bytes(44))
    vf = VerifiedFile(p, None, chunk=64)
    assert len(vf.tensors) == 300 and int(vf.tensors["t0255"].load()[0]) == 255
    vf.close()
    assert vf.fd == -1


def _kept_buffers_job(rank, world, root):
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=1), 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-1)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) if rank == 0 else None
    manager = FSDPShardingManager(module, [engine] if engine is not None else None, config=SyncConfig(
        method="disk", disk_dir=root, dtype=torch.float32, bucket_bytes=24 << 10,
        free_cache_engine=False, layout="engine"))
    out = []
    try:
        for step in range(3):
            train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
            with manager:
                trainer = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
                keep = manager.transport._host_keep
                rec = {"path": manager.stats.extra["reshard_path"],
                       "bufs": [b.data_ptr() for b in keep[0].bufs] if keep else None}
                if engine is not None:
                    rec["exact"] = engine.weights_checksum() == trainer
            out.append(rec)
    finally:
        transport = manager.transport
        manager.close()
        out.append({"kept_after_close": len(transport._host_keep)})
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(180)
def test_one_host_buffers_are_kept_from_sync_to_sync_and_freed_by_close(tmp_path):
    """The per-rank cut's one-host buffers are made once, rewritten by every later sync (fresh
    shared memory faulted in every sync cost more than the cut), and freed when the transport
    closes; every sync's weights are still the trainer's bit for bit."""
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    results = run_ranks(_kept_buffers_job, 2, str(tmp_path), timeout_s=170, env=spawn_env())
    for rank, recs in enumerate(results):
        *syncs, closed = recs
        assert [r["path"] for r in syncs] == ["host-shared"] * 3, recs
        assert syncs[0]["bufs"] and all(r["bufs"] == syncs[0]["bufs"] for r in syncs), recs
        assert closed == {"kept_after_close": 0}, recs
        if rank == 0:
            assert all(r["exact"] for r in syncs), recs
