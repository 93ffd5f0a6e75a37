"""``stats.tensors`` counts per-rank files as the engine gets them (audit disk3, D3).

`SyncStats` says that with ``layout="engine"`` the count is the engine's fused parameters (one
``qkv_proj`` for q, k and v, one ``gate_up_proj``), as one engine rank gets them. The distributed
method counted so (tiny, TP 2: 17); the disk method counted the Hugging Face tensors it exported
(27) whatever the layout (/tmp/audit/disk3/tensors_count.py). Now it counts the tensors named in
one engine rank's files: the two methods agree for either layout.
"""

from __future__ import annotations

import tempfile

import pytest
import torch


@pytest.mark.timeout(120)
def test_disk_and_distributed_count_the_same_tensors_for_each_layout(tmp_path):
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    hf = len(module.state_dict())
    got = {}
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.bfloat16) as engine:
        for method in ("disk", "distributed"):
            for layout in ("engine", "full"):
                kw = {"disk_dir": tempfile.mkdtemp(dir=tmp_path)} if method == "disk" else {}
                m = FSDPShardingManager(module, [engine], config=SyncConfig(
                    method=method, layout=layout, dtype=torch.bfloat16, bucket_bytes=64 << 10, **kw))
                try:
                    with m:
                        pass
                    assert m.stats.extra["layout"] == layout
                    got[method, layout] = m.stats.tensors
                finally:
                    m.close()
    assert got["disk", "engine"] == got["distributed", "engine"], got
    assert got["disk", "full"] == got["distributed", "full"] == hf, got
    # fused: fewer than the Hugging Face tensors (q, k, v into one; gate, up into one)
    assert 0 < got["disk", "engine"] < hf, got
