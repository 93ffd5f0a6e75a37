"""Test-wide rules: GPU tests skip cleanly without CUDA, and no test may leave behind a running
child process, a new ``/dev/shm/torch_*`` shared-memory segment or a new temporary file or
directory (each test process gets a temporary directory of its own, ``TMPDIR`` for every child it
starts, so what a test leaves there is its own)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
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

# torch's TCPStore looks up the name of every peer it accepts (getnameinfo of ::ffff:127.0.0.1,
# which /etc/hosts does not list, so a DNS query). These machines' DNS drops about 2% of queries,
# and glibc waits 5 s before asking again: measured, 15 of 200 store openings took 5.01 s, and the
# suite makes hundreds of rendezvous (192 lookups in test_distributed.py + test_faults.py). Waiting
# 1 s per try instead (resolv.conf's options, per process: RES_OPTIONS) changes no result, only
# how long a lost query holds up a rendezvous; see docs/reliability.md for users' machines.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

# One temporary directory per test process (xdist worker), inherited by everything it starts
# (ranks, engine workers, torchrun, servers): a test's leftovers there are the test's own.
# pytest's tmp_path stays where it was: sockets (AF_UNIX, 108 bytes) are made under test paths
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
_TMP_ROOT = tempfile.mkdtemp(prefix=f"fst_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_",
                             dir=os.environ["PYTEST_DEBUG_TEMPROOT"])   # not inside xdist's controller's
os.environ["TMPDIR"] = _TMP_ROOT
tempfile.tempdir = None   # gettempdir() reads TMPDIR again
# what lives across tests by design: pytest's tmp_path root, multiprocessing's forkserver and
# manager sockets and torch_shm_manager's (removed by their owner at exit), torch's compile cache,
# Ray's session root (its logs: Ray never removes it); all go with the directory at the end
_TMP_KEPT = ("pytest-of-", "pymp-", "torch-shm-dir-", "torchinductor_", "ray")

# Long-lived helpers that torch and multiprocessing start once per process, by design.
_HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


# The modules that hold a test of 20 s or more on 2 busy cores (`make test`'s --durations), its
# longest first: they start first, so that the run's last minutes are short tests that even out
# between the two xdist workers, not one worker finishing a long one while the other idles. Each
# module's tests stay together and in their order (module-scoped fixtures); the others follow as
# collected.
START_FIRST = ("test_moe.py", "test_lora_sync.py", "test_distributed.py", "test_bench.py",
               "test_nccl_only_group.py", "test_demo_methods.py", "test_manager.py", "test_launchers.py",
               "test_plan.py", "test_faults.py", "test_layout_engine.py", "test_fp8_sync.py",
               "test_readme.py", "test_cli_args.py", "test_config_check.py", "test_lora_engine.py",
               "test_engine_lifecycle.py")


def pytest_sessionstart(session):
    """Each xdist worker imports every test module, and pytest rewrites each one's asserts before
    that (6 to 9 s of a core for this tree, about half a worker's collection), then caches the
    result in a ``__pycache__/*-pytest-*.pyc``, but not where PYTHONDONTWRITEBYTECODE is set, as on
    these machines: `make test`'s two workers each rewrote every module, every run. Here the first
    worker rewrites the collected modules from the first, the second from the last, each skipping
    what already has a valid cache (the other's, or a run's before), and writes them, so that each
    rewrites about half and collection then reads the rest. pytest's own functions, as its import
    hook uses them; its import still checks every cache against its source's hash. Where they are
    not as here (another pytest) nothing is written and collection rewrites as it did."""
    order = {"gw0": 1, "gw1": -1}.get(os.environ.get("PYTEST_XDIST_WORKER", ""))
    if order is None:
        return
    try:
        from _pytest.assertion.rewrite import (PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc,
                                               assertstate_key, get_cache_dir)

        config = session.config
        state = config.stash[assertstate_key]
        files: set = set()
        for arg in config.args:
            path = (config.invocation_params.dir / arg.split("::", 1)[0]).resolve()
            if path.is_dir():
                files.update(path.rglob("test_*.py"))
                files.update(path.rglob("conftest.py"))
            elif path.name.startswith("test_") and path.suffix == ".py":
                files.add(path)
        for fn in sorted(files)[::order]:
            pyc = get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)
            if _read_pyc(fn, pyc) is not None:
                continue
            source_hash, co = _rewrite_test(fn, config)
            pyc.parent.mkdir(exist_ok=True)
            _write_pyc(state, co, source_hash, pyc)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError):
        return      # not this pytest's internals, or an unwritable tree: collection rewrites


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(START_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(START_FIRST)))   # stable
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


def _tree() -> tuple[dict[int, psutil.Process], set[int]]:
    """This process's descendants but the helpers (pid: process), and every descendant's pid (the
    helpers' too: `shm_segments` counts their segments), from one scan: a scan reads every
    process's /proc entry, 3 ms at 110 processes and more on a loaded machine, twice a test."""
    procs = psutil.Process().children(recursive=True)
    return {p.pid: p for p in procs if not _is_helper(p)}, {p.pid for p in procs}


@pytest.fixture(scope="session", autouse=True)
def forkserver_for_ranks_and_workers():
    """This process's one forkserver, started before any test with what both rank jobs and engine
    workers preload. The library starts it on first use with that user's list: the engine's
    leaves out transformers, so had a test that starts an engine come first (test_moe.py's
    engine tests come before its rank job), every rank of every later job in the process would
    import it again (3 s a rank)."""
    import multiprocessing
    import multiprocessing.forkserver

    from fsdp_sync.cli import launch
    from fsdp_sync.engines.reference import procs

    if os.environ.get("FSDP_SYNC_RANKS_START") == "forkserver" and procs.forkserver_usable():
        last = "fsdp_sync.engines.reference.preloaded"     # freezes what the others imported
        both = [m for m in dict.fromkeys(launch.PRELOAD + procs.PRELOAD) if m != last] + [last]
        procs.claim_temp_dir()
        multiprocessing.get_context("forkserver").set_forkserver_preload(both)
        multiprocessing.forkserver.ensure_running()
    yield


@pytest.fixture(scope="module")
def tiny_tp2_tensors():
    """The tiny model's layout map at TP 2 and random full tensors of its HF names (no model built)."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    layout = layout_for(load_config("tiny"), 2)
    gen = torch.Generator().manual_seed(0)
    full = [(n, torch.randn(layout.full_shape(n), generator=gen)) for n in layout.hf_names()]
    return layout, full


@pytest.fixture
def recipe_refusal(tmp_path):
    """``refusal(text, *words)``: read ``text`` as a plan recipe, which must be refused in one line
    starting ``--recipe <path>: `` and naming each of ``words``; returns (the path, the message)."""
    def refusal(text: str, *words: str):
        from fsdp_sync.cli.plan_recipe import read_recipe

        path = tmp_path / "r.yaml"
        path.write_text(text)
        with pytest.raises(ValueError) as info:
            read_recipe(str(path))
        msg = str(info.value)
        assert msg.startswith(f"--recipe {path}: ") and "\n" not in msg, msg
        for w in words:
            assert w in msg, (w, msg)
        return path, msg

    return refusal


@pytest.fixture
def one_rank():
    """A one-rank gloo default group in this process (a HashStore: no port), destroyed after."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
    kids, pids = _tree()
    kids_before = set(kids)
    shm_before = shm_segments(pids)
    tmp_before = _tmp_entries()
    yield
    kids, pids = _tree()
    leftovers = [p for pid, p in kids.items() if pid not in kids_before]
    if leftovers:
        _, alive = psutil.wait_procs(leftovers, timeout=3.0)   # a child on its way out
        leftovers = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        pids = None                                             # scanned again: the tree changed
    new_shm = shm_segments(pids) - shm_before
    if new_shm:
        gc.collect()   # a segment held only by a garbage cycle is not a leak of the test
        # torch_shm_manager unlinks the segments of a process that exited once its last client
        # is gone: on a loaded machine that takes a few seconds (past 5 s at load 16: four of an
        # exited rank of test_bench's gpu preset test, gone a while later); a leak stays for good
        deadline = time.monotonic() + 15.0
        while (new_shm := shm_segments() - shm_before) and time.monotonic() < deadline:
            time.sleep(0.05)
    new_tmp = _tmp_entries() - tmp_before
    if new_tmp:   # a child's cleanup at exit may still be running
        deadline = time.monotonic() + 3.0
        while (new_tmp := _tmp_entries() - tmp_before) and time.monotonic() < deadline:
            time.sleep(0.05)
    problems = []
    if new_tmp:
        for name in new_tmp:   # not blamed on the next test
            path = os.path.join(_TMP_ROOT, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else _unlink(path)
        problems.append(f"left {len(new_tmp)} temporary file(s)/dir(s) in {_TMP_ROOT}: {sorted(new_tmp)[:8]}")
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


def _tmp_entries() -> set[str]:
    try:
        return {n for n in os.listdir(_TMP_ROOT) if not n.startswith(_TMP_KEPT)}
    except FileNotFoundError:
        return set()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def pytest_unconfigure(config):
    shutil.rmtree(_TMP_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def leftovers_check():
    """`checked_for_leftovers`, for module-scoped fixtures that launch ranks for several tests."""
    return checked_for_leftovers
