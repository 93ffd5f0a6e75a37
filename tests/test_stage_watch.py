"""A measurement of one sync stage alone: the manager's ``watch`` (`memory.Timeline.watch`) and the
bench's CUDA allocator peaks that use it (`cli.bench.gpu_memory.CudaPeaks`).

Before this, a CUDA bench row restarted the engine's allocator peaks before the whole ``with
manager:`` and so counted the weights and KV cache the engine wakes on entry as the sync's own
memory (hundreds of MiB to GiB, against a budget of two buckets). The engine's memory is read here
from the reference engine's own accounting; the allocator on a GPU is checked by
tests/test_gpu.py::test_bench_row_measures_the_sync_stage_on_the_gpu.
"""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


class _Watcher:
    """Records when it is entered and left, and what the engine held then."""

    def __init__(self, engine) -> None:
        self.engine, self.seen = engine, []

    def _held(self) -> dict:
        w = self.engine.memory_stats()["workers"][0]
        return {"weights": w["weights_bytes"], "kv": w["kv_cache_bytes"]}

    def __enter__(self):
        self.seen.append({"enter": time.perf_counter(), "at_enter": self._held()})
        return self

    def __exit__(self, *exc):
        self.seen[-1].update(exit=time.perf_counter(), at_exit=self._held())


def _job(rank, world):
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import make_mesh

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=3), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32)
    try:
        manager = FSDPShardingManager(module, engine, mesh=make_mesh(1, 1), config=SyncConfig(
            dtype=torch.float32, dist_timeout_s=60))
        engine.release_memory_occupation()     # asleep, as between two rollouts
        watcher = _Watcher(engine)
        manager.watch["sync_weights"] = watcher
        out = {"syncs": []}
        for _ in range(2):
            with manager:
                inside = watcher._held()
            stages = {s.name: (s.started, s.started + s.seconds) for s in manager.timeline.stages}
            out["syncs"].append({"stages": stages, "inside": inside})
        out["watched"] = watcher.seen
        manager.watch.pop("sync_weights")
        with manager:
            pass
        out["after_pop"] = len(watcher.seen)
        manager.close()
        return out
    finally:
        engine.shutdown()


@pytest.mark.timeout(180)
def test_watch_wraps_the_sync_stage_alone_after_the_weights_woke_and_before_the_kv_cache():
    (r,) = run_ranks(_job, 1, timeout_s=150, env=spawn_env())
    assert len(r["watched"]) == 2 and r["after_pop"] == 2, r      # every sync, and not once unset
    for sync, seen in zip(r["syncs"], r["watched"]):
        # entered with the engine's weights awake and its KV cache still asleep; left the same way
        assert seen["at_enter"]["weights"] > 0 and seen["at_enter"]["kv"] == 0, seen
        assert seen["at_exit"]["weights"] > 0 and seen["at_exit"]["kv"] == 0, seen
        assert sync["inside"]["kv"] > 0, sync       # the KV cache woke after it, inside the block
        t0, t1 = sync["stages"]["sync_weights"]
        assert seen["enter"] <= t0 and t1 <= seen["exit"], (seen, t0, t1)   # outside its seconds
        # and no other stage inside it: the weights woke before, the KV cache after
        assert sync["stages"]["resume_weights"][1] <= seen["enter"], sync
        assert seen["exit"] <= sync["stages"]["resume_kv_cache"][0], sync


class _FakeAllocator:
    """torch.cuda's allocator counters over a scripted allocation (this process on GPU ``device``)."""

    def __init__(self, allocated: int, device: int = 0) -> None:
        self.allocated = self.peak = allocated
        self.device = device

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def synchronize(self): pass
    def reset_peak_memory_stats(self): self.peak = self.allocated
    def memory_allocated(self): return self.allocated
    def memory_reserved(self): return self.allocated + (64 << 20)
    def max_memory_allocated(self): return self.peak
    def max_memory_reserved(self): return self.peak + (64 << 20)
    def current_device(self): return self.device


