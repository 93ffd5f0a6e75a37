"""A fleet of ``fsdp-sync serve`` replicas behind SGLang's router, synced while clients generate.

    pip install sglang-router            # `make test-sglang` puts it in .venv-sglang
    python examples/fleet_router.py --replicas 2 --syncs 50 --clients 8 --kill-at 15 --add-at 30

What runs: N replicas (`fsdp-sync serve`, the tiny model, each its own process), SGLang's router
in front of them (``--worker-urls``), C client threads sending ``/generate`` through the router for
the whole run, and a one-process trainer whose `FSDPShardingManager` holds one `SGLangEngine` per
replica (``method="disk"``, ``on_replica_failure="quarantine"``, ``pause_mode="in_place"``) and
syncs after every "training step". At ``--kill-at`` replica 1 is SIGKILLed (the fleet quarantines
it at the next sync; the router drops it when its /health fails); at ``--add-at`` a new replica
starts, `manager.add_engine` brings it to the current version, and only then is it handed to the
router (``POST /workers``); at ``--drain-at`` replica 0 is taken out of service by the manager
(`manager.quarantine`: its /health answers 503) and, ``--drain-s`` later, brought back
(`manager.recover`).

Checked at the end and written as JSON (``--json``): requests served and failed, every span
(``meta_info.weight_versions``) naming only versions the fleet committed, responses whose tokens
came from two versions, generate requests the drained replica answered after the router could
have seen its 503, time to quarantine, time to rejoin. Exit code 1 when any check fails.

Taking a replica out of service (the drain, the kill's quarantine) cuts off its running requests:
they answer 200 with ``finish_reason`` ``abort`` and the tokens they had. The clients count those
(``aborted``: not served) and send each again, as a client of SGLang must (the router sends it to
a replica in service); a response short of its tokens for any other reason is a problem.

Stopping it (Ctrl-C, SIGTERM: what ``timeout``, a CI job's cancel or a batch scheduler sends)
stops the router and the replicas and removes the checkpoint directory; a SIGKILL of it takes
them with it too (Linux: each child gets SIGTERM when this process dies).
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from fsdp_sync.wire import free_port

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 24         # each client request's max_new_tokens (ignore_eos: every answer has them all)

# the children are in sessions of their own (so that `stop` ends each with its workers), where a
# signal to this process's group does not reach them: on Linux each is told to get SIGTERM when
# this process dies, SIGKILLed included (prctl PR_SET_PDEATHSIG, resolved before any fork: the
# child runs only this one foreign call, client threads or not)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    _PRCTL(1, signal.SIGTERM)     # PR_SET_PDEATHSIG; Popen's caller is the main thread throughout


def _post(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _get(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def launch_replica(disk_dir: str) -> subprocess.Popen:
    """``fsdp-sync serve`` on a free port, in a session of its own (killed as a group); its URL
    comes from `replica_url`, so that several start at once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--model", "tiny",
                             "--tp", "1", "--port", "0", "--allowed-disk-dir", disk_dir],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent if _PRCTL else None)


def replica_url(proc: subprocess.Popen) -> str:
    """The URL a launched replica serves on, once it does (its first line that names one)."""
    line, deadline = "", time.monotonic() + 120
    while "http://" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"fsdp-sync serve did not start: {line!r}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()   # drain its log
    return line.split(" on ", 1)[1].split()[0]


def start_replica(disk_dir: str) -> tuple[subprocess.Popen, str]:
    proc = launch_replica(disk_dir)
    return proc, replica_url(proc)


