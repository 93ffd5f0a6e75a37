"""H54's audit of ``fsdp-sync demo`` and the flags the commands share (stop 75): checks a user
relies on that no test held (mutation pass over cli/demo, demo_check, args, bench/rows,
bench/sampling, bench/gpu_memory, trainer, lora_model).

- A bad value is one line naming the flag and the value, exit code 2: ``inf`` where a positive
  number is asked, an empty comma list.
- The demo's verdict: a run with no step is not ok; each rank's finished steps are the first ones
  in order (a later step's records after a missing one are not shown as the next step); the
  float32 tolerance, and the 16-bit one scaled by the largest reference logit.
- `DemoOptions` refuses what the command line refuses (no step, a negative LoRA rank), and its
  refusal of ``--lora`` with a quantization says the flag's spelling (``none``, not ``None``).
All in-process; no rank starts."""

from __future__ import annotations

import argparse
import os
import pickle
import time

import pytest
import torch

from fsdp_sync.cli import app
from fsdp_sync.cli import args as ca

from _util import ROOT

BAD = [
    ("demo --timeout-s inf", ["--timeout-s", "positive number", "'inf'"]),
    ("demo --lora --lora-alpha inf", ["--lora-alpha", "positive number", "'inf'"]),
    ("bench --bucket-mb ,", ["--bucket-mb", "comma-separated list", "','"]),
    ("bench --ranks 2,,0", ["--ranks", "positive integer", "'0'"]),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[a for a, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_flag_and_the_value(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        app.parse_args(argv.split())
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    assert "None" not in err, err


def test_explicit_dests_leaves_the_parsers_defaults_as_they_were():
    """`explicit_dests` parses with every default suppressed: a parser used again after it must
    still fill in the defaults of the flags not given."""
    p = ca.Parser(prog="x")
    p.add_argument("--a", type=ca.positive_int, default=3)
    p.add_argument("--b", default="z")
    assert ca.explicit_dests(p, ["--a", "5"]) == {"a"}
    assert vars(p.parse_args([])) == {"a": 3, "b": "z"}


# --------------------------------------------------------------------------- the demo's verdict

def _rec(step: int, src: bool) -> dict:
    r = {"step": step, "loss": 1.0, "sync_seconds": 0.1, "bytes": 100, "tensors": 3, "engine_calls": 1,
         "peak_trainer_rss": 1, "stages": []}
    if src:
        r.update(peak_engine_rss=1, max_abs_logit_diff=0.0, tokens_match=True, tokens_exact=True,
                 atol=1e-5, changed_since_last_step=True)
    return r


def test_a_demo_with_no_step_is_not_ok():
    from fsdp_sync.cli.demo import DemoOptions, _result

    res = _result(DemoOptions(ranks=2, tp=2, steps=2), [[], []], time.perf_counter())
    assert res["steps"] == [] and res["ok"] is False


def test_the_finished_steps_are_the_first_ones_every_rank_wrote(tmp_path):
    """A rank that wrote steps 0 and 2 but not 1 (its step 1 failed, a later record is stale):
    step 0 alone is finished; step 2's records are not shown as the second step."""
    from fsdp_sync.cli.demo import DemoOptions, _finished_steps

    opts = DemoOptions(ranks=2, tp=2, steps=3)
    for rank in range(2):
        for step in (0, 2):
            with open(tmp_path / f"rank{rank}-step{step}.pkl", "wb") as f:
                pickle.dump(_rec(step, rank == 0), f)
    (tmp_path / "rank0-step1.pkl").write_bytes(pickle.dumps(_rec(1, True)))   # rank 1's step 1 missing
    got = _finished_steps(str(tmp_path), opts)
    assert [[r["step"] for r in recs] for recs in got] == [[0], [0]]


def test_the_tolerance_is_1e_5_in_float32_and_scales_with_the_largest_logit_in_16_bit():
    from fsdp_sync.cli.demo import ATOL_EPS, DemoOptions, tolerance

    small, big = torch.tensor([[0.5, -0.25]]), torch.tensor([[3.0, -40.0]])
    assert tolerance(DemoOptions(), big) == 1e-5
    assert tolerance(DemoOptions(atol=0.25), big) == 0.25
    eps = torch.finfo(torch.bfloat16).eps
    assert tolerance(DemoOptions(dtype="bfloat16"), small) == ATOL_EPS * eps          # at least one unit
    assert tolerance(DemoOptions(dtype="bfloat16"), big) == pytest.approx(ATOL_EPS * eps * 40.0)


@pytest.mark.parametrize("kw, words", [({"steps": 0}, "--steps"), ({"lora_r": -1}, "--lora-r"),
                                       ({"ranks": 3, "tp": 2}, "--ranks (3)"),
                                       ({"lora_r": 4, "dtype": "bfloat16"}, "--dtype bfloat16 --quantization none ")])
def test_demo_options_refuse_what_the_command_line_refuses(kw, words):
    from fsdp_sync.cli.demo import DemoOptions

    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        DemoOptions(**kw)


def test_a_vocabulary_must_hold_the_largest_prompt_token(tmp_path):
    """The demo's prompts use token ids up to 201: a vocabulary of 201 cannot embed id 201 (it
    failed in every rank's first forward), 202 can."""
    import json

    from fsdp_sync.cli.demo import PROMPTS
    from fsdp_sync.cli.demo_check import check_model
    from fsdp_sync.models import load_config

    top = max(max(p) for p in PROMPTS)
    config = load_config("tiny").to_dict()
    for vocab in (top, top + 1):
        config["vocab_size"] = vocab
        path = tmp_path / f"v{vocab}.json"
        path.write_text(json.dumps(config))
        if vocab == top:
            with pytest.raises(ValueError, match=f"vocab_size {top} is too small .* give at least {top + 1}"):
                check_model(str(path), 2, 1, None)
        else:
            assert check_model(str(path), 2, 1, None).vocab_size == top + 1


# --------------------------------------------------------------------------- bench memory

@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_peaks_are_refused_where_no_cuda_device_is_seen():
    """Made on a CPU machine, `CudaPeaks` failed only when the stage entered it (torch's
    AssertionError "Torch not compiled with CUDA enabled"), and result() said so after the sync."""
    from fsdp_sync.cli.bench.gpu_memory import CudaPeaks

    with pytest.raises(RuntimeError, match=r"no CUDA device \(torch.cuda.is_available\(\) is False\)"):
        CudaPeaks(None)


def test_the_disk_dir_check_leaves_nothing_behind(tmp_path):
    """`check_disk_dir` probes by making and removing a directory where the versions would go:
    neither a missing --disk-dir (checked in its nearest existing parent) nor an existing one
    keeps the probe."""
    from fsdp_sync.cli.demo_check import check_disk_dir

    check_disk_dir(str(tmp_path / "new" / "versions"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    check_disk_dir(str(tmp_path / "old"))
    assert [p.name for p in tmp_path.rglob("*")] == ["old"]


def test_a_cuda_demo_counts_its_processes_on_the_host():
    """On --device cuda only the build is on the host, but every trainer rank and engine worker
    is a process there that takes this process's memory before it holds a weight: a host with
    room for the build alone is refused. The refusal said "+ 4 processes x 0.26 GiB" (2 ranks, 2
    engine workers) and counted the 2 ranks alone in the total it gave."""
    from fsdp_sync.cli.demo_check import check_fits
    from fsdp_sync.models import load_config

    config = load_config("tiny")
    kw = dict(ranks=2, tp=2, method="tensor", dtype="float32", quantization=None, device="cuda")
    m = check_fits("tiny", config, available=2**50, **kw)
    assert m["processes"] == 4 and m["process_bytes"] > 0, m
    assert m["need_bytes"] == m["build_bytes"] + 4 * m["process_bytes"], m
    with pytest.raises(ValueError, match=r"argument --model: tiny has .* 4 processes x"):
        check_fits("tiny", config, available=m["build_bytes"] + 3 * m["process_bytes"], **kw)


def test_a_failed_sampled_sync_stops_its_sampling_thread(monkeypatch):
    """`sampled_sync` whose sync raised left the sampler's thread reading /proc every millisecond
    for the rest of the rank's life."""
    import torch.distributed as dist

    from fsdp_sync.cli.bench import sampling

    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: None)
    monkeypatch.setattr(sampling, "cpu_group", lambda: None)

    class Failing:
        def __enter__(self):
            raise RuntimeError("sync failed")

        def __exit__(self, *exc):
            return False

    sampler = sampling.DeviceSampler([(os.getpid(), None)], period_s=0.001)
    with pytest.raises(RuntimeError, match="sync failed"):
        sampling.sampled_sync(Failing(), sampler)
    assert not sampler._thread.is_alive() and sampler.samples


# --------------------------------------------------------------------------- bench rows

def test_an_incomplete_sweep_names_the_error_and_its_last_line(tmp_path, capsys):
    """A failed job's one line on stderr: the launcher's first line and the rank's last (the
    exception itself), and the rows measured before it written to --json."""
    import json

    from fsdp_sync.cli.bench.rows import BenchIncomplete, report_incomplete
    from rich.console import Console

    out = tmp_path / "b.json"
    result = {"rows": [{"method": "tensor"}], "incomplete": "rank 1 failed:"}
    exc = BenchIncomplete("rank 1 failed:\nTraceback (most recent call last):\n  ...\nValueError: boom", result)
    args = argparse.Namespace(json=str(out))
    assert report_incomplete(Console(file=open(os.devnull, "w")), args, result, exc) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"fsdp-sync bench: error: rank 1 failed: ValueError: boom (1 row(s) measured before it, "
                   f"shown above; written to {out})"), err
    assert json.loads(out.read_text())["rows"] == [{"method": "tensor"}]


def test_rows_half_written_are_no_rows(tmp_path):
    """The parent reads a failed job's rows; a file cut short (the rank killed mid-write of a
    file not renamed yet cannot be, but a full disk can) is no rows, not a JSONDecodeError that
    hides the job's own error."""
    from fsdp_sync.cli.bench.rows import ROWS_FILE, measured_rows, save_rows

    assert measured_rows(str(tmp_path)) == []
    save_rows(str(tmp_path), [{"seconds": 1.0}])
    assert measured_rows(str(tmp_path)) == [{"seconds": 1.0}]
    (tmp_path / ROWS_FILE).write_text('[{"seconds": 1.')
    assert measured_rows(str(tmp_path)) == []


def test_a_tensor_rows_peak_is_its_worst_devices_rise():
    """Two devices sampled, the second rising most: the row's peak_extra_bytes is that rise, and
    its memory curve is the devices' sum at each sample."""
    import types

    from fsdp_sync.cli.bench.rows import tensor_row

    class _Sampler:
        t0 = 10.0
        samples = [(0.0, [100, 100]), (1.5, [150, 400]), (3.0, [120, 130])]

    timeline = types.SimpleNamespace(to_dict=lambda: [{"name": "sync_weights", "started": 11.0, "seconds": 1.0}])
    manager = types.SimpleNamespace(module=torch.nn.Linear(4, 4, bias=False), timeline=timeline)
    job = types.SimpleNamespace(dtype="float32", model="m", ranks=2, tp=2, multi_stage=True, device="cpu")
    stats = types.SimpleNamespace(extra={}, bytes=64, engine_calls=1)
    row = tensor_row(job, "flattened", 2**20, 16, 1, stats, [1.0, 2.0, 3.0], 2.0, 0.5, manager, _Sampler())
    assert row["peak_extra_bytes"] == 300
    assert row["memory_curve"] == [[0.0, 200], [1.5, 550], [3.0, 250]]
    assert row["stages"][0]["t"] == 1.0 and row["seconds"] == 2.0


def test_each_step_is_judged_on_its_worst_logit_its_tokens_and_a_change():
    """`StepCheck`, the verdict every engine-holding rank gives each step: one logit off by 1e-3
    among thousands is the step's max |diff| (a sync that corrupted one row); a token off fails a
    float32 step; logits equal to the last step's are flagged (the engine left as it was)."""
    from fsdp_sync.cli.demo import DemoOptions, StepCheck

    check = StepCheck(DemoOptions())
    ref = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    eng = ref.clone()
    eng[2, 100] += 1e-3
    first = check.check(eng, ref, [[1, 2]], [[1, 2]])
    assert first["max_abs_logit_diff"] == pytest.approx(1e-3, rel=1e-3) and first["atol"] == 1e-5
    assert first["tokens_exact"] and first["tokens_match"] and first["changed_since_last_step"]
    again = check.check(eng.clone(), ref, [[1, 3]], [[1, 2]])
    assert not again["changed_since_last_step"] and not again["tokens_match"]
    assert check.check(ref, ref, [[1, 2]], [[1, 2]])["changed_since_last_step"]


# --------------------------------------------------------------------------- the --lora trainer

def test_the_lora_trainer_computes_pefts_forward_and_names():
    """`add_lora`'s layer is peft's: ``base(x) + lora_B(lora_A(x)) * alpha / r``, a nonzero B (so
    the first adapter is not a no-op), the base frozen and the adapter alone trainable."""
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.models import build_model, load_config

    model = add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=32.0)
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, layer.base_layer.in_features, generator=torch.Generator().manual_seed(1))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = x @ layer.base_layer.weight.T + (x @ a.T @ b.T) * (32.0 / 4)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5)
    assert b.abs().sum() > 0
    trainable = sorted({n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad})
    assert trainable == ["lora_A", "lora_B"], trainable
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in dict(model.named_parameters())


def test_piped_the_demo_prints_a_line_a_step_on_stderr(capsys):
    """Where stdout is no terminal (tee, a CI log) rich's transient bar draws nothing until the end:
    the demo said nothing between its header and its table. One line a step on stderr there."""
    from fsdp_sync.cli.demo import _LineProgress

    p = _LineProgress(3)
    task = p.add_task("training", total=3)
    p.update(task, description="loss 1.000 · syncing")
    assert capsys.readouterr().err == ""
    p.update(task, advance=1, description="loss 1.000 · synced 12 ms")
    p.update(task, advance=1, description="loss 0.900 · synced 11 ms")
    err = capsys.readouterr().err.splitlines()
    assert [e.split(" (")[0] for e in err] == ["demo step 1/3: loss 1.000 · synced 12 ms",
                                               "demo step 2/3: loss 0.900 · synced 11 ms"], err