class _FakeEngine:
    """Two engine workers, on GPUs 0 and 1, each with an allocator of its own."""

    def __init__(self) -> None:
        self.workers = [_FakeAllocator(5 << 30, 0), _FakeAllocator(5 << 30, 1)]

    def reset_peak_memory_stats(self) -> None:
        for w in self.workers:
            w.reset_peak_memory_stats()

    def memory_stats(self) -> dict:
        return {"workers": [{"cuda": {"device": w.device, "allocated": w.allocated, "reserved": w.allocated,
                                      "max_allocated": w.peak, "max_reserved": w.peak}}
                            for w in self.workers]}


def test_cuda_peaks_are_the_rises_within_the_stage_and_the_devices_sum_is_held_to_the_budget():
    from fsdp_sync.cli.bench.gpu_memory import CudaPeaks

    MiB = 1 << 20
    trainer, engine = _FakeAllocator(2 << 30), _FakeEngine()
    peaks = CudaPeaks(engine, cuda=trainer)
    with pytest.raises(RuntimeError, match="watch"):
        peaks.result(100 * MiB)
    engine.workers[0].alloc(3 << 30)        # the weights woke before the stage: not the sync's
    trainer.alloc(1 << 30)
    with peaks:
        trainer.alloc(96 * MiB)             # a gathered bucket, then freed
        trainer.alloc(-96 * MiB)
        engine.workers[0].alloc(8 * MiB)    # a worker's transient, freed
        engine.workers[0].alloc(-8 * MiB)
        engine.workers[1].alloc(40 * MiB)   # on the other GPU: not this device's
    r = peaks.result(100 * MiB)
    assert r["trainer_peak_allocated_mib"] == 96 and r["trainer_peak_reserved_mib"] == 96, r
    assert r["engine_workers_peak_allocated_mib"] == [8, 40] and r["engine_peak_allocated_mib"] == 40, r
    assert r["device_peak_allocated_mib"] == 96 + 8, r
    assert r["trainer_within_budget"] and not r["within_budget"], r

    with peaks:                             # reused: the next stage's rises alone
        trainer.alloc(10 * MiB)
    r = peaks.result(100 * MiB)
    assert r["trainer_peak_allocated_mib"] == 10 and r["device_peak_allocated_mib"] == 10 and r["within_budget"], r

    dying = _FakeEngine()                  # a stage that failed: nothing read, its own error goes on
    failed = CudaPeaks(dying, cuda=trainer)
    with pytest.raises(KeyError, match="the stage's own"):
        with failed:
            dying.memory_stats = lambda: {}["the engine, asked after a failed stage"]
            raise KeyError("the stage's own")
    with pytest.raises(RuntimeError, match="measured no stage"):
        failed.result(100 * MiB)

    alone = CudaPeaks(None, cuda=trainer)   # a rank that holds no engine: its trainer alone
    with alone:
        trainer.alloc(5 * MiB)
    assert alone.result()["device_peak_allocated_mib"] == 5 and "within_budget" not in alone.result()


def test_a_cuda_row_over_its_gpu_budget_is_flagged_by_the_gpu_not_the_hosts_rss():
    from fsdp_sync.cli.bench.methods import over_budget_line as _over_budget
    from fsdp_sync.cli.bench.methods import flag_over_budget

    MiB = 1 << 20
    row = {"strategy": "flattened", "peak_extra_bytes": 1 * MiB, "memory_budget_bytes": 100 * MiB,
           "memory_budget_rule": "2 x max(bucket, largest tensor) + largest tensor",
           "gpu_memory": {"device_peak_allocated_mib": 104.0, "trainer_peak_allocated_mib": 96.0,
                          "within_budget": False}}
    cpu = {"strategy": "flattened", "peak_extra_bytes": 1 * MiB, "memory_budget_bytes": 100 * MiB}
    flagged = flag_over_budget([row, cpu])
    assert flagged[0]["over_budget"] and not flagged[1]["over_budget"]
    line = _over_budget(flagged[0])
    assert "GPU 104.0 MiB (trainer 96.0" in line and "> 100.0 MiB" in line, line


