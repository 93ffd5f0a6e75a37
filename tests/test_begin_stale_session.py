"""A weight-update session left open by a trainer that died inside its sync (SGLang keeps running
with it open). Before, the tensor method treated the refused ``begin_weight_update`` ("a
weight-update session is already open") as fatal, so every later sync of a fresh trainer failed
(/tmp/audit/sglang3/session_left_open.out), while the distributed method aborted the old session
and began its own. Now both take over (`transport.sessions.begin`), with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

import fake_sglang as fake


def _rank(rank: int, world: int) -> dict:
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import make_mesh
    from fsdp_sync.weights.export import iter_params

    torch.set_num_threads(1)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("fsdp_sync").addHandler(Keep())
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), world)
    with fake.FakeSGLangServer(tp_size=1) as srv:
        sg.SGLangEngine(base_url=srv.url).begin_weight_update()     # the trainer that died in it
        eng = sg.SGLangEngine(base_url=srv.url)
        cfg = SyncConfig(dtype=torch.float32, method="tensor", memory_probe="off")
        manager = FSDPShardingManager(module, eng, mesh=make_mesh(1, world), config=cfg)
        errors = []
        for _ in range(2):
            try:
                with manager:
                    pass
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(f"{type(exc).__name__}: {exc}")
        manager.close()
        want = fake.digests(iter_params(module, dtype=torch.float32))
        return {"errors": errors, "warnings": warnings, "open": srv.engine.session_open,
                "match": fake.digests(srv.engine.weights.items()) == want,
                "begins": srv.hits.get("/begin_weight_update", 0)}


@pytest.mark.timeout(120)
def test_a_tensor_sync_takes_over_a_session_a_dead_trainer_left_open():
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    out = run_ranks(_rank, 1, timeout_s=100, env=spawn_env())[0]
    assert out["errors"] == [None, None], out["errors"]
    assert out["match"] and not out["open"]
    # the dead one's, ours refused, ours again after the abort; then the second sync's own
    assert out["begins"] == 4, out
    assert any("had a weight update open" in w and "aborting it" in w for w in out["warnings"]), out
