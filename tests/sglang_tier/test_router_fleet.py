"""SGLang's real router (sglang-router, installed by scripts/sglang_env.sh) in front of
`fsdp-sync serve` replicas while the trainer syncs: examples/fleet_router.py, small.

Checked by the example itself, from what the clients received: no request failed through a
replica kill, a replica added mid-run and a replica drained (its /health 503) and recovered;
every answer has all its tokens (one cut off by a replica taken out of service, finish reason
``abort``, is counted as aborted and sent again, not as served); every
``meta_info.weight_versions`` span names a version the whole fleet committed and the spans cover
every output token; the drained replica answered no generate request once the router had seen
its 503. Here: its exit code and its figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_router_fleet_under_load(tmp_path):
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "fleet_router.py"), "--replicas", "2",
                           "--syncs", "10", "--clients", "4", "--kill-at", "2", "--add-at", "4",
                           "--drain-at", "7", "--drain-s", "3", "--retry-backoff-s", "0.05",
                           "--json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["problems"] == [] and fig["failed"] == 0 and fig["served"] > 20, fig
    assert fig["served"] == fig["requests"] and fig["aborted"] >= 0, fig
    assert fig["versions_committed"] == 11 and fig["versions_seen"] >= 2, fig
    assert fig["quarantine_s"] is not None and fig["rejoin_s"] > 0, fig
    assert fig["drained_replica_requests"] == 0, fig
    states = {r["name"]: r for r in fig["fleet"]["replicas"]}
    assert sum(r["serving"] for r in states.values()) == 2, states     # 0 and the new one; 1 is dead


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fleet_router", ROOT / "examples" / "fleet_router.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(240)
def test_router_ports_taken_meanwhile(tmp_path, monkeypatch):
    """The router binds the ports it is told (it takes no 0), picked free by the example: one
    taken before the router binds it (here: the first pick answers a port another socket listens
    on) makes it exit, and the example starts it again on new ports; a port the user gave that
    is taken is an error naming it, with the router's own words, in seconds, not after 60 s."""
    import socket
    import time

    fleet = _example()
    replica = fleet.launch_replica(str(tmp_path))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        held = other.getsockname()[1]
        picks = []
        real = fleet.free_port

        def first_taken():
            picks.append(held if not picks else real())
            return picks[-1]

        try:
            url = fleet.replica_url(replica)
            monkeypatch.setattr(fleet, "free_port", first_taken)
            router, port = fleet.start_router([url])
            try:
                assert picks[0] == held and port not in (held, None) and len(picks) >= 4, picks
                status, body = fleet._get(f"http://127.0.0.1:{port}/workers")
                assert status == 200 and [w["url"] for w in body["workers"]] == [url], body
            finally:
                fleet.stop(router)
            monkeypatch.setattr(fleet, "free_port", real)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=f"1 tries.*port {held}: .*Address already in use"):
                fleet.start_router([url], port=held)
            assert time.monotonic() - t0 < 30
        finally:
            fleet.stop(replica)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_the_example_stops_what_it_started(sig, tmp_path):
    """The example stopped mid-run by SIGTERM (``timeout``, a CI job's cancel, a batch scheduler)
    stops the router and the replicas with their workers and removes its checkpoint directory;
    a SIGKILL of it takes the router and the replicas with it too. Before, both left the router,
    the replicas and their workers running for good (each in a session of its own), and SIGTERM
    left the directory too."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "fleet_router.py"), "--replicas", "2",
                             "--syncs", "100000", "--clients", "1", "--kill-at", "-1", "--add-at", "-1",
                             "--drain-at", "-1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        disk = None
        while time.monotonic() < deadline and proc.poll() is None:   # syncing behind the router
            disks = list(tmp_path.glob("fsdp_sync-fleet-*"))
            if disks and any(disks[0].iterdir()):
                disk = disks[0]
                break
            time.sleep(0.3)
        assert disk is not None, f"the example did not sync within 150 s (exit {proc.poll()})"
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "sglang::router" in names and names.count("fsdp_sync.cli serve") == 2, names
        proc.send_signal(sig)
        proc.wait(timeout=90)
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + sig and not disk.exists(), (proc.returncode, disk)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in started:
            try:
                p.kill()
            except psutil.Error:
                pass
