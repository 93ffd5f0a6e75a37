"""Trainer ranks that disagree on the disk method's own settings (`transport.disk`).

``SyncConfig.disk_hash`` is no export setting (`export_checks.SETTINGS`), so nothing compared it:
a rank hashing with sha256 beside a rank 0 on xxh3_128 had its digests listed in the manifest
under rank 0's hash, the version was published, and the reference engine refused it (and every
later one) as "torn or corrupt" (/tmp/h72/two_rank.py, 2 gloo ranks). Now every rank refuses before
anything is written, naming the setting, both ranks and their values; likewise a rank built with
another ``parallel_write`` (other writers: other files, another all-to-all). One process here:
the gather is given a second rank's answer.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("other", [(True, "sha256", True), (True, "xxh3_128", False)])
def test_a_rank_with_another_hash_or_writer_setting_is_refused_before_a_file_is_written(
        tmp_path, monkeypatch, other):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport import disk

    module = build_model(load_config("tiny"), seed=1)
    d = tmp_path / "ck"
    sc = SyncConfig(method="disk", disk_dir=str(d), dtype=torch.float32)
    assert sc.disk_hash == "xxh3_128"
    real = disk.all_gather

    def two_ranks(obj, group, world):
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], bool):   # the settings
            return [obj, other]
        return real(obj, group, world)

    monkeypatch.setattr(disk, "all_gather", two_ranks)
    t = disk.DiskTransport(sc)
    try:
        with pytest.raises(SyncError) as info:
            t.sync(SyncContext(module=module, config=sc, topo=None, group=None, engines=[], step=0,
                               stats=SyncStats()))
    finally:
        t.close()
    name, mine, theirs = (("SyncConfig.disk_hash", "'xxh3_128'", "'sha256'") if other[1] == "sha256"
                          else ("parallel_write", "True", "False"))
    msg = str(info.value)
    assert name in msg and f"rank 0 has {mine}, rank 1 has {theirs}" in msg, msg
    assert os.listdir(d) == []
