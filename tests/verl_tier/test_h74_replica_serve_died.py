"""The ``fsdp_sync_ref`` replica's server actor when its ``fsdp-sync serve`` child has died (audit
H74): a call verl makes (``generate``) fails naming the replica, serve's exit code and its log,
not as a connection error to a URL that says nothing of a dead process. A live serve's own error
is raised as it is."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from test_verl_replica import _config, _model

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]


def test_a_call_after_serve_died_names_the_replica_its_exit_code_and_log(tmp_path):
    from fsdp_sync.engines.sglang.client import HttpClient
    from fsdp_sync.integrations.verl.replica import ServeServer

    server = ServeServer(_config(tensor_model_parallel_size=1), _model(tmp_path), replica_rank=2,
                         node_rank=0, log_dir=str(tmp_path))
    server.http = HttpClient("http://127.0.0.1:1", api_key=None, timeout_s=5.0, max_retries=0,
                             backoff_s=0.1, backoff_max_s=0.1, proxies=None)
    server.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    server.proc.wait(30)
    with pytest.raises(RuntimeError, match=(
            rf"^fsdp_sync_ref replica 2 node 0: its fsdp-sync serve \(pid {server.proc.pid}\) exited "
            rf"with code 3, so /generate failed \(.*\); see its log .*fsdp_sync_serve_2_0\.log$")):
        asyncio.run(server.generate([1, 2], {}, "r1"))
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:       # serve alive: its error as it is
        with pytest.raises(Exception) as info:
            asyncio.run(server.generate([1, 2], {}, "r2"))
        assert "exited with code" not in str(info.value)
    finally:
        server.proc.kill()
        server.proc.wait(30)
        server.proc = None
