"""H73's audit of the distributed method: per-rank buckets are not chosen over gloo on CUDA
(`distributed.DistributedTransport._choose_layout`).

Per-rank buckets go to each engine rank by isend/recv, which torch's gloo backend does for CPU
tensors only (its send hands gloo the tensor's data pointer: on CUDA a device address; torch's
backend table: gloo send/recv GPU ✘). With ``dist_backend="gloo"`` on CUDA, ``layout="auto"``
chose them all the same (what the send then does is unverified here: no GPU); now it sends full
tensors (one broadcast, which gloo takes from CUDA) and ``"engine"`` is refused naming the
backend. In process: the module's device is said to be cuda:0; no group is made.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.transport.distributed import DistributedTransport


class _RankBucketEngine:
    """An engine taking per-rank buckets over the update group (as the reference engine does)."""

    tp_size, accepts_distributed_rank_buckets = 2, True


@pytest.mark.parametrize("backend, want, chosen", [
    ("gloo", "auto", None), ("gloo", "engine", "refused"), ("nccl", "auto", "engine"), (None, "engine", "engine")])
def test_per_rank_buckets_are_not_sent_point_to_point_over_gloo_on_cuda(monkeypatch, backend, want, chosen):
    from fsdp_sync import SyncConfig, SyncError
    from fsdp_sync.models import load_config
    from fsdp_sync.transport import distributed as dm

    monkeypatch.setattr(dm, "_module_device", lambda module: torch.device("cuda", 0))
    t = DistributedTransport(SyncConfig(method="distributed", layout=want, dist_backend=backend))
    module = torch.nn.Module()      # the layout comes from its config (no weights are read here)
    module.config = load_config("tiny")
    ctx = SimpleNamespace(module=module, group=None)
    if chosen == "refused":
        with pytest.raises(SyncError, match=r"layout='engine': dist_backend='gloo' on CUDA: per-rank "
                                            r"buckets go point to point \(send/recv\)"):
            t._choose_layout(ctx, [_RankBucketEngine()], 0)
        return
    layout = t._choose_layout(ctx, [_RankBucketEngine()], 0)
    assert (layout is None) == (chosen is None) and (layout is None or layout.tp == 2)
