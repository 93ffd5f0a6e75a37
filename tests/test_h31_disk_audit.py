"""Audit H31 of the disk method (`transport.disk`, `disk_writer`, `weights.verified_file`): cases
no other test pinned, each in one process with no engine process (cheap).

- a ``.recycle`` pool an earlier run left (it crashed, or never called close) is taken by the
  next transport's writers, so that transport's `close` removes it as it removes its own: before,
  ``_pool`` was set only where this transport made the pool, and the leftover stayed, one
  version's worth of disk, after close;
- a pool entry of a planned file's name that is no regular file (a symlink, a directory) is
  removed and the file written fresh: before, the sync failed (ELOOP, IsADirectoryError).

And rules that held but that no test pinned (a mutant breaking each passed every disk test):
config.json's dtype under fp8, the cache flush of a replica brought in under in_place, the version
counted as loaded after a commit failed beside a replica that applied the load at once, and three
refusals of `VerifiedFile` (a span not shape x itemsize, a file cut while read or after its check).
"""

from __future__ import annotations

import os

import pytest
import torch

POOL = ".recycle"


def _sync(transport, module, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    ctx = SyncContext(module=module, config=transport.config, topo=None, group=None,
                      engines=[], step=step, stats=SyncStats())
    transport.sync(ctx)
    return ctx.stats


def _module():
    # a plain module (no HF config: no config.json), one small file per bucket
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


@pytest.mark.timeout(60)
def test_close_removes_a_pool_an_earlier_run_left(tmp_path):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport.disk import DiskTransport

    module = _module()
    d = tmp_path / "v"
    (d / POOL).mkdir(parents=True)
    (d / POOL / "model-00001-of-00099.safetensors").write_bytes(b"x" * 4096)   # no name of this plan
    t = DiskTransport(SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32,
                                 bucket_bytes=1 << 10, disk_keep=2))
    try:
        _sync(t, module, 3)
        assert sorted(os.listdir(d)) == [POOL, "step_3"]
    finally:
        t.close()
    assert sorted(os.listdir(d)) == ["step_3"]