def start_router(urls: list[str], port: int = 0, attempts: int = 5) -> tuple[subprocess.Popen, int]:
    """SGLang's router in front of ``urls``, on ``port`` (0: a free one); returns it and its port
    once it lists every replica healthy.

    The router binds the ports it is told (its own and its Prometheus exporter's; it takes no 0),
    so they are picked free here and another process may take one before the router binds it. A
    router that exits for an address in use is started again on new ports (``port``, when given,
    is kept: then only the exporter's can be the one taken), up to ``attempts`` times; any other
    exit is an error with the router's own last words."""
    # SGLang's own launcher (``python -m sglang_router.launch_router``) as it runs where only
    # sglang-router is installed: its Python load balancer's optional tracing import would
    # otherwise import all of sglang (torch, transformers: ~8 s of CPU) for a router that is Rust
    launch = ("import sys; sys.modules['sglang'] = None; "
              "from sglang_router.launch_router import main; main()")
    tries = []
    for _ in range(attempts):
        here = port or free_port()
        with tempfile.TemporaryFile() as log:    # unlinked: nothing is left on disk
            proc = subprocess.Popen([sys.executable, "-c", launch, "--worker-urls", *urls,
                                     "--host", "127.0.0.1", "--port", str(here), "--policy", "round_robin",
                                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                     "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                                     "--log-level", "error"],
                                    stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                    preexec_fn=_die_with_parent if _PRCTL else None)
            try:
                up = _router_up(proc, f"http://127.0.0.1:{here}", len(urls))
            except BaseException:
                stop(proc)          # its own session: nothing else would stop it
                raise
            if up:
                return proc, here
            log.seek(0)
            said = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        last = said[-1] if said else f"exit status {proc.returncode}"
        tries.append(f"port {here}: {last}")
        taken = any("Address already in use" in ln for ln in said)
        exporter = any("Prometheus" in ln for ln in said)
        if not taken or (port and not exporter):
            break
    raise RuntimeError(f"the router did not start ({len(tries)} tries): " + "; ".join(tries))


def _router_up(proc: subprocess.Popen, router: str, replicas: int, wait_s: float = 60.0) -> bool:
    """True once ``router`` lists ``replicas`` healthy workers; False when the router exited first;
    RuntimeError (the router killed) when neither happened within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            status, body = _get(router + "/workers")
            healthy = status == 200 and sum(w["is_healthy"] for w in body["workers"]) == replicas
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException):
            healthy = False     # not up yet, or not a router answering there
        if healthy and proc.poll() is None:     # ours, still running: not another on the port
            return True
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"the router at {router} did not list every replica healthy within {wait_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Clients:
    """``n`` threads sending /generate through the router until `stop` (or ``max_requests`` each)."""

    def __init__(self, router: str, n: int, max_requests: int, seed: int = 0) -> None:
        self.router, self.results, self.lock = router, [], threading.Lock()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(seed + i, max_requests), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, seed: int, max_requests: int) -> None:
        rng = random.Random(seed)
        for _ in range(max_requests):
            if self.done.is_set():
                return
            prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(2, 8))]
            t0, aborted = time.monotonic(), 0
            while True:
                try:
                    status, body = _post(self.router + "/generate", {
                        "input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                                 "temperature": 0, "ignore_eos": True}})
                except OSError as exc:
                    status, body = 0, {"error": str(exc)}
                meta = body.get("meta_info", {}) if status == 200 else {}
                finish = (meta.get("finish_reason") or {}).get("type")
                if finish != "abort" or aborted == 3:
                    break
                aborted += 1    # cut off: its replica was taken out of service. Send it again
            with self.lock:
                self.results.append({"status": status, "t0": t0, "t1": time.monotonic(),
                                     "n": len(body.get("output_ids", [])) if status == 200 else 0,
                                     "finish": finish, "aborted": aborted,
                                     "spans": meta.get("weight_versions"),
                                     "error": None if status == 200 and finish != "abort"
                                     else str(body)[:200]})

    def stop(self) -> list[dict]:
        self.done.set()
        for t in self.threads:
            t.join(120)
        return self.results


def tally(results: list[dict], committed: set[str], problems: list[str]) -> dict:
    """The clients' figures (`Clients.stop`'s results); what is wrong is added to ``problems``.
    Served: answered 200 with every token asked; an answer cut off (finish reason ``abort``) is
    not served (sent again, it is counted once, as what its last try got)."""
    ok = [r for r in results if r["status"] == 200 and r["finish"] != "abort"]
    spans = [s for r in ok for s in (r["spans"] or [])]
    seen = sorted({s["version"] for s in spans}, key=lambda v: (v != "default", int(v) if v.isdigit() else -1))
    out = dict(requests=len(results), served=len(ok), failed=len(results) - len(ok),
               failures=[r["error"] for r in results if r["error"] is not None][:5],
               aborted=sum(r["aborted"] for r in results),
               versions_committed=len(committed), versions_seen=len(seen),
               multi_version_responses=sum(len(r["spans"] or []) > 1 for r in ok),
               tokens=sum(r["n"] for r in ok))
    if out["failed"]:
        problems.append(f"{out['failed']} requests failed: {out['failures']}")
    short = [(r["n"], r["finish"]) for r in ok if r["n"] != NEW_TOKENS or r["finish"] != "length"]
    if short:
        problems.append(f"{len(short)} responses came short of {NEW_TOKENS} tokens (tokens, "
                        f"finish reason): {short[:5]}")
    if not set(seen) <= committed:
        problems.append(f"spans name versions never committed: {sorted(set(seen) - committed)}")
    if any(r["spans"] is None or sum(s["end"] - s["start"] for s in r["spans"]) != r["n"] for r in ok):
        problems.append("a response's spans do not cover its tokens")
    return out


def main(argv: list[str] | None = None) -> int:
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.models import build_model, load_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--syncs", type=int, default=50)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=15, help="sync before which replica 1 is SIGKILLed (-1: never)")
    p.add_argument("--add-at", type=int, default=30, help="sync before which a replica is added (-1: never)")
    p.add_argument("--drain-at", type=int, default=40, help="sync after which replica 0 is quarantined (-1: never)")
    p.add_argument("--drain-s", type=float, default=4.0, help="how long replica 0 stays out of service")
    p.add_argument("--router-port", type=int, default=0, help="0: a free port")
    p.add_argument("--max-requests", type=int, default=2000, help="per client")
    p.add_argument("--retry-backoff-s", type=float, default=0.5,
                   help="SGLangEngine's retry_backoff_s (doubling, 3 retries): the killed replica "
                        "is probed again at every sync and waits it out (0.5 + 1 + 2 s)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.replicas < 2:
        p.error("--replicas must be >= 2 (one is killed)")

    # SIGTERM ends it as Ctrl-C does: through the `finally` that stops the children
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    disk = tempfile.mkdtemp(prefix="fsdp_sync-fleet-")
    procs: list[subprocess.Popen] = []
    router = None
    out: dict = {"replicas": a.replicas, "syncs": a.syncs, "clients": a.clients}
    problems: list[str] = []
    try:
        for _ in range(a.replicas):                                    # all start at once
            procs.append(launch_replica(disk))
        module = build_model(load_config("tiny"), seed=0)              # meanwhile, the trainer's
        urls = [replica_url(pr) for pr in procs]
        router, port = start_router(urls, a.router_port)
        router_url = f"http://127.0.0.1:{port}"
        engines = [SGLangEngine(base_url=u, retry_backoff_s=a.retry_backoff_s) for u in urls]
        cfg = SyncConfig(method="disk", disk_dir=disk, disk_keep=3, on_replica_failure="quarantine",
                         pause_mode="in_place")
        manager = FSDPShardingManager(module, engines, config=cfg)
        clients = Clients(router_url, a.clients, a.max_requests)
        committed, t_kill, t_drain, added = {"default"}, None, None, None
        drained_hits = None
        for step in range(a.syncs):
            if step == a.kill_at:
                os.killpg(procs[1].pid, signal.SIGKILL)
                t_kill = time.monotonic()
            if step == a.add_at:
                t_add = time.monotonic()
                proc, url = start_replica(disk)
                procs.append(proc)
                added = SGLangEngine(base_url=url, retry_backoff_s=a.retry_backoff_s)
                manager.add_engine(added)                     # the current version first
                _post(router_url + "/workers", {"url": url})  # then the router
                out["rejoin_s"] = round(time.monotonic() - t_add, 2)
            with torch.no_grad():                             # a "training step"
                for prm in module.parameters():
                    prm.add_(0.001 * torch.randn_like(prm))
            with manager:
                pass
            committed.add(manager.version)
            if t_kill is not None and "quarantine_s" not in out:
                rep = manager.fleet.replicas[1]
                if rep.quarantined_at is not None:
                    out["quarantine_s"] = round(rep.quarantined_at - t_kill, 2)
            if step == a.drain_at:
                manager.quarantine(engines[0], "drained by the example")
                t_drain = time.monotonic()
                time.sleep(2.5)                               # the router's health check: 1 s x 1
                before = engines[0].server_info().get("generate_requests", 0)
                time.sleep(a.drain_s)
                drained_hits = engines[0].server_info().get("generate_requests", 0) - before
                manager.recover(engines[0])
                out["drain_recover_s"] = round(time.monotonic() - t_drain, 2)
        results = clients.stop()
        status = manager.fleet_status()
        manager.close()
        out.update(tally(results, committed, problems), drained_replica_requests=drained_hits,
                   fleet=status)
        if drained_hits:
            problems.append(f"the drained replica answered {drained_hits} generate requests after its /health turned 503")
        if a.kill_at >= 0 and "quarantine_s" not in out:
            problems.append("the killed replica was never quarantined")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second one must not cut the clean-up short
        if router is not None:
            stop(router)
        for pr in procs:
            stop(pr)
        shutil.rmtree(disk, ignore_errors=True)     # the versions the fleet loaded from
    out["problems"] = problems
    print(json.dumps({k: v for k, v in out.items() if k != "fleet"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
