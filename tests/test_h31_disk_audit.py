"""Audit H31 of the disk method (`transport.disk`, `disk_writer`, `weights.verified_file`): cases
no other test pinned, each in one process with no engine process (cheap).

- a ``.recycle`` pool an earlier run left (it crashed, or never called close) is taken by the
  next transport's writers, so that transport's `close` removes it as it removes its own: before,
  ``_pool`` was set only where this transport made the pool, and the leftover stayed, one
  version's worth of disk, after close.
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
