"""A served engine whose worker died says so, as SGLang's server does: `/health`, `/ready` and every
route answer 503 naming the dead TP rank, `fsdp-sync serve` exits non-zero, and a manager syncing into
it over HTTP raises on every trainer rank (issue 21, item 1: /health stayed 200 forever)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.engines.reference.serve import EngineServer
from _util import start_serve

ROOT = Path(__file__).resolve().parent.parent


def _req(url_host: str, port: int, method: str, path: str, obj=None) -> tuple[int, object]:
    conn = http.client.HTTPConnection(url_host, port, timeout=30)
    try:
        body = None if obj is None else json.dumps(obj).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    finally:
        conn.close()


def _manager_into(rank: int, world: int, url: str) -> dict:
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    mesh = make_mesh(1, world)
    src = SyncTopology.from_mesh(mesh).is_tp_src
    engine = SGLangEngine(base_url=url, tp_size=2, max_retries=0, timeout_s=30) if src else None
    manager = FSDPShardingManager(module, engine, mesh=mesh,
                                  config=SyncConfig(dtype=torch.float32, strategy="flattened"))
    t0 = time.monotonic()
    try:
        with manager:
            return {"error": None}
    except SyncError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    finally:
        manager.close()


@pytest.mark.timeout(150)
def test_dead_worker_turns_every_route_503_and_every_trainer_rank_raises():
    with ReferenceEngine("tiny", tp_size=2, seed=1) as eng, EngineServer(eng) as srv:
        for path in ("/health", "/ready", "/health_generate"):
            assert _req(srv.host, srv.port, "GET", path)[0] == 200, path
        os.kill(eng.worker_pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _req(srv.host, srv.port, "GET", "/health")[0] == 200:
            assert time.monotonic() < deadline, "/health still 200 10 s after a worker was killed"
            time.sleep(0.05)
        for method, path, body in (("GET", "/health", None), ("GET", "/ready", None),
                                   ("GET", "/health_generate", None),
                                   ("POST", "/generate", {"input_ids": [1, 2]}),
                                   ("POST", "/flush_cache", {})):
            status, out = _req(srv.host, srv.port, method, path, body)
            assert status == 503, (path, status, out)
            assert "TP rank 1" in out["message"] and "SIGKILL" in out["message"], (path, out)
        assert _req(srv.host, srv.port, "GET", "/no_such_route")[0] == 404

        results = run_ranks(_manager_into, 2, srv.url, timeout_s=120, env=spawn_env())
        msgs = [r["error"] for r in results]
        assert msgs[0] is not None and msgs[0] == msgs[1], msgs    # every rank, the same error
        assert "dead" in msgs[0] and "TP rank 1" in msgs[0], msgs[0]
        assert all(r["seconds"] < 60 for r in results), results


@pytest.mark.timeout(150)
def test_serve_command_exits_nonzero_when_a_worker_dies():
    proc, _ = start_serve("--tp", "2", stderr=subprocess.PIPE)
    try:
        workers = {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)
                   if any("fsdp_sync-engine-tp" in a for a in p.cmdline())}
        tp1 = [p for p in workers.values() if "fsdp_sync-engine-tp1" in p.cmdline()]
        assert len(workers) == 2 and len(tp1) == 1, [p.cmdline() for p in workers.values()]
        tp1[0].send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, (proc.returncode, out, err)
        assert "engine is dead" in err and "TP rank 1" in err and "SIGKILL" in err, err
        gone, alive = psutil.wait_procs(list(workers.values()), timeout=10)
        assert not alive, alive                                  # the other worker was stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
