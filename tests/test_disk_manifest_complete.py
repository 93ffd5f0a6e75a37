"""A copied Hugging Face version without its index that lost a shard: the manifest lists the
shard, yet the reader loaded the rest and left the lost tensors' old weights serving
(`hf_checkpoint.resolve` checked only that each file present is listed, not that each listed
file is present). Now it is refused naming the file, nothing loaded.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def test_a_manifest_shard_missing_without_an_index_is_refused(tmp_path):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import WeightUpdateError
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport
    from fsdp_sync.weights import hf_checkpoint as ckpt

    cfg = load_config("tiny")
    module = build_model(cfg, seed=1)
    sc = SyncConfig(method="disk", disk_dir=str(tmp_path / "ck"), dtype=torch.float32,
                    bucket_bytes=48 << 10, layout="full")
    t = DiskTransport(sc)
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=[], step=0,
                      stats=SyncStats())
    t.sync(ctx)
    t.close()
    copy = tmp_path / "copy"
    shutil.copytree(ctx.stats.extra["path"], copy)
    os.remove(copy / ckpt.INDEX_FILE)               # an rsync that stopped before the last file
    shards = sorted(f for f in os.listdir(copy) if f.endswith(".safetensors"))
    assert len(shards) > 2
    os.remove(copy / shards[1])
    assert shards[1] in json.loads((copy / ckpt.MANIFEST_FILE).read_text())["files"]
    with pytest.raises(ckpt.CheckpointError, match=f"missing shard {shards[1]}.*{ckpt.MANIFEST_FILE}"):
        ckpt.resolve(str(copy))
    other = build_model(cfg, seed=99)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        engine.update_weights_from_tensor(list(other.named_parameters()))
        with pytest.raises(WeightUpdateError, match=f"missing shard {shards[1]}"):
            engine.update_weights_from_disk(str(copy))
        got = dict(engine.named_full_tensors())
        assert all(torch.equal(got[n], p) for n, p in other.named_parameters())   # old weights
