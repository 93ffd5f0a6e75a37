"""`fsdp_sync.transport`'s own pieces, in process: `make_transport` builds the transport the
method names (and says which engine stages apply: ``colocated``), refusing another name; and
`timed_items` adds the producer's time per item and does not hold the item it handed out while
the next one is made (a pipelined sync reuses that item's buffer for the next)."""

from __future__ import annotations

import types
import weakref

import pytest

from fsdp_sync import transport
from fsdp_sync.config import SyncConfig


def test_make_transport_builds_the_method_named_and_refuses_another():
    for cfg, name, colocated in ((SyncConfig(), "TensorTransport", True),
                                 (SyncConfig(method="distributed"), "DistributedTransport", False),
                                 (SyncConfig(method="disk", disk_dir="/nonexistent"), "DiskTransport", False)):
        t = transport.make_transport(cfg)
        assert (type(t).__name__, t.method, t.colocated) == (name, cfg.method, colocated)
        t.close()
    with pytest.raises(ValueError, match=r"unknown update method 'ipc'; expected one of "
                                         r"\('tensor', 'distributed', 'disk'\)"):
        transport.make_transport(types.SimpleNamespace(method="ipc"))


class _Item:
    pass


def test_timed_items_adds_each_items_making_time_and_lets_go_of_the_item(monkeypatch):
    ticks = iter(range(100))       # the module's clock only: one tick a reading
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    alive = []

    def stream():
        for _ in range(3):
            # the item handed out before is gone once its consumer dropped it
            assert not [r for r in alive if r() is not None], "timed_items held the last item"
            item = _Item()
            alive.append(weakref.ref(item))
            yield item
            del item

    seconds = {"export_s": 0.5}
    it = transport.timed_items(stream(), seconds, "export_s")
    got = 0
    while True:
        item = next(it, None)
        if item is None:
            break
        got += 1
        del item
    # one tick for each of the 3 items and one for the end: added to what was there
    assert (got, seconds["export_s"]) == (3, 4.5)
