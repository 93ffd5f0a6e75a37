"""``fsdp-sync faults`` as a user runs it (H43's audit): a Ctrl-C while a cell runs ends the cell's
processes and removes its temp directory; the verdicts of the matrix, the fleet cells and the soak
(a cell or a process that broke a rule is reported failed, and the exit code says so).

In process: the cell's ranks are forked stand-ins that sleep (no torch, no process group), the
fleet's engines and the soak's job are replaced by what they would have measured."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from fsdp_sync.cli import faults, faults_cell, launch


def _sleeping_rank(rank, world, port, backend, pg_timeout_s, fn, args, results, env):
    """A rank that got stuck (a stalled victim sleeps an hour): it starts an "engine worker" (a
    child of its own), writes both pids where a cell's rank does (``<tmp>/pids``) and sleeps."""
    tmp = args[1]
    child = subprocess.Popen(["sleep", "3600"])
    with open(os.path.join(tmp, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n{child.pid}\n")
    time.sleep(3600)


class _InterruptedQueue:
    """The cell's result queue, read as Ctrl-C arrives: once every stand-in wrote its pids."""

    def __init__(self, tmp_root, seen: list):
        self.tmp_root, self.seen = tmp_root, seen

    def get(self, timeout=None):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(_pids(self.tmp_root)) == 4:
                self.seen += _pids(self.tmp_root)
                raise KeyboardInterrupt
            time.sleep(0.02)
        raise AssertionError("the stand-in ranks did not start")

    def close(self):
        pass

    def join_thread(self):
        pass


def _pids(root) -> list[int]:
    out = []
    for f in root.glob("fsdp_sync_fault_*/pids"):
        out += [int(x) for x in f.read_text().split()]
    return out


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_cell_ends_its_processes_and_removes_its_temp_dir(tmp_path, monkeypatch):
    """Before: `run_cell` started its ranks outside any try; a Ctrl-C that reached fsdp-sync alone
    (``kill -INT``, a supervisor) printed "interrupted", then the interpreter's exit waited for the
    non-daemon ranks: a stalled trainer rank sleeps an hour, so the command hung with it alive,
    and the cell's temp directory (its disk checkpoint) stayed in /tmp (a terminal's Ctrl-C left
    the directory too)."""
    import multiprocessing
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))          # the cell's mkdtemp lands here
    fork = multiprocessing.get_context("fork")
    seen: list[int] = []

    class Ctx:
        Process = fork.Process

        def Queue(self):
            return _InterruptedQueue(tmp_path, seen)

    monkeypatch.setattr(launch, "_context", lambda: Ctx())
    monkeypatch.setattr(launch, "_worker", _sleeping_rank)
    try:
        with pytest.raises(KeyboardInterrupt):
            faults_cell.run_cell(faults.Cell("disk", "prepare", "trainer1", "stall"))
        left = faults_cell._alive(seen)
        dirs = list(tmp_path.glob("fsdp_sync_fault_*"))
    finally:
        for p in faults_cell._alive(seen):
            os.kill(p, signal.SIGKILL)
        for c in multiprocessing.active_children():
            c.join(timeout=5)
    assert len(seen) == 4 and not left, f"left running: {left} of {seen}"
    assert not dirs, f"the cell's temp directory stayed: {dirs}"
