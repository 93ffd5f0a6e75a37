"""A full disk during a disk sync (`transport.disk`): refused naming the directory and the bytes
the version needs, nothing published, the version before it whole, the next sync whole.

Before, the error was only ``OSError: [Errno 28] No space left on device``: no size, no room, no
word of what to do (`disk_writer.no_space`). Also: a failed fsync of ``disk_dir`` after the rename
(the version is visible then) is not called unpublished, and that version is whole.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _setup(tmp_path, keep=1):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport.disk import DiskTransport

    module = build_model(load_config("tiny"), seed=1)
    d = tmp_path / "ck"
    sc = SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32, disk_keep=keep,
                    bucket_bytes=64 << 10)
    return module, sc, d, DiskTransport(sc)


def _sync(t, module, sc, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    t.sync(SyncContext(module=module, config=sc, topo=None, group=None, engines=[], step=step,
                       stats=SyncStats()))


def _whole(path, module=None):
    """Every file matches the manifest; with ``module``: the tensors are its parameters."""
    from safetensors.torch import load_file

    from fsdp_sync.weights import hf_checkpoint as ckpt

    plan = ckpt.resolve(str(path))
    tensors = {}
    for f in plan.files:
        ckpt.verify_file(plan.directory, f, plan.digests[f], plan.hash)
        tensors.update(load_file(os.path.join(plan.directory, f)))
    if module is not None:
        assert all(torch.equal(tensors[n], p) for n, p in module.named_parameters())
    return tensors


@pytest.mark.parametrize("phase", ["write", "publish"])
def test_a_full_disk_is_refused_naming_the_directory_and_the_bytes_needed(tmp_path, monkeypatch, phase):
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import hf_checkpoint as ckpt

    module, sc, d, t = _setup(tmp_path)
    try:
        _sync(t, module, sc, 0)
        _sync(t, module, sc, 1)                 # step_0 is the pool now: its files get reused
        before = _whole(d / "step_1", module)
        need = sum(p.numel() * 4 for p in module.parameters())
        calls = [0]
        real = ckpt._write_all if phase == "write" else ckpt.write_json

        def full(*a, **k):
            calls[0] += 1
            if calls[0] > (3 if phase == "write" else 1):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*a, **k)

        monkeypatch.setattr(ckpt, "_write_all" if phase == "write" else "write_json", full)
        with pytest.raises(SyncError) as info:
            _sync(t, module, sc, 2)
        msg = str(info.value)
        assert f"no room on the filesystem of {d}" in msg and f"({need} bytes) of tensors" in msg, msg
        assert "disk_keep=1" in msg and "Nothing was published" in msg and "No space left" in msg
        assert sorted(os.listdir(d)) == [".recycle", "step_1"]
        after = _whole(d / "step_1")
        assert sorted(after) == sorted(before) and all(torch.equal(after[n], before[n]) for n in before)
        monkeypatch.undo()
        _sync(t, module, sc, 3)                 # the next sync: whole
        assert sorted(os.listdir(d)) == [".recycle", "step_3"]
        _whole(d / "step_3", module)
    finally:
        t.close()


def test_a_failed_fsync_of_the_directory_after_the_rename_leaves_a_whole_version(tmp_path, monkeypatch):
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import hf_checkpoint as ckpt

    module, sc, d, t = _setup(tmp_path, keep=2)
    try:
        _sync(t, module, sc, 0)
        real = ckpt.fsync_dir

        def failing(path):
            if os.path.samefile(path, d):
                raise OSError(errno.ENOSPC, "fsync of the directory failed (injected)")
            return real(path)

        monkeypatch.setattr(ckpt, "fsync_dir", failing)
        with pytest.raises(SyncError, match="injected") as info:
            _sync(t, module, sc, 1)
        assert "Nothing was published" not in str(info.value)   # it is: visible, whole
        _whole(d / "step_1", module)
        monkeypatch.undo()
        _sync(t, module, sc, 2)
        _whole(d / "step_2", module)
        assert sorted(f for f in os.listdir(d) if not f.startswith(".")) == ["step_1", "step_2"]
    finally:
        t.close()


def test_a_pool_of_other_file_names_is_trimmed_so_a_full_disk_can_recover(tmp_path, monkeypatch):
    """The pool's files that a sync writes none of (another bucket count or layout named them)
    were never reused and stayed until a sync succeeded: after such a change on a disk sized for
    the steady state, every sync failed with ENOSPC and left the pool as it was. Now rank 0 removes
    them as the writers start, so the failed sync leaves the room for the next."""
    import dataclasses

    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import disk

    module, sc, d, t = _setup(tmp_path)
    try:
        _sync(t, module, sc, 0)
        _sync(t, module, sc, 1)
        pool = d / ".recycle"
        assert len([f for f in os.listdir(pool) if f.endswith(".safetensors")]) > 1
        one_file = dataclasses.replace(sc, bucket_bytes=64 << 20)     # model-00001-of-00001 only

        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(disk, "_write_shard", full)
        with pytest.raises(SyncError, match="No space left"):
            _sync(t, module, one_file, 2)
        assert os.listdir(pool) == [], "the pool's unusable files stayed: the retry meets them again"
        monkeypatch.undo()
        _sync(t, module, one_file, 3)
        assert sorted(os.listdir(d)) == [".recycle", "step_3"]
        _whole(d / "step_3", module)
    finally:
        t.close()
