"""`fsdp-sync bench` end to end on the tiny model: rows carry the measured floor and baseline, the
JSON has the documented fields, the plots are real PNGs; recipes load into the dataclasses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fsdp_sync.cli.bench.main import BenchSpec
from fsdp_sync.cli.bench.targets import check_targets

from _util import ROOT, cli_here, run_output

RECIPES = Path(__file__).resolve().parent.parent / "fsdp_sync" / "recipes" / "memory_tuning"
ROW_KEYS = {"strategy", "model", "params", "tensors", "bytes", "bucket_bytes", "largest_tensor_bytes",
            "ranks", "tp", "seconds", "floor_seconds", "baseline_seconds", "peak_extra_bytes", "stages"}



@pytest.mark.timeout(240)
def test_bench_cli_rows_json_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    proc = run_output(
        [sys.executable, "-m", "fsdp_sync.cli", "bench", "--models", "tiny", "--strategies",
         "flattened,per_tensor", "--bucket-mb", "0.0625,1", "--multi-stage", "on,off", "--repeats", "3",
         "--json", str(out), "--plot", str(plots)],
        timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    # 2 jobs (multi-stage on/off) × (flattened at 2 bucket sizes + per_tensor once)
    assert len(rows) == 6
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert len(r["repeats"]) == 3 and r["seconds"] == sorted(r["repeats"])[1]
        assert r["floor_seconds"] > 0 and r["baseline_seconds"] > 0
        # one copy of the model's bytes, once per job: the same figure in every row of a job
        assert r["copy_seconds"] > 0 and r["ratio_to_copy"] == r["seconds"] / r["copy_seconds"]
        assert r["copy_seconds"] == [x for x in rows if x["multi_stage"] == r["multi_stage"]][0]["copy_seconds"]
        assert r["bytes"] == rows[0]["bytes"] > 0
        assert r["peak_extra_bytes"] >= 0 and r["memory_curve"]
        # issue 21 item 11: every row says its budget's rule and whether it went over it
        assert r["memory_budget_rule"] == "2 x max(bucket, largest tensor) + largest tensor"
        largest = r["largest_tensor_bytes"]
        assert r["memory_budget_bytes"] == 2 * max(r["bucket_bytes"], largest) + largest
        assert r["over_budget"] is (r["peak_extra_bytes"] > r["memory_budget_bytes"])
        assert [s["name"] for s in r["stages"]].count("sync_weights") == 1
    flat = [r for r in rows if r["strategy"] == "flattened"]
    small = min(flat, key=lambda r: r["bucket_bytes"])
    big = max(flat, key=lambda r: r["bucket_bytes"])
    assert small["engine_calls"] > big["engine_calls"]  # smaller buckets, more calls
    per_tensor = [r for r in rows if r["strategy"] == "per_tensor"]
    assert all(r["engine_calls"] == r["tensors"] for r in per_tensor)
    # per_tensor all-gathers every parameter alone (share_host_memory cannot apply): each of the
    # 2 ranks receives the other's half of the tiny model (it was 0: its stats do not count it)
    assert [r["trainer_rank_bytes_in"] for r in per_tensor] == [rows[0]["bytes"] // 2] * 2, per_tensor
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert "sync_vs_bucket_tiny.png" in pngs
    assert any(n.startswith("memory_timeline_tiny_flattened") for n in pngs)
    for p in plots.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    t = check_targets([dict(r) for r in rows if r["multi_stage"]])
    assert set(t["met"]) == {"speedup", "floor", "memory"}
    # issue 36 item 9: the table's sizes in a unit that shows a tiny model (its 546 KiB were
    # "1" in a MiB column), its multi-stage column named so (it was "ms"), nothing cut
    text = " ".join(proc.stdout.split())
    assert "…" not in proc.stdout and "multi-stage" in text and "546 KiB" in text, proc.stdout
    assert "every row: model tiny, params 0.1M, tensors 27, bytes 546 KiB, ranks 2, tp 2" in text, text


def test_recipes_load_and_validate():
    from fsdp_sync.cli.bench.main import sweep_recipes

    # every bench sweep shipped (plan_*.yaml are `fsdp-sync plan`'s: tests/test_plan.py)
    specs = {n: BenchSpec.from_recipe(RECIPES / f"{n}.yaml") for n in sweep_recipes()}
    assert {"bucket_sweep", "targets"} <= set(specs)
    assert set(specs) | {p.stem for p in RECIPES.glob("plan_*.yaml")} == {p.stem for p in RECIPES.glob("*.yaml")}
    assert specs["targets"].models == ("qwen2-160m",) and specs["targets"].tp == (2,)
    assert len(specs["bucket_sweep"].jobs()) == 2
    with pytest.raises(ValueError, match="unknown strategies \\['fast'\\]"):
        BenchSpec(strategies=("fast",))
    with pytest.raises(ValueError, match="repeats must be >= 3"):
        BenchSpec(repeats=1)
    with pytest.raises(ValueError, match=r"ranks \(3\) must be a multiple of tp \(2\)"):
        BenchSpec(ranks=(3,), tp=(2,))
    with pytest.raises(ValueError, match="unknown bench keys \\['bucket'\\]"):
        BenchSpec.from_mapping({"bucket": 3})
    # what a recipe could give (tp 0, repeats "x", warmup -3) was a ZeroDivisionError, a
    # TypeError, or a run with no warm-up: the spec itself refuses them too
    for kw, words in (({"tp": (0,)}, "tp must be positive integers"), ({"repeats": "x"}, "repeats must be >= 3"),
                      ({"warmup": -3}, "warmup must be an integer >= 0"), ({"ranks": ()}, "ranks must be")):
        with pytest.raises(ValueError, match=words):
            BenchSpec(**kw)


def test_gpu_preset_is_issue_13s_cuda_check_and_runs_on_cpu_with_a_small_model(tmp_path, capsys):
    """`--preset gpu` is one trainer rank and a TP-1 engine on one CUDA device, a model of about
    3 GB in bf16; its code path (1 rank, TP 1, both layouts, pipelined or not, the copy beside
    it) runs here on CPU with the model and device swapped by flags."""
    from fsdp_sync.cli.bench.main import PRESETS
    from fsdp_sync.models import build_model, count_params, load_config

    import torch

    spec = BenchSpec.from_mapping(PRESETS["gpu"])
    assert (spec.device, spec.dtype, spec.ranks, spec.tp) == ("cuda", "bfloat16", (1,), (1,))
    with torch.device("meta"):
        model = build_model(load_config(spec.models[0]))
    params, _ = count_params(model)
    assert 2.9e9 <= 2 * params <= 3.3e9      # bytes in bf16
    out = tmp_path / "gpu.json"
    res = cli_here(capsys, "bench", "--preset", "gpu", "--device", "cpu", "--models", "tiny",
                   "--dtype", "float32", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["rows"]
    got = sorted((r["strategy"], r["layout"], r["pipelined"]) for r in rows)
    assert got == [("flattened", "engine", False), ("flattened", "engine", True),
                   ("flattened", "full", False), ("per_tensor", "full", False)], got
    for r in rows:
        assert (r["ranks"], r["tp"], r["device"]) == (1, 1, "cpu")
        assert r["copy_seconds"] > 0 and r["ratio_to_copy"] > 0
    engine = [r for r in rows if r["layout"] == "engine"]
    assert all(r["engine_rank_bytes_in"] == r["engine_rank_shard_bytes"] for r in engine)

    # scripts/gpu_check.sh's summary puts these rows beside `plan` of the same jobs, under the file
    # names the script gives them: the spec cluster (plan) and this machine's measured one (plan_here)
    import dataclasses
    import shutil
    import subprocess

    from fsdp_sync.plan import CLUSTERS

    d = tmp_path / "check"
    d.mkdir()
    shutil.copy(out, d / "bench_gpu.json")
    (d / "steps.tsv").write_text("bench_gpu\t0\t12.5\nplan\t0\t3.1\nplan_here\t0\t61.0\nbench_7b\t125\t0\n")
    # the test_gpu step's log as pytest -vv under xdist writes it, cut at the step's limit
    (d / "test_gpu.log").write_text(
        "[gw0] [ 10%] PASSED tests/test_gpu.py::test_verify_full_on_cuda \n"
        "tests/test_gpu.py::test_disk_method_on_cuda[full] \n"
        "[gw1] [ 20%] FAILED tests/test_gpu.py::test_disk_method_on_cuda[full] \n"
        "[gw0] [ 30%] SKIPPED tests/test_gpu.py::test_distributed_method_on_two_gpus \n"
        "FAILED tests/test_gpu.py::test_disk_method_on_cuda[full] - AssertionError\n")
    ab = "cuda: the block amax of 28 layers' 7 weights (2499 MiB bf16), scales equal"
    (d / "fp8_ab.log").write_text(ab + "\n")      # dev/fp8_reductions_ab.py's output, first line
    here = dataclasses.replace(CLUSTERS["h100-node"], name="this-machine", tensor_s=1e-4, bucket_s=2e-3, sync_s=1e-3)
    (d / "this_machine.json").write_text(json.dumps(here.to_dict()))
    for name, cluster in (("plan", "h100-node"), ("plan_here", str(d / "this_machine.json"))):
        res = cli_here(capsys, "plan", "--models", "tiny", "--ranks", "1", "--tp", "1", "--dtype", "float32",
                       "--bucket-mb", "512", "--layout", "full,engine", "--engine", "reference",
                       "--cluster", cluster, "--json", str(d / f"{name}.json"))
        assert res.returncode == 0, res.stdout + res.stderr
    plans = {name: {r["layout"]: r["seconds"] for r in json.loads((d / f"{name}.json").read_text())["rows"]}
             for name in ("plan", "plan_here")}
    res = subprocess.run([sys.executable, "scripts/gpu_check_summary.py", str(d)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((d / "gpu_check.json").read_text())
    assert [(s["step"], s["rc"]) for s in summary["steps"]] == [("bench_gpu", "0"), ("plan", "0"),
                                                                  ("plan_here", "0"), ("bench_7b", "125")]
    assert summary["this_machine"]["tensor_s"] == 1e-4 and len(summary["rows"]) == len(rows)
    assert summary["tests"] == {"passed": 1, "failed": 1, "skipped": 1, "finished": False,
                                "failed_tests": ["tests/test_gpu.py::test_disk_method_on_cuda[full]"]}
    for r, b in zip(summary["rows"], rows):
        assert (r["seconds"], r["layout"], r["strategy"]) == (b["seconds"], b["layout"], b["strategy"])
        if r["strategy"] != "flattened":
            assert r["plan_seconds"] is r["plan_here_seconds"] is r["bench_over_plan"] is None
            continue
        for name in ("plan", "plan_here"):
            assert r[f"{name}_seconds"] == plans[name][r["layout"]]
            assert r[f"bench_over_{name}"] == pytest.approx(b["seconds"] / plans[name][r["layout"]])
        assert r["plan_here_seconds"] > r["plan_seconds"]          # the measured costs priced
    md = (d / "gpu_check.md").read_text()
    assert md.count("| tiny |") == len(rows) and "| bench_7b | 125 | 0 |" in md and "us/tensor" in md
    assert "test_gpu: 1 passed, 1 failed, 1 skipped (cut at the step's limit" in md
    assert "\n- tests/test_gpu.py::test_disk_method_on_cuda[full]" in md
    assert summary["fp8_ab"] == ab and f"fp8_ab:\n\n```\n{ab}\n```" in md
    # each row says where its time went, engine call by engine call (the per-tensor row: sums only)
    for r in rows:
        assert r["call_seconds"]["engine_s"] > 0 and ("calls" in r) == (r["strategy"] != "per_tensor"), r
        if "calls" in r:
            assert len(r["calls"]) == r["engine_calls"] and all(c["engine_call_s"] > 0 for c in r["calls"])
    assert md.count("(engine call ") == sum(len(r.get("calls", ())) for r in rows) > 0
    # ... and, with the reference engine, where each call went in its workers
    assert md.count("; workers: stage ") == md.count("(engine call ")


def test_rows_that_differ_only_in_pipelined_say_so():
    """``--preset gpu`` measures the per-rank rows pipelined and not: the table printed two
    ``flattened (engine)`` rows alike but for their figures. A pipelined column tells them apart,
    and goes to the caption, as every column does, when the rows agree."""
    from rich.console import Console

    from fsdp_sync.cli.bench.table import bench_table

    row = json.loads((ROOT / "docs/data/bench-fp8.json").read_text())["rows"][0]

    def text(rows):
        console = Console(width=240, record=True, file=open(os.devnull, "w"))
        console.print(bench_table(rows))
        return console.export_text()

    out = text([dict(row, pipelined=True), dict(row, pipelined=False)])
    head, body = out[:out.index("┡")], out[out.index("┡"):]
    assert "pipelined" in head, out
    lines = [ln for ln in body.splitlines() if ln.startswith("│")]
    assert len(lines) == 2 and lines[0] != lines[1], out
    col = [h.strip() for h in head.splitlines()[-1].split("┃")[1:-1]].index("pipelined")
    assert sorted(ln.split("│")[1 + col].strip() for ln in lines) == ["no", "yes"], out
    same = text([dict(row, pipelined=False), dict(row, pipelined=False, seconds=row["seconds"] * 2)])
    assert "pipelined no" in " ".join(same.split()) and "pipelined" not in same[:same.index("┡")], same


def test_target_model_recipe_has_the_size_the_targets_need():
    from fsdp_sync.models import build_model, count_params, load_config

    import torch

    with torch.device("meta"):
        model = build_model(load_config("qwen2-160m"))
    params, tensors = count_params(model)
    assert params >= 100_000_000 and tensors >= 200


def test_rows_over_their_budget_are_flagged():
    from fsdp_sync.cli.bench.methods import flag_over_budget, memory_budget

    # a tensor larger than a bucket goes alone: the disk method's three buckets in flight are each
    # up to max(bucket, largest tensor), + the largest gathered whole
    disk = memory_budget("disk", 4 << 20, 8 << 20)
    assert disk == {"memory_budget_bytes": 32 << 20,
                    "memory_budget_rule": "3 x max(bucket, largest tensor) + largest tensor"}
    assert memory_budget("disk", 16 << 20, 8 << 20)["memory_budget_bytes"] == 56 << 20
    # tensor, distributed with full tensors: two buckets; 2 x bucket + largest once buckets are larger
    assert memory_budget("tensor", 4 << 20, 8 << 20)["memory_budget_bytes"] == 24 << 20
    assert memory_budget("tensor", 16 << 20, 8 << 20)["memory_budget_bytes"] == 40 << 20
    assert memory_budget("distributed", 4 << 20, 8 << 20)["memory_budget_bytes"] == 24 << 20
    # per-rank buckets: trainer rank 0's buffer sets (two pipelined) + the exchange's pieces of one
    assert memory_budget("distributed", 4 << 20, 8 << 20, "engine", True)["memory_budget_bytes"] == 32 << 20
    assert memory_budget("distributed", 4 << 20, 8 << 20, "engine", False)["memory_budget_bytes"] == 24 << 20
    rows = flag_over_budget([{"peak_extra_bytes": 33 << 20, **disk},
                             {"peak_extra_bytes": 12 << 20, **disk}, {"skipped": "no engine"}])
    assert [r.get("over_budget") for r in rows] == [True, False, None]
    # disaggregated rows: trainer ranks against the trainer's rule, engine workers against theirs
    # (the larger of bucket and largest tensor, + the shard the reference engine stages)
    from fsdp_sync.cli.bench.methods import engine_memory_budget

    eng = engine_memory_budget("distributed", 4 << 20, 8 << 20, 100 << 20, staged=True)
    assert eng["engine_memory_budget_bytes"] == 108 << 20
    assert engine_memory_budget("distributed", 4 << 20, 8 << 20, 100 << 20,
                                staged=False)["engine_memory_budget_bytes"] == 8 << 20
    dist = {**memory_budget("distributed", 4 << 20, 8 << 20), **eng, "peak_extra_bytes": 105 << 20}
    ok = {"trainer rank 0": 23 << 20, "engine worker 0": 105 << 20}
    rows = flag_over_budget([{**dist, "peak_extra_by_process": ok},
                             {**dist, "peak_extra_by_process": {**ok, "trainer rank 1": 25 << 20}},
                             {**dist, "peak_extra_by_process": {**ok, "engine worker 1": 109 << 20}}])
    assert [r["over_budget"] for r in rows] == [False, True, True]


def test_writing_a_disk_file_allocates_no_second_bucket(tmp_path):
    """Issue 21 item 11: the checksum of each written file was read back through an 8 MiB buffer
    per file, beside the buckets in flight (found by the CLI engineer's bench run)."""
    import hashlib
    import tracemalloc

    import torch
    from safetensors.torch import load_file

    from fsdp_sync.transport import disk
    from fsdp_sync.weights import bucket as _bucket

    tensors = {f"w{i}": torch.randn(512, 1024) for i in range(4)}           # 8 MiB
    bkt = _bucket.plan_buckets([_bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 64 << 20)[0]
    flat = _bucket.flatten(bkt, tensors)
    tracemalloc.start()
    try:
        rec = disk._write_shard(str(tmp_path), "f.safetensors", bkt, flat)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = (tmp_path / "f.safetensors").read_bytes()
    import xxhash
    assert rec["digest"] == xxhash.xxh3_128(data).hexdigest() and rec["bytes"] == len(data)
    rec = disk._write_shard(str(tmp_path), "g.safetensors", bkt, flat, hash="sha256")
    assert rec["digest"] == hashlib.sha256((tmp_path / "g.safetensors").read_bytes()).hexdigest()
    back = load_file(str(tmp_path / "f.safetensors"))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    assert peak < 1 << 20, f"writing an 8 MiB bucket allocated {peak / 2**20:.1f} MiB more in Python"


@pytest.mark.timeout(120)
def test_bench_moe_at_ep_2_cuts_each_engine_rank_its_experts(tmp_path, capsys):
    """Issue 24 item 7: `--ep` reaches the engine and the layout figures; a fused-expert model
    is synced expert by expert, so the budget's largest tensor is an exported (per-expert) one."""
    import torch

    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights.export import param_metas
    from fsdp_sync.weights.layout import layout_for

    out = tmp_path / "moe.json"
    res = cli_here(capsys, "bench", "--models", "tiny-qwen3-moe", "--methods", "tensor", "--strategies",
                   "flattened", "--layout", "engine", "--ranks", "2", "--tp", "2", "--ep", "2",
                   "--bucket-mb", "1", "--repeats", "3", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = load_config("tiny-qwen3-moe")
    metas = param_metas(build_model(cfg, seed=0), torch.float32)
    assert not any(m.name.endswith(("experts.gate_up_proj", "experts.down_proj")) for m in metas)
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["ep"], row["layout"], row["exported_tensors"]) == (2, "engine", len(metas))
    assert row["exported_tensors"] > row["tensors"]          # 8 experts x 3 projections per MoE layer
    assert row["engine_rank_bytes_in"] == row["engine_rank_shard_bytes"] \
        == layout_for(cfg, 2, 2).engine_bytes(4)
    assert row["largest_tensor_bytes"] == max(m.nbytes for m in metas)
    largest = row["largest_tensor_bytes"]
    assert row["memory_budget_bytes"] == 2 * max(row["bucket_bytes"], largest) + largest


def test_moe_bench_recipe_size_and_its_largest_tensor_is_not_a_fused_expert():
    """qwen3-moe-150m: 100-200 M parameters, every layer MoE; its budget's largest tensor is the
    embedding, and an expert's largest exported slice is 1/E of the fused parameter it comes from."""
    import torch

    from fsdp_sync.models import build_model, count_params, load_config
    from fsdp_sync.weights.export import param_metas

    cfg = load_config("qwen3-moe-150m")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.mlp_only_layers,
            cfg.tie_word_embeddings) == (16, 2, True, [], False)
    with torch.device("meta"):
        model = build_model(cfg)
    params, _ = count_params(model)
    assert 100e6 <= params <= 200e6
    metas = param_metas(model, torch.float32)
    assert max(metas, key=lambda m: m.nbytes).name == "model.embed_tokens.weight"
    fused = max(p.numel() * 4 for n, p in model.named_parameters() if "experts" in n)
    expert = max(m.nbytes for m in metas if ".experts." in m.name)
    assert expert * cfg.num_experts * 2 == fused          # gate_up_proj: [E, 2 I, H] -> E x ([I, H], [I, H])


def test_bench_quantization_rows_beside_the_rollout_dtype(tmp_path, capsys):
    """Issue 25 item 6: ``--quantization none,fp8`` runs one job per format on the same model and
    bucket: the FP8 rows move the FP8 stream's bytes (about half of bf16) into each engine rank,
    report the quantization's own seconds, and their budget is the plan's: the quantized buckets
    each transport holds, each the largest of its plan (before: one all-FP8 bucket, below the plan's)."""
    import torch

    from fsdp_sync.plan import Cluster, PlanJob, plan_row, quantized_buffers
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import quantize
    from fsdp_sync.weights.fp8 import FP8Layout
    from fsdp_sync.weights.layout import layout_for

    out = tmp_path / "fp8.json"
    res = cli_here(capsys, "bench", "--models", "tiny-fp8", "--methods", "tensor", "--strategies", "flattened",
                   "--layout", "full,engine", "--ranks", "2", "--tp", "2", "--dtype", "bfloat16",
                   "--bucket-mb", "1", "--repeats", "3", "--quantization", "none,fp8",
                   "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["rows"]
    by = {(r["quantization"], r["layout"]): r for r in rows}
    assert set(by) == {(q, lay) for q in (None, "fp8") for lay in ("full", "engine")}, sorted(by, key=str)
    model = build_model(load_config("tiny-fp8"), seed=0)
    sent = sum(m.nbytes for m in quantize.sync_metas(model, SyncConfig(dtype=torch.bfloat16,
                                                                       quantization="fp8")))
    base = layout_for(model.config, 2)
    for lay in ("full", "engine"):
        bf16, fp8 = by[(None, lay)], by[("fp8", lay)]
        assert fp8["bytes"] == sent and 0.5 < fp8["bytes"] / bf16["bytes"] < 0.6, (fp8["bytes"], bf16["bytes"])
        assert fp8["quantize_s"] > 0 and fp8["quantized_tensors"] > 0 and "quantize_s" not in bf16
        # the plan's budget: the quantized buckets the transport holds (two for pipelined per-rank
        # buckets), each the largest quantized bucket of the sync (the bf16 embedding's keeps its bytes)
        plan = plan_row(PlanJob("tiny-fp8", "tensor", lay, fp8["bucket_bytes"], "bfloat16", "fp8", ranks=2, tp=2,
                                pipelined=bool(fp8.get("pipelined")), engine="reference",
                                share_host_memory=bool(fp8["share_host_memory"])),
                        Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4))
        n = quantized_buffers("tensor", lay, bool(fp8.get("pipelined")))
        assert (fp8["memory_budget_bytes"], fp8["memory_budget_rule"]) == (
            plan["memory_budget_bytes"], plan["memory_budget_rule"]), lay
        assert fp8["memory_budget_bytes"] == (bf16["memory_budget_bytes"] + n * plan["quantized_bucket_bytes"]
                                              + plan["quantize_scratch_bytes"])   # the quantizer's, 0c6d875
    # per-rank: each engine rank gets exactly its FP8 shard (weights, scales, the rest in bf16)
    shard = FP8Layout(base.spec, 2).engine_bytes(2)
    assert by[("fp8", "engine")]["engine_rank_bytes_in"] <= 1.05 * shard == 1.05 * by[("fp8", "engine")]["engine_rank_shard_bytes"]
    assert by[("fp8", "engine")]["engine_rank_shard_bytes"] < 0.6 * base.engine_bytes(2)


@pytest.mark.timeout(240)
def test_bench_engine_http_puts_the_engine_behind_serve(tmp_path, capsys):
    """``--engine http``: the manager's calls reach the same engine through `fsdp-sync serve`'s
    server (the figure verl's adapter is compared with), over kept-alive connections."""
    out = tmp_path / "bench.json"
    res = cli_here(capsys, "bench", "--models", "tiny", "--strategies", "flattened", "--layout", "full",
                   "--engine", "http", "--repeats", "3", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine"] == "http" and row["seconds"] > 0 and row["engine_calls"] == 1
    hits = row["http_requests"]
    syncs = hits["/begin_weight_update"]
    assert syncs >= 5                                 # warm-up, 3 timed, the sampled one
    assert hits["/update_weights_from_tensor"] == syncs * row["engine_calls"]
    assert hits["/end_weight_update"] == syncs
    assert 1 <= row["http_connections"] < syncs       # kept alive across a sync's calls
    bad = cli_here(capsys, "bench", "--engine", "grpc")     # in this process, as the flag checks above
    assert bad.returncode != 0 and "--engine" in bad.stderr and "grpc" in bad.stderr, bad.stderr


@pytest.mark.parametrize("flags, named", [
    (["--dtype", "bfloat16"], "--dtype bfloat16"), (["--methods", "disk"], "--methods disk"),
    (["--methods", "tensor,disk"], "--methods tensor,disk"),
    (["--strategies", "per_tensor"], "--strategies per_tensor"), (["--verify", "full"], "--verify"),
    (["--verify", "off"], "--verify"), (["--plot", "PLOTS"], "--plot"),
    (["--quantization", "fp8"], "--quantization fp8"), (["--engine", "http"], "--engine http"),
    (["--layout", "engine"], "--layout engine"), (["--share-host-memory", "off"], "--share-host-memory off"),
    (["--multi-stage", "off"], "--multi-stage off"), (["--preset", "quick"], "--preset"),
    (["--recipe", "bucket_sweep"], "--recipe"), (["--models", "tiny,small"], "--models tiny,small"),
    (["--ranks", "2,4"], "--ranks 2,4"), (["--tp", "1,2"], "--tp 1,2"),
    (["--bucket-mb", "1,4"], "--bucket-mb 1,4")])
def test_lora_bench_refuses_sweep_flags_it_would_ignore(flags, named, tmp_path, capsys):
    """`bench --lora-r` ran the tensor method in float32 on CPU whatever --dtype, --methods,
    --strategies, --verify, --plot, ... said, and exited 0 with figures of what was not asked
    for. Each such flag given with --lora-r is refused: one line naming it, exit code 2."""
    from fsdp_sync.cli.app import parse_args

    flags = [str(tmp_path / f) if f == "PLOTS" else f for f in flags]
    with pytest.raises(SystemExit) as exc:
        parse_args(["bench", "--lora-r", "4", "--models", "tiny", *flags])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{named}" in err and "the LoRA bench (--lora-r)" in err, err


def test_lora_bench_takes_its_own_values_and_the_sweep_defaults():
    """A flag the LoRA bench honours (one model, ranks, TP, bucket size, repeats) or given at the
    value it runs with is accepted; the sweep flags' defaults (two strategies) are not "given"."""
    from fsdp_sync.cli.app import parse_args

    args = parse_args(["bench", "--lora-r", "4", "--models", "tiny", "--ranks", "2", "--tp", "2",
                       "--bucket-mb", "1", "--repeats", "3", "--dtype", "float32", "--methods", "tensor",
                       "--strategies", "flattened", "--device", "cpu", "--quantization", "none"])
    assert args.lora_r == 4 and args.spec.models == ("tiny",)
    assert parse_args(["bench", "--lora-r", "4", "--models", "tiny"]).spec.strategies == ("flattened", "per_tensor")


def test_host_shared_rows_are_judged_against_their_own_floor():
    """The fastest flattened row took the host-shared path (no all-gather) and was judged against
    the all-gather floor: 0.30 s over 0.40 s read 0.75x, target met, where its own floor (0.10 s)
    gives 3x. Targets, their JSON and the table's floor columns now use the row's own floor."""
    from fsdp_sync.cli.bench.table import COLUMNS

    row = {"method": "tensor", "strategy": "flattened", "layout": "full", "share_host_memory": True,
           "seconds": 0.30, "floor_seconds": 0.40, "floor_shared_seconds": 0.10, "baseline_seconds": 1.5,
           "peak_extra_bytes": 10, "memory_budget_bytes": 100, "model": "m", "bucket_bytes": 1 << 26}
    t = check_targets([row])
    assert t["ratio_to_floor"] == pytest.approx(3.0) and t["met"]["floor"] is False
    assert t["floor_judged_against"] == "floor_shared_seconds"
    assert t["ratio_to_all_gather_floor"] == pytest.approx(0.75)
    gathered = check_targets([dict(row, share_host_memory=False)])
    assert gathered["ratio_to_floor"] == pytest.approx(0.75) and gathered["met"]["floor"] is True
    assert gathered["floor_judged_against"] == "floor_seconds"
    cell = {h: c for h, c, _ in COLUMNS}
    assert cell["× floor"](row) == "3.00" and cell["floor s"](row) == "0.100 (shared)"
    assert cell["× floor"](dict(row, share_host_memory=False)) == "0.75"
    # a disaggregated row that shared host memory has no shared floor: its own floor_seconds
    disk = dict(row, method="disk", floor_shared_seconds=None)
    assert cell["× floor"](disk) == "0.75"
    lay = check_targets([dict(row, layout="engine", engine_rank_bytes_in=1, engine_rank_shard_bytes=1)])
    assert lay["layout"]["one-host"]["floor_judged_against"] == "floor_shared_seconds"


_FREED_HEAP = """
import ctypes, sys
from fsdp_sync.cli.bench.allocator import pin_malloc

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
MiB = 1 << 20
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
if sys.argv[1] == "pinned":
    assert pin_malloc() == 128 * 1024
p = libc.malloc(8 * MiB); ctypes.memset(p, 1, 8 * MiB); libc.free(p)   # a gathered tensor, freed
base = rss()
blocks = [libc.malloc(4 * MiB) for _ in range(7)]                       # buckets, then freed
for b in blocks: ctypes.memset(b, 1, 4 * MiB)
for b in blocks[:-1]: libc.free(b)                                      # the last: no trim below it
print((rss() - base) / MiB - 4)
"""


@pytest.mark.timeout(120)
def test_bench_ranks_pin_glibcs_mmap_threshold():
    """The bench's trainer ranks kept what a sync freed in their RSS: glibc raises its mmap
    threshold each time a large block is freed (a gathered 8 MiB embedding), after which buckets
    come from its heap and stay resident when freed, so `small`'s bucketed rows read 34-36 MiB
    against their 24 MiB budget (16.6-16.8 MiB with MALLOC_MMAP_THRESHOLD_=131072). Now every
    bench rank pins the threshold (`allocator.pin_malloc`, as the engine's workers do) and its
    rows say so; the pattern above keeps 24 MiB unpinned and returns it pinned."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}   # glibc's own start
    kept = {how: float(run_output([sys.executable, "-c", _FREED_HEAP, how], timeout=60, cwd=ROOT, env=env).stdout)
            for how in ("plain", "pinned")}
    assert kept["plain"] >= 16 and kept["pinned"] < 1, kept
    from fsdp_sync.cli.bench.main import run_bench

    spec = BenchSpec(models=("tiny",), strategies=("bucketed",), bucket_mb=(0.25,), repeats=3, warmup=0)
    rows = run_bench(spec, timeout_s=100)["rows"]
    assert rows and all(r["malloc_mmap_threshold"] == 128 * 1024 for r in rows), rows
