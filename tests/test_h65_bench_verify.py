"""`fsdp-sync bench --verify` (`cli.bench.verify._verify_rank`), which no test ran before (H65's
mutation pass: the mode never applied to the manager, the warm-up sync counted in the median, no
training step between syncs, a failed check turned into a row: each survived every test).

In this process, on a one-rank gloo world, with the manager and the engine replaced by stand-ins
that record what the bench asks of them (a real sync costs a reference engine's start, seconds;
the check itself is `fsdp_sync.verify`'s, tested with real engines in test_verify*.py): each row
is the mode it names, timed over the syncs after the warm-up, each sync after a training step,
and a check that fails fails the bench run (the engine shut down, the manager closed) instead of
giving a row."""

from __future__ import annotations

import types

import pytest
import torch

MODES_TENSORS = {"off": 0, "sample": 3, "full": 27}


@pytest.fixture
def stand_ins(monkeypatch):
    """The manager, engine and training step `_verify_rank` imports, replaced; ``log`` records."""
    from fsdp_sync import engines, manager
    from fsdp_sync.cli import trainer

    log = types.SimpleNamespace(syncs=[], steps=0, closed=0, shutdown=0, fail_mode=None, engines=[],
                                formats=set())

    class Engine:
        def __init__(self, **kw):
            log.engines.append(kw)

        def shutdown(self):
            log.shutdown += 1

    class Manager:
        def __init__(self, module, engine, mesh=None, config=None):
            self.config, self.engine, self.mesh = config, engine, mesh
            self.stats = types.SimpleNamespace(seconds=0.0, extra={})
            self._n = {}

        def __enter__(self):
            mode = self.config.verify
            n = self._n[mode] = self._n.get(mode, 0) + 1
            log.syncs.append((self.config.method, mode, log.steps))
            log.formats.add((self.config.quantization, self.config.layout))
            # the warm-up sync (the first of a mode) takes 100 s, the timed ones 1, 2, 3, ... s;
            # the check adds a tenth of that; what it checked: the mode's count
            secs = 100.0 if n == 1 else float(n - 1)
            self.stats = types.SimpleNamespace(seconds=secs, extra={} if mode == "off" else {
                "verify_s": secs / 10, "verify_tensors": MODES_TENSORS[mode]})
            if mode == log.fail_mode:
                raise RuntimeError(f"verify failed on rank 0: {mode}: model.norm.weight differs")
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            log.closed += 1

    def step(module, opt, batch):
        log.steps += 1
        return 0.0

    monkeypatch.setattr(engines, "ReferenceEngine", Engine)
    monkeypatch.setattr(manager, "FSDPShardingManager", Manager)
    monkeypatch.setattr(trainer, "train_step", step)
    monkeypatch.setattr(trainer, "wrap_fsdp", lambda module, version, **kw: module)
    return log


def _job(tmp_path, methods=("tensor",), modes=("sample", "full"), repeats=3, **kw) -> dict:
    return {"model": "tiny", "dtype": "float32", "tp": 1, "ep": 1, "methods": list(methods),
            "modes": list(modes), "repeats": repeats, "disk_root": str(tmp_path), "bucket_bytes": 1 << 20,
            "quantization": None, "layout": "auto", **kw}


def test_each_row_is_its_mode_timed_after_the_warm_up(one_rank, stand_ins, tmp_path):
    from fsdp_sync.cli.bench.verify import _verify_rank

    rows = _verify_rank(0, 1, _job(tmp_path, methods=("tensor", "disk")))
    assert [(r["method"], r["verify"]) for r in rows] == [
        ("tensor", "off"), ("tensor", "sample"), ("tensor", "full"),
        ("disk", "off"), ("disk", "sample"), ("disk", "full")], rows
    for r in rows:
        # the median of the 3 timed syncs (1, 2, 3 s), not of the warm-up's 100 s with them
        assert r["sync_seconds"] == 2.0, r
        assert r["verify_seconds"] == (0.0 if r["verify"] == "off" else 0.2), r
        assert r["tensors_checked"] == MODES_TENSORS[r["verify"]], r
        assert (r["repeats"], r["ranks"], r["tp"], r["bucket_bytes"]) == (3, 1, 1, 1 << 20), r
    # every sync (warm-up included) ran with the row's mode and after a training step of its own
    assert [(m, v) for m, v, _ in stand_ins.syncs] == [
        (m, v) for m in ("tensor", "disk") for v in ("off", "sample", "full") for _ in range(4)]
    steps = [s for _, _, s in stand_ins.syncs]
    assert steps == list(range(1, len(steps) + 1)), steps
    assert stand_ins.closed == 2 and stand_ins.shutdown == 1 and len(stand_ins.engines) == 1
    assert stand_ins.formats == {(None, "auto")} and "quantization" not in stand_ins.engines[0]
    assert all((r["quantization"], r["layout"], r["dtype"]) == (None, "auto", "float32") for r in rows)


