"""The reference engine's memory and lifetime: release/resume really frees and reallocates memory,
CPU backup, dead workers (idle or in the middle of an update) and shutdown hygiene (no process,
file descriptor or shared-memory segment left behind)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from fsdp_sync.weights import handles
from fsdp_sync.engines import (EngineClosedError, EngineStateError, ReferenceEngine, WorkerDiedError,
                               checksum_named_tensors)
from fsdp_sync.models import build_model, load_config

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]
INFRA = ("torch_shm_manager", "resource_tracker", "multiprocessing.forkserver")   # per-process helpers kept


def _shm(pids):
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("torch_") and n.split("_")[1] in {str(p) for p in pids})


def _fds():
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _children():
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if not any(x in " ".join(c.cmdline()) for x in INFRA):
                out.append(c.pid)
        except psutil.Error:
            pass
    return out


def _warm_process_helpers():
    """Start the helpers a first use starts (resource tracker, shm manager, torch's store loop), so
    the fd count of a later engine's lifetime is comparable."""
    from multiprocessing import resource_tracker

    from fsdp_sync.wire import host_store

    resource_tracker.ensure_running()
    handles.make_payloads(torch.ones(4), 1).release(require_ack=False)
    host_store(2, 10.0)    # the first TCP store (a TP engine's) keeps a pipe for the process's life


def _assert_clean(pids, fds_before, children_before):
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert _children() == children_before
    assert _shm([os.getpid(), *pids]) == []
    assert _fds() == fds_before


def _total(stats, key):
    return sum(w[key] for w in stats["workers"])


@pytest.mark.timeout(150)
def test_release_and_resume_move_real_memory():
    """small recipe (~9M params, 36 MB fp32) on 2 TP workers: releasing weights and KV cache drops
    the workers' RSS and USS by at least 80% of the released bytes; contents are lost, so serving
    refuses until the weights are pushed again, after which the outputs are the same."""
    cfg = load_config("small")
    model = build_model(cfg, seed=0).eval()
    named = list(model.state_dict().items())
    with ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=2048) as e:
        e.update_weights_from_tensor(named)
        tokens = e.generate(PROMPTS, 8)
        before = e.memory_stats()
        released = before["weights_bytes"] + before["kv_cache_bytes"]
        assert before["weights_bytes"] > 35e6     # 8.9M fp32 parameters
        e.release_memory_occupation()          # kv_cache → weights → cuda_graph
        after = e.memory_stats()
        assert after["weights_bytes"] == 0 and after["kv_cache_bytes"] == 0
        for key in ("rss", "uss"):
            drop = before[key] - after[key]
            assert drop >= 0.8 * released, (key, drop, released)
        with pytest.raises(EngineStateError, match="weights are released"):
            e.generate(PROMPTS, 4)
        e.resume_memory_occupation(["weights"])
        with pytest.raises(EngineStateError, match=r"not all pushed again: \d+ of \d+ tensors missing"):
            e.forward_logits(PROMPTS)
        e.update_weights_from_tensor(named[: len(named) // 2])
        with pytest.raises(EngineStateError, match="missing"):
            e.forward_logits(PROMPTS)
        e.begin_weight_update()                # in place (nothing to protect), valid at the end
        e.update_weights_from_tensor(named[len(named) // 2:])
        assert e.memory_stats()["staging_bytes"] == 0
        e.end_weight_update()
        with pytest.raises(EngineStateError, match="KV cache is released"):
            e.generate(PROMPTS, 4)
        e.resume_memory_occupation(["kv_cache"])
        resumed = e.memory_stats()
        assert resumed["rss"] - after["rss"] >= 0.8 * released
        assert e.generate(PROMPTS, 8) == tokens
        assert e.weights_checksum() == checksum_named_tensors(model.named_parameters())


@pytest.mark.timeout(120)
def test_cpu_backup_keeps_weights():
    model = build_model(load_config("tiny"), seed=2).eval()
    with ReferenceEngine(model_config="tiny", tp_size=1, weights_cpu_backup=True) as e:
        e.update_weights_from_tensor(list(model.state_dict().items()))
        tokens = e.generate(PROMPTS, 8)
        wbytes = e.memory_stats()["weights_bytes"]
        e.release_memory_occupation(["weights", "kv_cache"])
        stats = e.memory_stats()
        # on a CPU engine the backup is the weights themselves: reported, not freed
        assert stats["weights_bytes"] == 0 and stats["cpu_backup_bytes"] == wbytes
        e.resume_memory_occupation()
        assert e.memory_stats()["cpu_backup_bytes"] == 0
        assert e.generate(PROMPTS, 8) == tokens


@pytest.mark.timeout(120)
def test_killed_idle_worker_gives_a_clear_error_fast_and_shutdown_is_clean():
    _warm_process_helpers()
    fds, children = _fds(), _children()
    e = ReferenceEngine(model_config="tiny", tp_size=2)
    pids = list(e.worker_pids)
    assert e.generate(PROMPTS, 2)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"TP rank 1 \(pid \d+\) died .*exit code -9, SIGKILL"):
        e.generate(PROMPTS, 4)
    assert time.monotonic() - t0 < 5
    for call in (lambda: e.forward_logits(PROMPTS), e.weights_checksum, e.flush_cache,
                 lambda: e.release_memory_occupation(["kv_cache"])):
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="TP rank 1"):
            call()
        assert time.monotonic() - t0 < 2
    assert [w["alive"] for w in e.memory_stats()["workers"]] == [True, False]
    e.shutdown()
    e.shutdown()
    with pytest.raises(EngineClosedError):
        e.generate(PROMPTS, 1)
    _assert_clean(pids, fds, children)


@pytest.mark.timeout(120)
def test_worker_killed_mid_update_aborts_the_others_and_shutdown_is_clean():
    _warm_process_helpers()
    fds, children = _fds(), _children()
    model = build_model(load_config("tiny"), seed=7)
    with ReferenceEngine(model_config="tiny", tp_size=2) as e:
        pids = list(e.worker_pids)
        shards = e.shard_checksums()
        logits = e.forward_logits(PROMPTS)
        e._set_fault(1, "die_in_stage")     # rank 1 SIGKILLs itself after opening its payload
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"TP rank 1 .* died during update_weights_from_tensor"):
            e.update_weights_from_tensor(list(model.state_dict().items()))
        assert time.monotonic() - t0 < 5
        # the survivor dropped what it had staged: its shard is untouched
        assert e.shard_checksums() == [shards[0], None]
        with pytest.raises(WorkerDiedError):
            e.forward_logits(PROMPTS)
        assert logits.shape == (3, 512)
    _assert_clean(pids, fds, children)


@pytest.mark.timeout(120)
def test_shutdown_after_normal_use_is_clean_and_exit_stops_workers(tmp_path):
    _warm_process_helpers()
    fds, children = _fds(), _children()
    model = build_model(load_config("tiny"), seed=8)
    e = ReferenceEngine(model_config="tiny", tp_size=2)
    pids = list(e.worker_pids)
    e.begin_weight_update()
    e.update_weights_from_tensor(list(model.state_dict().items()))
    e.end_weight_update()
    e.release_memory_occupation()
    e.resume_memory_occupation()
    del e                                 # the finalizer stops the workers
    import gc

    gc.collect()
    _assert_clean(pids, fds, children)
    # an interpreter that exits without shutdown() leaves no worker behind either
    script = tmp_path / "leaky.py"
    script.write_text(
        "import sys\n"
        "from fsdp_sync.engines import ReferenceEngine\n"
        "if __name__ == '__main__':\n"
        "    e = ReferenceEngine(model_config='tiny', tp_size=2)\n"
        "    print(*e.worker_pids, flush=True)\n"
        "    sys.exit(0)\n")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    leaked = [int(p) for p in out.stdout.split()]
    assert len(leaked) == 2
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in leaked) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in leaked)


@pytest.mark.timeout(120)
def test_shutdown_ends_a_step_stuck_on_a_stopped_worker_at_once():
    """A step waiting on a worker holds the engine's lock; shutdown() needs it. Before, it waited
    for the step's ``call_timeout_s`` (900 s by default: `fsdp-sync serve` hung that long at SIGTERM)."""
    import threading

    _warm_process_helpers()
    fds, children = _fds(), _children()
    e = ReferenceEngine(model_config="tiny", tp_size=2, call_timeout_s=60)
    pids = list(e.worker_pids)
    got: dict = {}

    def generate():
        try:
            got["out"] = e.generate([[1, 2, 3]], 250, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got["out"] = exc

    t = threading.Thread(target=generate)
    try:
        t.start()
        deadline = time.monotonic() + 60
        while e._sched.stats()["steps"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGSTOP)      # stuck in the middle of the steps
        time.sleep(1.0)
        assert e._sched.stats()["running"] == 1
        t0 = time.monotonic()
        e.shutdown()
        took = time.monotonic() - t0
        t.join(10)
        assert isinstance(got.get("out"), EngineClosedError), got
        assert took < 10, f"shutdown took {took:.1f}s"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        e.shutdown()
    _assert_clean(pids, fds, children)
