"""The fleet's bookkeeping after failures (audit of the distributed method and the fleet, dist2):
what `fleet_status` says of a replica brought back, and the distributed method's fleet-wide end of
a failed sync (which replicas are aborted, which are named as holding partly new weights, none
left with an update open).

The engine-backed tests run in-process on one trainer rank with reference engines at TP 1, each
with its own ``dist_group_name`` and short timeouts, so the code before the fixes fails an
assertion instead of hanging.
"""

from __future__ import annotations

import pytest

from fsdp_sync.fleet import Fleet


class _Engine:
    """What `Fleet` asks of an engine: nothing but its serving state."""

    def __init__(self) -> None:
        self.serving: list = []

    def set_serving(self, serving: bool, reason: str) -> None:
        self.serving.append((serving, reason))


def test_a_reinstated_replica_has_no_quarantine_time():
    """`Fleet.reinstate` kept ``quarantined_at``: fleet_status showed a quarantine time for a
    replica in service (after recover, or a rejoin at the next sync)."""
    engine = _Engine()
    fleet = Fleet([engine])
    rep = fleet.replicas[0]
    fleet.quarantine(rep, "drained")
    assert fleet.summary()["replicas"][0]["quarantined_at"] is not None
    fleet.reinstate(rep, "3")
    assert fleet.summary()["replicas"][0] == {"name": "replica 0", "serving": True, "reason": None,
                                              "version": "3", "quarantined_at": None}
    assert engine.serving == [(False, "drained"), (True, "")]