def test_a_failing_watcher_is_recorded_and_never_fails_the_stage():
    """The stage runs on every rank alike whatever its measurement does (a watcher that raised out
    of the stage on one rank would leave the others waiting in its agreement); the stage's own
    error still reaches the watcher and goes on."""
    from fsdp_sync.cli.bench.gpu_memory import CudaPeaks
    from fsdp_sync.memory import Timeline

    class Boom:
        def __init__(self, where):
            self.where, self.saw = where, []

        def __enter__(self):
            if self.where == "enter":
                raise OSError("no device")

        def __exit__(self, *exc):
            self.saw.append(exc[0])
            if self.where == "exit":
                raise ValueError("the engine went away")

    on_enter, on_exit, quiet = Boom("enter"), Boom("exit"), Boom(None)
    tl = Timeline(mode="off", watch={"a": on_enter, "b": on_exit, "c": quiet, "d": lambda: quiet})
    ran = []
    for name in "ab":
        with tl.stage(name):
            ran.append(name)
    with pytest.raises(KeyError):
        with tl.stage("c"):
            raise KeyError("the stage's own")
    with tl.stage("d"):             # a callable: made anew, entered, left
        pass
    assert ran == ["a", "b"] and [s.name for s in tl.stages] == ["a", "b", "c", "d"]
    assert tl.stages[0].watch_error == "entering: OSError: no device" and on_enter.saw == []
    assert tl.stages[1].watch_error == "leaving: ValueError: the engine went away"
    assert quiet.saw == [KeyError, None] and tl.stages[2].watch_error is None

    peaks = CudaPeaks(None, cuda=_FakeAllocator(0))
    tl.stages[0].name = "sync_weights"
    with pytest.raises(RuntimeError, match="sync_weights: entering: OSError: no device"):
        peaks.result(1 << 20, tl)


def test_a_disaggregated_rows_trainer_and_engine_workers_are_held_to_their_own_rules():
    """distributed and disk on CUDA: the trainer against the row's budget, each engine worker against
    the engine's rule (`plan.engine_memory_budget`), not the two added on one device."""
    from fsdp_sync.cli.bench.gpu_memory import CudaPeaks
    from fsdp_sync.cli.bench.methods import over_budget_line as _over_budget
    from fsdp_sync.cli.bench.methods import flag_over_budget

    MiB = 1 << 20
    trainer, engine = _FakeAllocator(1 << 30), _FakeEngine()
    peaks = CudaPeaks(engine, cuda=trainer)
    with peaks:
        trainer.alloc(90 * MiB)
        engine.workers[0].alloc(60 * MiB)   # on the trainer's GPU: 150 MiB there, over 100
        engine.workers[1].alloc(50 * MiB)
    r = peaks.result(100 * MiB, None, 64 * MiB)
    assert r["device_peak_allocated_mib"] == 150 and r["trainer_within_budget"] and r["within_budget"], r
    engine.workers[1].alloc(-50 * MiB)
    with peaks:
        engine.workers[1].alloc(70 * MiB)   # one worker over the engine's rule
    r = peaks.result(100 * MiB, None, 64 * MiB)
    assert r["trainer_within_budget"] and not r["within_budget"], r
    row = {"strategy": "distributed:flattened_bucket", "peak_extra_bytes": 0, "memory_budget_bytes": 100 * MiB,
           "memory_budget_rule": "2 x max(bucket, largest tensor) + largest tensor",
           "engine_memory_budget_bytes": 64 * MiB, "engine_memory_budget_rule": "max(bucket, largest tensor)",
           "gpu_memory": r}
    (row,) = flag_over_budget([row])
    line = _over_budget(row)
    assert row["over_budget"] and "GPU: trainer 0.0 MiB, engine workers 0.0, 70.0 MiB" in line, line
    assert "(an engine worker: 64.0 MiB = max(bucket, largest tensor))" in line, line
