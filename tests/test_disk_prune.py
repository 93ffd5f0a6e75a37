"""Keep-N beside the load: the versions a disk sync drops are removed on trainer rank 0 while the
engines load the new one (a thread deletes them; the sync waits for it before returning), not
after the load on the sync's critical path (issue 39: freeing two versions of qwen2-160m on tmpfs
took 0.13 CPU s there). Checked here with a real reference engine: the dropped version is gone
from view before the engine loads, nothing hidden is left when the sync returns, the weights are
the trainer's; a refused load keeps the version the engine serves (and its weights); with
``disk_keep=1`` the version served before goes once the load succeeded.
"""

from __future__ import annotations

import os

import pytest
import torch


class _Watch:
    """The real engine, with what the disk directory held when each load began (and a refusal)."""

    def __init__(self, engine, d):
        self.engine, self.d, self.seen, self.refuse = engine, d, [], False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights_from_disk(self, path, **kw):
        # the versions in view (a dropped one may be under its hidden name, being deleted)
        self.seen.append((os.path.basename(path), sorted(f for f in os.listdir(self.d)
                                                         if not f.startswith("."))))
        if self.refuse:
            raise RuntimeError(f"engine refused {os.path.basename(path)} (injected)")
        return self.engine.update_weights_from_disk(path, **kw)


def _sync(transport, module, engines, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    ctx = SyncContext(module=module, config=transport.config, topo=None, group=None,
                      engines=engines, step=step, stats=SyncStats())
    transport.sync(ctx)
    return ctx.stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["full", "engine"])
def test_dropped_versions_are_removed_while_the_engine_loads(tmp_path, layout):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport.disk import DiskTransport

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=5)
    d = str(tmp_path / "v")
    sc = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=1 << 20,
                    disk_keep=2, layout=layout)
    t = DiskTransport(sc)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as real:
        engine = _Watch(real, d)
        try:
            for step in range(4):
                with torch.no_grad():
                    for p in module.parameters():
                        p.add_(0.25)
                stats = _sync(t, module, [engine], step)
                # the load of step_N began with step_{N-2} already out of view
                assert engine.seen[-1] == (f"step_{step}",
                                           [f"step_{j}" for j in range(max(0, step - 1), step + 1)])
                assert sorted(os.listdir(d)) == [f"step_{j}" for j in range(max(0, step - 1), step + 1)]
                assert stats.extra["pruned"] == ([os.path.join(d, f"step_{step - 2}")] if step >= 2 else [])
                assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
            served = real.weights_checksum()
            # a refused load: step_2 goes (beyond the newest two), step_3 (served) stays, and so do
            # its weights
            engine.refuse = True
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(-1)
            with pytest.raises(SyncError, match="engine refused step_4"):
                _sync(t, module, [engine], 4)
            assert sorted(os.listdir(d)) == ["step_3", "step_4"]
            assert real.weights_checksum() == served
            # disk_keep=1: the version served before goes once the new one is loaded
            engine.refuse = False
            t.keep = 1
            stats = _sync(t, module, [engine], 5)
            assert engine.seen[-1] == ("step_5", ["step_3", "step_5"])      # step_3 still served
            assert sorted(os.listdir(d)) == ["step_5"]
            assert sorted(stats.extra["pruned"]) == [os.path.join(d, "step_3"), os.path.join(d, "step_4")]
            assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        finally:
            t.close()
