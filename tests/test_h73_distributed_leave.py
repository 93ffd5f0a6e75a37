"""H73's audit of the distributed method: an engine that refuses a bucket leaves the update group
at once, so the other engines' receive ends (`distributed.DistributedTransport._leave_refused`);
per-rank buckets are not chosen over gloo on CUDA (the last test).

A refusing engine never joins the bucket's broadcast, and over gloo the other engines' workers can
be waiting for bytes relayed by its workers (gloo's broadcast is a tree): with two reference
engines of TP 2, one refusing bucket 2, the other's receive waited until the trainer gave it up at
``dist_timeout_s`` (5.1 s with 5; 600 s by default), marked stuck and skipped by the abort and
the teardown; with the refusing engine told to leave first, the sync failed in 0.14 s and the
next one succeeded (measured with the real engines: 31 s of process start-up, too slow here). In
process: engine 0's receive is a future that ends only when engine 1 leaves the group, as the
relayed receive does; nothing depends on timing (before the fix the test fails after
``dist_timeout_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.transport.distributed import DistributedTransport, _Pending


class _Refusing:
    """Engine 1: refused the bucket; leaving the group closes its connections, which ends engine
    0's receive (``blocked``) with an error."""

    tp_size = 2

    def __init__(self, blocked: cf.Future, fails: bool) -> None:
        self.blocked, self.fails, self.left = blocked, fails, []

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.left.append(group_name)
        if not self.blocked.done():
            self.blocked.set_exception(RuntimeError("gloo: connection closed by peer"))
        if self.fails:
            raise RuntimeError("engine 1 is gone")


class _Receiving:
    tp_size = 2

    def __init__(self) -> None:
        self.left: list = []

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.left.append(group_name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leave_fails", [False, True])
def test_a_refusing_engine_leaves_the_group_so_the_others_receive_ends(leave_fails, caplog):
    t = DistributedTransport(SimpleNamespace(dist_timeout_s=20.0, dist_group_name="g"))
    receiving = cf.Future()
    receiving.set_running_or_notify_cancel()
    refused = cf.Future()
    refused.set_exception(ValueError("unknown weight-update group 'g'"))
    other, refusing = _Receiving(), _Refusing(receiving, leave_fails)
    t.engines = [other, refusing]
    err = t._finish(_Pending("bucket 2 (w…)", [], [receiving, refused]))
    assert err.startswith("engine 1 refused bucket 2 (w…): ValueError: unknown weight-update group"), err
    assert t.broken and refusing.left == ["g"]
    # engine 0 answered (its receive failed) instead of being given up as stuck: its abort and
    # the teardown reach it
    assert receiving.done() and t._stuck == set()
    with caplog.at_level(logging.WARNING, logger="fsdp_sync"):
        t._drop_group(t.engines)
    assert other.left == ["g"] and refusing.left == ["g"]     # engine 1 not asked a second time
    assert ("engine 1 is gone" in caplog.text) == leave_fails
    assert t._left == {} and t.engines == []


class _RankBucketEngine:
    """An engine taking per-rank buckets over the update group (as the reference engine does)."""

    tp_size, accepts_distributed_rank_buckets = 2, True


@pytest.mark.parametrize("backend, want, chosen", [
    ("gloo", "auto", None), ("gloo", "engine", "refused"), ("nccl", "auto", "engine"), (None, "engine", "engine")])
def test_per_rank_buckets_are_not_sent_point_to_point_over_gloo_on_cuda(monkeypatch, backend, want, chosen):
    """Per-rank buckets go to each engine rank by isend/recv, which torch's gloo backend does for
    CPU tensors only (its send hands gloo the tensor's data pointer: on CUDA a device address;
    torch's backend table: gloo send/recv GPU ✘). With ``dist_backend="gloo"`` on CUDA, "auto"
    chose them all the same (the bucket's send then fails or worse, unverified here: no GPU);
    now it sends full tensors (one broadcast, which gloo takes from CUDA) and "engine" is
    refused naming the backend. In process: the module's device is said to be cuda:0."""
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
