"""Test-wide rules: GPU tests skip cleanly without CUDA, and no test may leave behind a running
child process or a new ``/dev/shm/torch_*`` shared-memory segment."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import psutil
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import shm_segments  # noqa: E402

# rank jobs fork from one server that imported torch/transformers/fsdp_sync once (`cli.launch`):
# the suite runs dozens of small jobs, and each spawned rank would import them again
os.environ.setdefault("FSDP_SYNC_RANKS_START", "forkserver")
os.environ.setdefault("FSDP_SYNC_WORKERS_START", "forkserver")   # engine workers: see engines/reference/procs

# Long-lived helpers that torch and multiprocessing start once per process, by design.
_HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _is_helper(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return True   # already gone
    return any(h in cmd for h in _HELPERS)


def _children() -> dict[int, psutil.Process]:
    kids = {}
    for p in psutil.Process().children(recursive=True):
        if not _is_helper(p):
            kids[p.pid] = p
    return kids


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fail a test that leaves child processes running or new torch shared-memory segments."""
    with checked_for_leftovers():
        yield


@contextlib.contextmanager
def checked_for_leftovers():
    """Fail if the block leaves child processes running or new torch shared-memory segments.

    ``no_leftovers`` wraps every test in it; a module-scoped fixture that launches ranks for
    several tests at once wraps its launch in it too, since it runs before any test's check
    begins: it asks for the `leftovers_check` fixture (``from conftest import`` would find
    another directory's conftest module when the whole tree is collected)."""
    kids_before = set(_children())
    shm_before = shm_segments()
    yield
    leftovers = [p for pid, p in _children().items() if pid not in kids_before]
    if leftovers:
        _, alive = psutil.wait_procs(leftovers, timeout=3.0)   # a child on its way out
        leftovers = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    new_shm = shm_segments() - shm_before
    if new_shm:
        gc.collect()   # a segment held only by a garbage cycle is not a leak of the test
        # torch_shm_manager unlinks the segments of a process that exited once its last client
        # is gone: on a loaded machine that takes a few seconds
        deadline = time.monotonic() + 5.0
        while (new_shm := shm_segments() - shm_before) and time.monotonic() < deadline:
            time.sleep(0.05)
    problems = []
    if leftovers:
        desc = []
        for p in leftovers:
            try:
                desc.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()   # a child of this test: ours to end
            except psutil.Error:
                pass
        problems.append(f"left {len(leftovers)} child process(es) running: {desc}")
    if new_shm:
        def owner(seg: str) -> str:   # torch_<creator pid>_<random>_<n>
            pid = seg.split("_")[1]
            return f"{seg} (creator {pid} {'alive' if psutil.pid_exists(int(pid)) else 'exited'})"

        problems.append(f"left {len(new_shm)} /dev/shm segment(s): "
                        f"{[owner(s) for s in sorted(new_shm)[:8]]}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def leftovers_check():
    """`checked_for_leftovers`, for module-scoped fixtures that launch ranks for several tests."""
    return checked_for_leftovers