def test_an_fp8_sweeps_verify_syncs_and_checks_fp8(one_rank, stand_ins, tmp_path):
    """The sweep's rollout format and layout reach the manager and the engine: before, an FP8
    sweep's verify rows timed unquantized syncs and their check (another cost: the check of an
    FP8 sync compares what it quantized) and did not say so (H65)."""
    from fsdp_sync.cli.bench.verify import _verify_rank

    rows = _verify_rank(0, 1, _job(tmp_path, modes=("full",), quantization="fp8", layout="full",
                                   model="tiny-fp8", dtype="bfloat16"))
    assert stand_ins.formats == {("fp8", "full")}, stand_ins.formats
    assert stand_ins.engines[0]["quantization"] == "fp8" and stand_ins.engines[0]["dtype"] == torch.bfloat16
    assert [(r["verify"], r["quantization"], r["layout"], r["dtype"]) for r in rows] == [
        ("off", "fp8", "full", "bfloat16"), ("full", "fp8", "full", "bfloat16")], rows


def test_a_failed_check_fails_the_run_not_a_row(one_rank, stand_ins, tmp_path):
    """A sync whose check fails (the weights the engine serves are not the trainer's) raises out
    of the rank: `verify_rows` then fails (`RankError`) and the bench reports it, exit 1
    (test_h26_bench_audit). A row of its seconds would claim a check that failed."""
    from fsdp_sync.cli.bench.verify import _verify_rank

    stand_ins.fail_mode = "full"
    with pytest.raises(RuntimeError, match=r"verify failed on rank 0: full: model.norm.weight differs"):
        _verify_rank(0, 1, _job(tmp_path))
    assert stand_ins.closed == 1 and stand_ins.shutdown == 1      # nothing left running


def test_verify_rows_runs_each_model_and_format_once_with_the_sweeps_first_values(monkeypatch):
    """`verify_rows`: one job per model and rollout format, with the sweep's first rank count, TP,
    EP, bucket size and layout, ``off`` once (always, first: `_verify_rank` adds it), each asked
    mode once; its disk directory removed after the job, a failed one's too; modes other than
    off/sample/full and a CUDA sweep refused before any rank starts."""
    import os

    from fsdp_sync.cli import launch
    from fsdp_sync.cli.bench.main import BenchSpec
    from fsdp_sync.cli.bench.verify import verify_rows

    jobs = []

    def run_ranks(fn, world, job, **kw):
        assert os.path.isdir(job["disk_root"])
        jobs.append((world, dict(job)))
        if job["model"] == "small":
            raise launch.RankError("rank 0 failed: verify failed")
        return [[{"model": job["model"], "quantization": job["quantization"]}]] + [[] for _ in range(world - 1)]

    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    spec = BenchSpec(models=("tiny-fp8", "tiny-tied"), ranks=(4, 2), tp=(2, 1), bucket_mb=(0.5, 64.0),
                     methods=("tensor", "disk"), repeats=4, quantization=(None, "fp8"), layouts=("full", "engine"))
    rows = verify_rows(spec, ("off", "full", "sample", "full"))
    want = [(m, q) for m in ("tiny-fp8", "tiny-tied") for q in (None, "fp8")]
    assert rows == [{"model": m, "quantization": q} for m, q in want], rows
    for (world, job), (model, q) in zip(jobs, want):
        assert world == 4 and (job["model"], job["quantization"]) == (model, q), job
        assert job["tp"] == 2 and job["ep"] == 1 and job["layout"] == "full", job
        assert job["modes"] == ["full", "sample"] and job["methods"] == ["tensor", "disk"], job
        assert job["bucket_bytes"] == 1 << 19 and job["repeats"] == 4 and job["dtype"] == "float32", job
        assert not os.path.exists(job["disk_root"]), job
    with pytest.raises(launch.RankError):
        verify_rows(BenchSpec(models=("small",)), ("full",))
    assert not os.path.exists(jobs[-1][1]["disk_root"])
    for modes in ((), ("fast",)):
        with pytest.raises(ValueError, match="--verify takes off, sample and/or full"):
            verify_rows(spec, modes)
    with pytest.raises(ValueError, match="CPU only"):
        verify_rows(BenchSpec(models=("tiny",), device="cuda"), ("full",))
    assert len(jobs) == 5
