"""Rendezvous ports. CI failed once (`make test`, the demo on a group without a CPU backend) with
rank 0 of the demo's job raising EADDRINUSE in ``init_process_group``: the launcher had picked a
free port (bind port 0, close it) and rank 0 bound it again a moment later; in between, another
process on the busy machine took it. Every rendezvous we host now listens before its port is
handed out (`wire.host_store`), and the members join it as clients.

The race is made certain here: every `free_port` of the process answers a port that another socket
is listening on, which is what the gap let happen. Before the fix each of these failed with
"address already in use"."""

from __future__ import annotations

import errno
import socket
import sys
import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _take_every_free_port(monkeypatch, port: int) -> None:
    """Every `free_port` this process calls (by module attribute or through `fsdp_sync.wire`)
    answers ``port``."""
    import fsdp_sync.cli.faults  # noqa: F401 - import what uses it, so its names are patched too
    import fsdp_sync.cli.launch  # noqa: F401
    import fsdp_sync.engines.reference.engine  # noqa: F401
    import fsdp_sync.transport.distributed  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if name.startswith("fsdp_sync") and hasattr(mod, "free_port"):
            monkeypatch.setattr(mod, "free_port", lambda: port)


@pytest.fixture
def taken_port(monkeypatch):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        _take_every_free_port(monkeypatch, port)
        yield port


def test_a_hosted_store_holds_its_port_from_the_start_and_gives_it_back():
    from fsdp_sync.wire import host_store, join_store

    store = host_store(2, 60)
    port = store.port
    with socket.socket() as s, pytest.raises(OSError) as held:
        s.bind(("127.0.0.1", port))
    assert held.value.errno == errno.EADDRINUSE
    client = join_store("127.0.0.1", port, 2, 60)
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    deadline = time.monotonic() + 5
    while True:                       # released: this process can listen there again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is not held
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} still held after the store went"
                time.sleep(0.1)


def _sum_of_ranks(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(120)
def test_run_ranks_does_not_depend_on_a_port_staying_free(taken_port):
    assert run_ranks(_sum_of_ranks, 2, timeout_s=90, pg_timeout_s=30, env=spawn_env()) == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_the_reference_engines_tp_workers_do_not_either(taken_port):
    from fsdp_sync.engines.reference import ReferenceEngine

    with ReferenceEngine("tiny", tp_size=2, seed=1, kv_cache_tokens=64) as engine:
        out = engine.generate([[1, 2, 3]], max_new_tokens=2)
        assert len(out) == 1 and len(out[0]) == 2, out


def _distributed_sync_with_taken_ports(rank, world):
    """One trainer rank, the engine (TP 2) in this process, the distributed method's update group
    hosted by this rank: every `free_port` here answers a port another socket listens on."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp, socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        _take_every_free_port(mp, other.getsockname()[1])
        module = build_model(load_config("tiny"), seed=4)
        with ReferenceEngine("tiny", tp_size=2, seed=9, kv_cache_tokens=64) as engine:
            before = engine.weights_checksum()
            manager = FSDPShardingManager(module, engine, config=SyncConfig(
                method="distributed", dtype=torch.float32, dist_timeout_s=60))
            try:
                with manager:
                    pass
            finally:
                manager.close()
            want = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
            return {"before": before, "after": engine.weights_checksum(), "trainer": want}


@pytest.mark.timeout(150)
def test_the_distributed_methods_update_group_does_not_either():
    (res,) = run_ranks(_distributed_sync_with_taken_ports, 1, timeout_s=120, env=spawn_env())
    assert res["after"] == res["trainer"] != res["before"], res


def test_only_rank_0_may_bring_the_update_groups_store():
    from fsdp_sync.wire import host_store, new_update_group

    store = host_store(2, 60)
    with pytest.raises(ValueError, match="rank 1 was given one"):
        new_update_group(backend="gloo", master_address="127.0.0.1", master_port=store.port,
                         world_size=2, rank=1, group_name="g", timeout_s=5, store=store)


_TORCHRUN_STYLE = """
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item())
dist.destroy_process_group()
"""


def _torchrun_style_ranks(envs: list[dict]) -> list[tuple[int, str]]:
    import subprocess

    from fsdp_sync.engines.reference.procs import worker_env

    base = worker_env()          # this process's environment without a launcher's rank variables
    procs = [subprocess.Popen([sys.executable, "-c", _TORCHRUN_STYLE], env=dict(base, **e),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    out = []
    try:
        for p in procs:
            out.append((p.wait(90), p.stdout.read()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            p.stdout.close()
    return out


@pytest.mark.timeout(150)
def test_torchrun_style_ranks_join_the_store_their_launcher_hosts():
    """`wire.agent_store_env`: how examples/ray_launch.py (and the verl tier's Ray workers) start
    ranks that call ``init_process_group`` with ``env://``: the launcher hosts the store before any
    rank starts and every rank joins it as a client (torchrun's agent-store protocol), so no rank
    binds ``MASTER_PORT`` seconds after it was picked. Without that protocol rank 0 binds the port
    itself, which here another socket (the hosted store) holds: EADDRINUSE, what a port picked free
    and taken meanwhile did."""
    from fsdp_sync.wire import agent_store_env, host_store

    store = host_store(2, 60)
    env = agent_store_env(store)
    assert env["MASTER_PORT"] == str(store.port) and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    ranks = _torchrun_style_ranks([dict(env, RANK=str(r), WORLD_SIZE="2") for r in range(2)])
    assert [rc for rc, _ in ranks] == [0, 0], ranks
    assert all("sum 3.0" in text for _, text in ranks), ranks

    (rc, text), = _torchrun_style_ranks([{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                          "MASTER_PORT": str(store.port)}])
    assert rc != 0 and "EADDRINUSE" in text, text
