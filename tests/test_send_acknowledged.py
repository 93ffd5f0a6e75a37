"""`TensorTransport.send` (the path verl's adapter drives) fails a sync whose engine answered while
a consumer rank never acknowledged its payload, with no ``check=`` given too: an engine that
returns without opening what it was sent has not loaded the weights, and the sync must not count
as done ("never acknowledged"). One rank, an engine stub that answers without opening anything."""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank: int, world: int) -> str:
    import torch

    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport.tensor import Call, TensorTransport
    from fsdp_sync.weights import handles

    class Deaf:                         # answers every call without opening its payloads
        def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
            self.got = named

    topo = SyncTopology.from_mesh(make_mesh(1, 1))
    t = torch.arange(8, dtype=torch.float32)
    sets = [handles.make_payloads(t, 1, ranks=[0], tagged=True)]
    calls = iter([Call(sets, sets[0].payloads[0], lambda g: [("w", g[0])], None, True, "'w'")])
    try:
        TensorTransport().send(calls, topo=topo, engine=Deaf())
        return "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(120)
def test_send_without_check_fails_on_a_payload_nobody_acknowledged():
    (msg,) = run_ranks(_job, 1, timeout_s=90, pg_timeout_s=30, env=spawn_env())
    assert "never acknowledged" in msg, msg
