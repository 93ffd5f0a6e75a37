"""What a failed disk sync leaves behind in the engine: a per-rank sync that fails while writing (a
full disk) after the reference engine hashed some files ahead. Its workers held the removed temp
directory's files (and the directory) open, so their disk space stayed allocated until the next
update, which is what the retry after ENOSPC needs. Now the trainer tells them to drop those files
(`HashAhead.drop`, the engine's ``drop_files_ahead``) before the sync raises.
"""

from __future__ import annotations

import os

import pytest
import torch

from _util import fds_under

pytestmark = pytest.mark.timeout(60)


def _config(d, **kw):
    from fsdp_sync.config import SyncConfig

    return SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32, **kw)


def _ctx(module, sc, engines, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    return SyncContext(module=module, config=sc, topo=None, group=None, engines=engines,
                       step=step, stats=SyncStats())


class _Told:
    """Passes ``hash_files_ahead`` on and waits until every worker took the hint (one round
    trip), so that the files are open before the sync goes on."""

    def __init__(self, engine):
        self._engine, self.told = engine, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hash_files_ahead(self, directory, files, hash, published=None):
        self._engine.hash_files_ahead(directory, files, hash, published=published)
        self._engine.weights_checksum()
        self.told += len(files)


def test_a_failed_per_rank_write_leaves_no_file_open_in_the_engine(tmp_path, monkeypatch):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import disk_ranked
    from fsdp_sync.transport.disk import DiskTransport

    cfg = load_config("tiny")
    module = build_model(cfg, seed=1)
    d = tmp_path / "ck"
    sc = _config(d, bucket_bytes=16 << 10, layout="engine")
    real = disk_ranked.write_shard

    def full(tmp, file, *a, **k):
        if "part-5" in file:
            raise OSError(28, "No space left on device (injected)")
        return real(tmp, file, *a, **k)

    monkeypatch.setattr(disk_ranked, "write_shard", full)
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        told = _Told(engine)
        t = DiskTransport(sc)
        try:
            with pytest.raises(SyncError, match="No space left"):
                t.sync(_ctx(module, sc, [told], 0))
        finally:
            t.close()
        assert told.told > 0, "no file was hashed ahead: the case is not exercised"
        assert os.listdir(d) == []
        for pid in engine.worker_pids:
            assert fds_under(pid, str(d)) == [], f"worker {pid} holds the failed version's files open"
        # the engine still serves and loads the next version
        monkeypatch.setattr(disk_ranked, "write_shard", real)
        t = DiskTransport(sc)
        try:
            t.sync(_ctx(module, sc, [engine], 1))
        finally:
            t.close()
        got = dict(engine.named_full_tensors())
        assert all(torch.equal(got[n], p) for n, p in module.named_parameters())
