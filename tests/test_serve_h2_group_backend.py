"""``/init_weights_update_group`` without ``backend`` joins with SGLang's default (audit H2).

SGLang 0.5.23's ``InitWeightsUpdateGroupReqInput.backend`` defaults to ``"nccl"``: a trainer that
follows SGLang's protocol and leaves it out builds an NCCL group. Serve defaulted to gloo, so on a
CUDA engine its workers joined with another backend than the trainer's (a failed or hung
rendezvous); now a CUDA engine (which joins NCCL) takes NCCL, a CPU engine its only one, gloo.
"""

from __future__ import annotations

import http.client
import json

import pytest

from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(60)


class GroupEngine:
    """A stand-in with the update-group surface of a reference engine on ``device``."""

    tp_size = 1

    def __init__(self, device: str) -> None:
        self.device = device
        self.update_group_backends = ("nccl", "gloo") if device == "cuda" else ("gloo",)
        self.joined: list[str] = []

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self.joined.append(backend)


def init(srv, **extra):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                "world_size": 2, **extra}
        conn.request("POST", "/init_weights_update_group", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("device, want", [("cuda", "nccl"), ("cpu", "gloo")])
def test_a_missing_backend_is_sglangs_default_where_the_engine_joins_it(device, want):
    eng = GroupEngine(device)
    with EngineServer(eng) as srv:
        assert init(srv)[0] == 200
        assert eng.joined == [want]                     # before: gloo on CUDA too
        assert init(srv, backend="gloo")[0] == 200 and eng.joined[-1] == "gloo"
        status, out = init(srv, backend="mpi")
        assert status == 400 and "'backend'" in out["message"], out
