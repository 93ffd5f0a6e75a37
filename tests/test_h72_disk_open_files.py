"""Keep-N's pool (`transport.disk`, issue 39) and a dropped version's file still open elsewhere.

The next sync overwrites the files of the newest dropped version in place (their pages reused).
A process still reading that version (an evaluation job, an rsync of it, a reader that mapped a
file) saw the new weights appear under the old version's name, torn partway through: neither the
old version nor the new one. Such a file is now removed and written fresh (the reader keeps the
old bytes, as with any unlinked file), found by a Linux write lease (`disk_writer.open_elsewhere`);
the pool's other files are still reused.
"""

from __future__ import annotations

import mmap
import os

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def _sync(transport, module, sc, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    transport.sync(SyncContext(module=module, config=sc, topo=None, group=None, engines=[],
                               step=step, stats=SyncStats()))


def _files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_a_dropped_file_open_or_mapped_elsewhere_is_not_rewritten_under_its_reader(tmp_path):
    from safetensors.torch import load_file

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport.disk import DiskTransport

    module = build_model(load_config("tiny"), seed=1)
    d = tmp_path / "ck"
    sc = SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32, disk_keep=1,
                    bucket_bytes=64 << 10)
    t = DiskTransport(sc)
    try:
        _sync(t, module, sc, 0)
        files = _files(d / "step_0")
        assert len(files) >= 3, "the case needs a pool of several files"
        opened, mapped = (str(d / "step_0" / f) for f in files[:2])
        inodes = {f: os.stat(d / "step_0" / f).st_ino for f in files}
        reader = open(opened, "rb")
        with open(mapped, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)    # the fd closed: the map holds it
        try:
            old_read, old_mapped = reader.read(), bytes(mm)
            reader.seek(0)
            _sync(t, module, sc, 1)       # step_0 becomes the pool
            _sync(t, module, sc, 2)       # its files are taken for step_2
            assert reader.read() == old_read, "a reader of the dropped version saw it rewritten"
            assert bytes(mm) == old_mapped, "a mapping of the dropped version saw it rewritten"
        finally:
            reader.close()
            mm.close()
        new = d / "step_2"
        got = {f: os.stat(new / f).st_ino for f in files}
        assert got[files[0]] != inodes[files[0]] and got[files[1]] != inodes[files[1]]
        assert all(got[f] == inodes[f] for f in files[2:]), "the files no one held were not reused"
        tensors = {}
        for f in files:
            tensors.update(load_file(str(new / f)))
        assert sorted(tensors) == sorted(n for n, _ in module.named_parameters())
        assert all(torch.equal(tensors[n], p) for n, p in module.named_parameters())
    finally:
        t.close()


def test_open_elsewhere_sees_descriptors_and_mappings_of_the_file(tmp_path):
    from fsdp_sync.transport.disk_writer import open_elsewhere

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    if open_elsewhere(str(path)):
        pytest.skip("no write leases here (not Linux, or the filesystem grants none)")
    with open(path, "rb"):
        assert open_elsewhere(str(path))
    with open(path, "r+b") as f:
        assert open_elsewhere(str(path))
        mm = mmap.mmap(f.fileno(), 0)
    assert open_elsewhere(str(path))
    mm.close()
    assert not open_elsewhere(str(path))
    os.link(path, tmp_path / "g")                 # another name is not an open file (`write_shard`
    assert not open_elsewhere(str(path))          # checks links apart)
    assert open_elsewhere(str(tmp_path / "missing"))
