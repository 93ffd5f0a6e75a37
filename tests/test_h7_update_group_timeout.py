"""Making the distributed method's update group gives up within ``dist_timeout_s`` when an engine
never joins (mutation pass, H7): the rendezvous's own timeout is ``dist_timeout_s``.

Survivor this kills: `update_group.open_group` making the group with a fixed 600 s timeout instead
of ``dist_timeout_s`` (every group-opening test had the engine answer or refuse first). An engine
whose ``init_weights_update_group`` neither joins nor answers (a hung server) then held trainer rank
0 until the engine answered, here 12 s against a 2 s ``dist_timeout_s``. One trainer rank in a fresh
process (torch's group names are per process).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

HANG_S = 12.0


class _NeverJoins:
    tp_size = 1

    def __init__(self) -> None:
        self.released = threading.Event()

    def init_weights_update_group(self, **kw):
        self.released.wait(HANG_S)           # a hung server: answers late, never joined
        return {"success": False, "message": "gave up (injected)"}

    def destroy_weights_update_group(self, name):
        return {"success": True}


def _open_with_a_hung_engine(rank, world):
    from fsdp_sync.transport.update_group import EngineCalls, open_group

    cfg = SimpleNamespace(dist_timeout_s=2.0, dist_group_name="h7_hung_group", dist_backend=None,
                          dist_master_port=None, dist_master_address="127.0.0.1")
    engine = _NeverJoins()
    t0 = time.monotonic()
    try:
        open_group([engine], cfg, torch.device("cpu"), "gloo", EngineCalls())
        err = None
    except Exception as exc:  # noqa: BLE001 - the test reads it
        err = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    engine.released.set()
    return {"err": err, "seconds": seconds}


@pytest.mark.timeout(60)
def test_an_engine_that_never_joins_fails_the_group_within_dist_timeout_s():
    (res,) = run_ranks(_open_with_a_hung_engine, 1, timeout_s=50, env=spawn_env())
    assert res["err"] is not None and "dist_timeout_s=2.0" in res["err"], res
    assert res["seconds"] < 2.0 + 4.0 < HANG_S, res
