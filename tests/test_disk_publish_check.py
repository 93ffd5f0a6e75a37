"""A disk version is published only when every planned file's record came back from its writer:
a writer whose file list lost one (here, the second file's record dropped) fails the sync with
the written and planned file names, and nothing is published (no version directory, its
temporary directory removed), so no engine could be told to load a version missing a shard.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def test_a_lost_writer_file_is_not_published(tmp_path):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    module = build_model(load_config("tiny"), seed=1)
    root = tmp_path / "ck"
    sc = SyncConfig(method="disk", disk_dir=str(root), dtype=torch.float32, bucket_bytes=48 << 10, layout="full")
    t = DiskTransport(sc)
    real = t._write_buckets
    lost = []

    def lossy(*a, **kw):
        records, err = real(*a, **kw)
        lost.append(records.pop(1)["file"])
        return records, err

    t._write_buckets = lossy
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=[], step=3, stats=SyncStats())
    try:
        with pytest.raises(Exception, match=r"written files \[.*\] are not the planned \[.*\]") as info:
            t.sync(ctx)
        assert lost and lost[0] in str(info.value), (lost, str(info.value))
        assert t.published is None
        assert os.listdir(root) == [], os.listdir(root)     # no version, no temporary directory
        # the same step written whole afterwards is published
        t._write_buckets = real
        t.sync(ctx)
        assert t.published == 3 and os.path.isdir(ctx.stats.extra["path"])
    finally:
        t.close()
