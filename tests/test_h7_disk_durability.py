"""The disk method's writes are durable before a version appears, and a version whose files are not
the planned ones never appears (mutation pass, H7).

Survivors this kills: the writer's fsync of every weight file before its rank reports them written
(`OneWriter.drive`) skipped, the temp directory's fsync before its rename (`DiskTransport._publish`)
skipped: either way a crash after the rename leaves a version whose manifest names files the device
never got (torn: zero-filled or short after the reboot) under a name a later load trusts; and the
check of a per-rank version's files against the plan (`disk_ranked.publish_ranked`) skipped: a
version with a file missing or written twice was published.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch


def _record(monkeypatch):
    from fsdp_sync.weights import hf_checkpoint as ckpt

    events = []
    real_file, real_dir, real_rename = ckpt.fsync_file, ckpt.fsync_dir, os.rename

    def fsync_file(path):
        events.append(("fsync_file", os.path.abspath(path)))
        return real_file(path)

    def fsync_dir(path):
        events.append(("fsync_dir", os.path.abspath(path)))
        return real_dir(path)

    def rename(src, dst, *a, **kw):
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(ckpt, "fsync_file", fsync_file)
    monkeypatch.setattr(ckpt, "fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "rename", rename)
    return events


@pytest.mark.timeout(60)
def test_every_file_and_the_directory_are_fsynced_before_the_version_is_renamed_in(tmp_path, monkeypatch):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=1)
    d = os.path.abspath(str(tmp_path / "v"))
    t = DiskTransport(SyncConfig(method="disk", disk_dir=d, dtype=torch.float32,
                                 bucket_bytes=256 << 10, layout="full"))
    events = _record(monkeypatch)
    try:
        t.sync(SyncContext(module=module, config=t.config, topo=None, group=None, engines=[],
                           step=0, stats=SyncStats()))
    finally:
        t.close()
    final = os.path.join(d, "step_0")
    weights = sorted(f for f in os.listdir(final) if f.endswith(".safetensors"))
    assert len(weights) >= 2, weights
    pub = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == final]
    assert len(pub) == 1, events
    tmp = events[pub[0]][1]
    for f in weights:     # each weight file's data on the device before the version has a name
        at = [i for i, e in enumerate(events) if e == ("fsync_file", os.path.join(tmp, f))]
        assert at and at[0] < pub[0], (f, events)
    # the temp directory's entries (files, manifest, index) durable before the rename, after the files
    at = [i for i, e in enumerate(events) if e == ("fsync_dir", tmp)]
    last_file = max(i for i, e in enumerate(events) if e[0] == "fsync_file")
    assert at and last_file < at[-1] < pub[0], events
    # and the rename itself made durable
    assert any(e == ("fsync_dir", d) for e in events[pub[0] + 1:]), events


@pytest.mark.parametrize("case", ["missing", "twice", "extra"])
def test_a_per_rank_version_whose_files_are_not_the_plan_is_not_published(tmp_path, case):
    from fsdp_sync.transport.disk_ranked import publish_ranked
    from fsdp_sync.weights import hf_checkpoint as ckpt

    tmp, final = str(tmp_path / ".step_0.tmp"), str(tmp_path / "step_0")
    os.mkdir(tmp)
    recs = [{"file": ckpt.rank_file_name(i, k), "digest": "0", "bytes": 0, "names": [], "rank": i,
             "part": k} for i in range(2) for k in range(2)]
    if case == "missing":
        recs = recs[:-1]
    elif case == "twice":
        recs = recs + recs[:1]
    else:
        recs = recs + [{**recs[0], "file": ckpt.rank_file_name(2, 0), "rank": 2}]
    ctx = SimpleNamespace(config=SimpleNamespace(disk_hash=ckpt.DEFAULT_HASH), module=None, step=0)
    with pytest.raises(RuntimeError, match="are not the planned"):
        publish_ranked(ctx, tmp, final, str(tmp_path), recs, SimpleNamespace(tp=2), 2, [])
    assert not os.path.exists(final) and os.path.isdir(tmp)


def test_hash_ahead_tells_other_writers_files_only_two_buckets_behind():
    """The stream has made bucket k: every writer finished its bucket k-2 (it waits for it before
    bucket k's collectives) but may still be writing k-1. Telling k-1 (or a bucket -1) hands the
    engines files still being written: hashed for nothing, and hashed again at the load."""
    from fsdp_sync.transport.disk_ranked import HashAhead
    from fsdp_sync.weights import hf_checkpoint as ckpt

    class Engine:
        def __init__(self):
            self.told = []

        def hash_files_ahead(self, directory, files, hash, published=None):
            self.told.append(sorted(files))

    e = Engine()
    ahead = HashAhead([e], "/nowhere", 2, ckpt.DEFAULT_HASH, 0, published="/nowhere/step_0")
    own = [{"file": ckpt.rank_file_name(0, 0)}]
    ahead.at_bucket(0, own, True)
    ahead.at_bucket(1, [], True)
    assert e.told == [[ckpt.rank_file_name(0, 0)]]
    ahead.at_bucket(2, [], True)
    assert e.told[1:] == [[ckpt.rank_file_name(1, 0)]]
    ahead.at_bucket(3, [], False)          # not synchronized every bucket: only its own files
    assert len(e.told) == 2


@pytest.mark.timeout(60)
def test_a_failed_fsync_of_a_written_file_publishes_nothing(tmp_path, monkeypatch):
    """Every file was written (its records complete) but one's fsync failed (EIO): the write step
    fails on every rank and no version appears; the publish's check of the file names alone would
    not see it."""
    import errno

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport
    from fsdp_sync.weights import hf_checkpoint as ckpt

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=2)
    d = str(tmp_path / "v")
    t = DiskTransport(SyncConfig(method="disk", disk_dir=d, dtype=torch.float32,
                                 bucket_bytes=256 << 10, layout="full"))
    real = ckpt.fsync_file

    def fsync_file(path):
        if path.endswith("00002.safetensors") or "-00002-" in os.path.basename(path):
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        return real(path)

    monkeypatch.setattr(ckpt, "fsync_file", fsync_file)
    try:
        with pytest.raises(SyncError, match=r"\(write\).*injected"):
            t.sync(SyncContext(module=module, config=t.config, topo=None, group=None, engines=[],
                               step=0, stats=SyncStats()))
    finally:
        t.close()
    assert [f for f in os.listdir(d) if not f.startswith(".")] == []
