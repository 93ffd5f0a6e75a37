"""`fsdp-sync serve` and signals: a SIGTERM while the engine starts ends serve and its TP workers
within seconds, with no traceback (before, the workers waited about a minute for serve's store,
then printed two tracebacks each); a SIGKILL of serve takes its workers with it, a stopped one too
(before, that one was left stopped for good)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from _util import ROOT


def _serve(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FSDP_SYNC_WORKERS_START", None)    # fresh interpreters, as a user's serve starts them
    return subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--port", "0", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _workers(proc: subprocess.Popen, n: int, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if any("fsdp_sync-engine-tp" in a for a in p.cmdline()):
                    found.append(p)
            except psutil.Error:
                pass
        if len(found) == n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"serve did not start {n} workers within {timeout_s}s")


def _end(proc: subprocess.Popen, workers: list[psutil.Process]) -> None:
    for p in workers:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(workers, timeout=10)
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_sigterm_while_starting_stops_serve_and_its_workers_at_once():
    proc = _serve("--tp", "2")
    workers: list[psutil.Process] = []
    try:
        workers = _workers(proc, 2, 60)
        time.sleep(0.5)                 # importing torch, or waiting for the TP store
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # the workers share serve's stdout: it ends when the last of them is gone too
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, alive
        assert "http://" not in out, out              # the signal came during start-up
        assert proc.returncode == 0, (proc.returncode, out)
        assert "Traceback" not in out and "Error" not in out, out
        assert took < 10, f"serve's output ended {took:.1f}s after the SIGTERM: {out}"
    finally:
        _end(proc, workers)


@pytest.mark.timeout(120)
def test_sigkill_of_serve_takes_its_workers_stopped_or_not():
    proc = _serve("--tp", "2")
    workers: list[psutil.Process] = []
    try:
        line, deadline = "", time.monotonic() + 90
        while "http://" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "http://" in line, line
        workers = _workers(proc, 2, 10)
        stopped = next(p for p in workers if "fsdp_sync-engine-tp1" in p.cmdline())
        stopped.send_signal(signal.SIGSTOP)
        proc.kill()                     # a supervisor's SIGKILL: nothing of serve's runs
        proc.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [(p.pid, p.status()) for p in alive]
    finally:
        _end(proc, workers)
