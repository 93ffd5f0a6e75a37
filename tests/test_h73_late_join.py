"""H73: an engine whose ``init_weights_update_group`` from a failed opening still runs is not
told to join again (`update_group.open_group`'s ``joins``).

A TP worker late to the group (stopped, or busy, past ``dist_timeout_s``) holds its engine's join
call until the worker's own timeout; before, every sync asked that engine again, each call queued
behind the last and each waiting out that timeout once more: with a reference engine whose TP
worker 0 woke 1.5 s after the opening failed (``dist_timeout_s=5``, ``update_recv_timeout_s=20``)
8 syncs of 8 failed over 48 s. Now the next openings fail at once naming the engine, and the
first after its call ended (19 s) succeeds (measured with /tmp's script; real engines start in
~20 s here, so in process: an engine that never joins until released).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.transport import update_group as ug
from fsdp_sync.transport.distributed import DistributedTransport


class _Late:
    tp_size = 1

    def __init__(self) -> None:
        self.woken, self.calls = threading.Event(), 0

    def init_weights_update_group(self, **kw):
        self.calls += 1
        self.woken.wait(30)            # its worker joins nothing before it wakes
        return {"success": False, "message": "nothing listens on that port any more (late)"}

    def destroy_weights_update_group(self, name):
        return {"success": True}


@pytest.mark.timeout(60)
def test_an_engine_still_joining_an_earlier_group_is_not_told_again(monkeypatch):
    monkeypatch.setattr(ug, "CALL_OFF_FLOOR_S", 0.05)    # the call-off's wait: not the point here
    cfg = SimpleNamespace(dist_timeout_s=0.3, dist_group_name="h73_late_join", dist_backend="gloo",
                          dist_master_port=None, dist_master_address="127.0.0.1")
    t, late = DistributedTransport(cfg), _Late()
    try:
        with pytest.raises(RuntimeError, match="not every engine TP worker joined within dist_timeout_s=0.3"):
            t._open_group([late], torch.device("cpu"))
        with pytest.raises(RuntimeError, match=r"engine 0's init_weights_update_group from an earlier "
                                               r"opening that failed is still running .* no engine was told"):
            t._open_group([late], torch.device("cpu"))
        assert late.calls == 1
        late.woken.set()
        (_, call), = t._joins.values()
        call.result(timeout=30)
        with pytest.raises(RuntimeError, match="nothing listens on that port any more"):
            t._open_group([late], torch.device("cpu"))   # its call ended: told again
        assert late.calls == 2
    finally:
        late.woken.set()
        t.close()