def _bucket_of(tensors):
    from types import SimpleNamespace as NS

    entries, parts, off = [], [], 0
    for n, t in tensors.items():
        b = t.contiguous().view(-1).view(torch.uint8)
        entries.append(NS(name=n, dtype=t.dtype, shape=tuple(t.shape), start=off, end=off + b.numel()))
        parts.append(b)
        off += b.numel()
    return NS(entries=entries), torch.cat(parts)


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_pool_entry_that_is_no_regular_file_is_replaced_not_written_through(tmp_path, kind):
    """The pool's entry of a file's name is moved into the new version and overwritten in place
    (`disk_writer.write_shard`). An entry that is a symlink (a user's edit of a published
    version) failed the sync with ELOOP (the in-place open refuses to follow it), a directory with
    IsADirectoryError; now either is removed and the file written fresh, the symlink's target
    untouched, and the file is exactly the bucket."""
    from safetensors.torch import load_file

    from fsdp_sync.transport.disk_writer import write_shard

    tensors = {"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
               "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    bkt, flat = _bucket_of(tensors)
    pool, out = tmp_path / "pool", tmp_path / "out"
    pool.mkdir()
    out.mkdir()
    target = tmp_path / "theirs.bin"
    target.write_bytes(b"keep me" * 100)
    name = "model-00001-of-00001.safetensors"
    if kind == "symlink":
        os.symlink(target, pool / name)
    else:
        (pool / name).mkdir()
        (pool / name / "x").write_bytes(b"x")
    rec = write_shard(str(out), name, bkt, flat, pool=str(pool))
    assert rec["file"] == name and os.path.isfile(out / name) and not os.path.islink(out / name)
    got = load_file(str(out / name))
    assert sorted(got) == sorted(tensors)
    for n, t in tensors.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    assert target.read_bytes() == b"keep me" * 100
    assert not os.path.lexists(pool / name)


def test_the_rollout_dtype_is_never_an_fp8_weights_or_its_scales():
    """config.json's dtype (`disk_writer.float_dtype`) under quantization='fp8': the files hold
    fp8 weights and float32 ``*_scale_inv`` beside the rollout dtype's tensors; the first of
    those, never a scale's float32 nor fp8, whatever comes first (a model whose first tensor is a
    quantized linear)."""
    from types import SimpleNamespace as NS

    from fsdp_sync.transport.disk_writer import float_dtype

    metas = [NS(name="proj.weight", dtype=torch.float8_e4m3fn),
             NS(name="proj.weight_scale_inv", dtype=torch.float32),
             NS(name="steps", dtype=torch.int64),
             NS(name="norm.weight", dtype=torch.bfloat16),
             NS(name="head.weight", dtype=torch.float32)]
    assert float_dtype(metas) == torch.bfloat16
    assert float_dtype(metas[:3]) is None


class _AtOnce:
    """An engine that applies a disk load at once (SGLang's way: no session), recording its calls."""

    def __init__(self):
        self.calls = []

    def update_weights_from_disk(self, path, weight_version=None, load_format=None, flush_cache=True):
        self.calls.append((os.path.basename(path), weight_version, load_format, flush_cache))


class _StagesCommitFails:
    """An engine that stages the load in a session and then refuses the commit."""

    def __init__(self):
        self.calls = []

    def begin_weight_update(self):
        self.calls.append("begin")

    def update_weights_from_disk(self, path, weight_version=None, load_format=None, flush_cache=True):
        self.calls.append("load")

    def end_weight_update(self, abort=False, weight_version=None):
        self.calls.append("abort" if abort else "commit")
        if not abort:
            raise RuntimeError("commit refused (injected)")


def test_a_replica_brought_in_flushes_its_cache_even_under_in_place(tmp_path):
    """``pause_mode='in_place'``: a sync's load keeps the held requests' cache (flush_cache=False);
    a replica brought in (``reload``: recover, add_engine) was out of service, its cache computed
    by weights it no longer holds, so its load flushes it (`disk_load.load_version`)."""
    from types import SimpleNamespace as NS

    from fsdp_sync.transport.disk_load import HF_FORMAT, load_version

    d = tmp_path / "step_4"
    d.mkdir()
    for reload, flush in ((False, False), (True, True)):
        e = _AtOnce()
        ctx = NS(engines=[e], version="v4", reload=reload, config=NS(pause_mode="in_place"))
        out = load_version(ctx, str(d))
        assert out.err is None and out.calls == 1
        assert e.calls == [("step_4", "v4", HF_FORMAT, flush)], (reload, e.calls)


def test_a_failed_commit_beside_a_replica_that_applied_it_counts_as_loaded(tmp_path):
    """A fleet of a staging engine and one that applies a disk load at once (SGLang): the commit
    fails on the staging one, none committed, but the other serves the new version, so it is the
    version a replica brought in next must load (``DiskTransport.loaded``), not the one before."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport.disk import DiskTransport

    module = _module()
    d = tmp_path / "v"
    t = DiskTransport(SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32,
                                 bucket_bytes=1 << 10, disk_keep=2))
    try:
        ok = _AtOnce()
        _sync_with(t, module, [ok], 1)
        assert t.loaded == str(d / "step_1")
        staged, at_once = _StagesCommitFails(), _AtOnce()
        with pytest.raises(SyncError, match="commit refused"):
            _sync_with(t, module, [staged, at_once], 2)
        assert staged.calls == ["begin", "load", "commit"] and len(at_once.calls) == 1
        assert t.loaded == str(d / "step_2")
    finally:
        t.close()


def _sync_with(transport, module, engines, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    ctx = SyncContext(module=module, config=transport.config, topo=None, group=None,
                      engines=engines, step=step, stats=SyncStats(), version=f"v{step}")
    transport.sync(ctx)


def _raw(path, header, data):
    import json
    import struct

    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize("shape", [[3], [1]], ids=["fewer bytes than the shape", "more bytes"])
def test_a_verified_file_refuses_offsets_whose_size_is_not_the_shapes(tmp_path, shape):
    """`VerifiedFile`: a tensor whose data span fits the file, overlaps nothing, but is not
    shape x itemsize bytes is refused naming it: read_into reads the shape's bytes from the span's
    start, so it took the next tensor's bytes (fewer) or left some unread (more)."""
    from fsdp_sync.weights.hf_checkpoint import CheckpointError
    from fsdp_sync.weights.verified_file import VerifiedFile

    p = str(tmp_path / "x.safetensors")
    _raw(p, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12)
    with pytest.raises(CheckpointError, match=r"tensor 'a': dtype F32, shape \[" + str(shape[0])):
        VerifiedFile(p, None)


@pytest.mark.parametrize("expected", [False, True], ids=["unhashed", "hashed"])
def test_a_file_cut_while_it_is_read_is_refused(tmp_path, monkeypatch, expected):
    """`VerifiedFile`: a file cut short between its open (its size taken) and the end of the read
    is refused as such, hashed or not (unhashed, its header read whole, it was taken)."""
    from fsdp_sync.weights import hf_checkpoint as ckpt
    from fsdp_sync.weights.hf_checkpoint import CheckpointError
    from fsdp_sync.weights.verified_file import VerifiedFile

    p = str(tmp_path / "x.safetensors")
    _raw(p, {"a": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}, bytes(range(256)))
    digest = ckpt.digest_file(p, "sha256")[0]
    real, cut = os.readv, []

    def readv(fd, bufs):
        if not cut:                     # the first read: someone cuts the file to its header + 16
            cut.append(True)
            os.truncate(p, os.path.getsize(p) - 240)
        return real(fd, bufs)

    monkeypatch.setattr(os, "readv", readv)
    with pytest.raises(CheckpointError, match="shrank while being read"):
        VerifiedFile(p, digest if expected else None, chunk=64)
    assert cut


def test_a_tensor_cut_after_the_check_is_refused_not_read_short(tmp_path):
    """`FileTensor.read_into` / ``load``: the file cut after it was checked (between
    `VerifiedFile.check_unchanged` and the copy) is refused naming the tensor; a short read left
    the rest of the destination as it was (old weights under new ones), without a word."""
    from fsdp_sync.weights.hf_checkpoint import CheckpointError
    from fsdp_sync.weights.verified_file import VerifiedFile

    p = str(tmp_path / "x.safetensors")
    data = torch.arange(64, dtype=torch.float32)
    _raw(p, {"a": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}},
         data.numpy().tobytes())
    with VerifiedFile(p, None) as vf:
        dst = torch.full((64,), -1.0)
        vf.tensors["a"].read_into(dst)
        assert torch.equal(dst, data)
        os.truncate(p, os.path.getsize(p) - 100)
        for read in (lambda: vf.tensors["a"].read_into(torch.empty(64)), vf.tensors["a"].load):
            with pytest.raises(CheckpointError, match=r"shrank after it was checked \(tensor 'a'"):
                read()


def test_an_in_memory_header_longer_than_the_buffer_is_refused():
    """`SliceReader(data=...)`: a header length past the buffer's end is refused as such, even where
    the bytes that are there parse (a tensorless header): not read as a file of no tensors."""
    import struct

    from fsdp_sync.weights.hf_checkpoint import CheckpointError, SliceReader

    raw = struct.pack("<Q", 1000) + b"{}      "
    with pytest.raises(CheckpointError, match="header of 1000 bytes does not fit the file"):
        with SliceReader("mem.safetensors", data=torch.frombuffer(bytearray(raw), dtype=torch.uint8)):
            pass
