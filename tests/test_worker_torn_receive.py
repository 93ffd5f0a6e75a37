"""A reference worker whose broadcast receive fails part-way leaves the weight-update group, as its
error says: the group is aborted and destroyed and dropped from the worker, so the next receive on
it is refused at once ("is not in weight-update group") instead of being attempted on a torn
group whose peers are out of step. One process: the worker is built bare, the broadcast and the
group's destruction are stubbed."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import wire
from fsdp_sync.engines.reference import worker as wk


class _TornGroup:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.timeout(60)
def test_a_torn_receive_leaves_the_update_group_as_its_error_says(monkeypatch):
    destroyed = []
    monkeypatch.setattr(wire, "destroy_update_group", lambda pg: destroyed.append(pg))
    pg = _TornGroup()
    w = wk.Worker.__new__(wk.Worker)
    w.rank, w.device, w.update_groups = 0, torch.device("cpu"), {"g": pg}

    def reset(*a, **k):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(torch.distributed, "broadcast", reset)
    with pytest.raises(wk.WorkerError, match="the group was left"):
        w.receive_broadcast({"group_name": "g", "load_format": "flattened_bucket",
                             "entries": [("w", torch.float32, (4,))]})
    assert "g" not in w.update_groups and destroyed == [pg] and pg.aborted
    # the next receive on it is refused at once, not attempted on a torn group
    with pytest.raises(wk.WorkerError, match="is not in weight-update group 'g'"):
        w.receive_broadcast({"group_name": "g", "load_format": None, "entries": [("w", torch.float32, (4,))]})
