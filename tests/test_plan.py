"""`fsdp-sync plan` (issue 27 items 2-4): its byte counts equal what the bench measures, for every
method and layout on CPU (exact), the tensor method's measured peaks stay within its budget rule, a plan that cannot fit is refused with the largest bucket that fits, a 235B MoE
plans on the meta device, and bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fsdp_sync.cli import app as cli
from fsdp_sync.plan import Cluster, PlanError, PlanJob, meta_model, plan_row

from _util import ROOT

MiB = 2**20
NOISE = 3 * MiB     # what the peak sampler sees beyond the rule's buffers (see the bytes test)
# one host, every rank on it: the path the bench takes here (figures only matter for seconds)
CPU = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
EXACT = ("bytes", "buckets", "engine_calls", "engine_rank_bytes_in", "engine_rank_shard_bytes",
         "trainer_rank_bytes_in", "largest_tensor_bytes", "memory_budget_bytes",
         "engine_memory_budget_bytes", "reshard_path",
         "params", "tensors", "exported_tensors", "layout")


def _plan_of(bench_row: dict) -> dict:
    r = bench_row
    share = bool(r.get("share_host_memory"))
    return plan_row(PlanJob(r["model"], r["method"], r["layout"], r["bucket_bytes"], r["dtype"],
                            r.get("quantization"), r["ranks"], 2, r["tp"], r.get("ep", 1),
                            share_host_memory=share, pipelined=bool(r.get("pipelined")),
                            engine="reference"), CPU)


def _bench(**kw) -> list[dict]:
    from fsdp_sync.cli.bench.main import BenchSpec, run_bench

    spec = BenchSpec(strategies=("flattened",), ranks=(2,), tp=(2,), repeats=3, **kw)
    rows = run_bench(spec, timeout_s=150)["rows"]
    return [r for r in rows if not r.get("skipped") and r["strategy"] != "distributed:per_tensor"]


@pytest.mark.timeout(300)
def test_plan_bytes_equal_the_bench_for_every_method_and_layout():
    """One bench job (tensor, distributed, disk x full, engine x host-shared on/off): every byte
    figure of every row equals the plan's; the memory budgets are the same formula. The disk
    rows run with share_host_memory off too (they ran host-shared whatever the flag said)."""
    job = dict(models=("small",), methods=("tensor", "distributed", "disk"), layouts=("full", "engine"),
               share_host_memory=(True, False), bucket_mb=(4.0,))
    rows = _bench(**job)
    seen = {(r["method"], r["layout"], r.get("reshard_path"), r["share_host_memory"]) for r in rows}
    assert {("tensor", "full", None, True), ("tensor", "full", None, False),
            ("tensor", "engine", "host-shared", True), ("tensor", "engine", "all-to-all", False),
            ("distributed", "full", None, False), ("distributed", "engine", "host-shared", True),
            ("distributed", "engine", "all-to-all", False), ("disk", "full", None, True),
            ("disk", "full", None, False), ("disk", "engine", "host-shared", True),
            ("disk", "engine", "all-to-all", False)} <= seen, seen
    assert all(r["trainer_rank_bytes_in"] > 0 for r in rows if r["method"] == "disk" and not r["share_host_memory"])
    over = _check_rows(rows)
    if over:
        # an RSS peak over its bound by noise (30.8 MB against 25.2 + 3 MiB was seen once in make
        # test; three runs alone after it were within) does not come back in a second job; a
        # buffer the rules do not count comes back every time: only a row over in both jobs fails
        again = {(where, name) for where, name, *_ in _check_rows(_bench(**job))}
        over = [o for o in over if (o[0], o[1]) in again]
    assert not over, over


def _check_rows(rows: list[dict], exact: tuple[str, ...] = EXACT) -> list[tuple]:
    """Asserts every row's ``exact`` figures equal the plan's and its split and warm-ups are whole;
    returns the (row, process, peak, bound) whose measured peak is over the plan's bound."""
    over = []
    for r in rows:
        p = _plan_of(r)
        diff = {k: (r[k], p.get(k)) for k in exact if k in r and r[k] != p.get(k)}
        assert not diff, f"{r['strategy']} ({r['layout']}, {r.get('reshard_path')}): bench vs plan {diff}"
        # measured peaks within the plan's bounds: the colocated tensor method's device (trainer
        # rank + its engine worker) within the trainer's rule; the disaggregated methods' trainer
        # ranks within it, their engine workers within the engine's rule (what arrives at once, +
        # the shard the reference engine stages). The peak is an RSS rise sampled every ms on a
        # loaded 2-CPU machine: besides the buffers the rules count it sees the allocator's arenas
        # and the gloo and pickle buffers of the calls (18.8 MiB against a 16 MiB bound was seen
        # once in make test), so each check allows NOISE above the bound; a buffer more than the
        # rules count (a 4 MiB bucket or more) still fails it
        where = f"{r['strategy']} ({r['layout']}, {r.get('reshard_path')})"
        if r["method"] == "tensor":
            peaks = {"device": (r["peak_extra_bytes"], p["peak_extra_bytes"])}
        else:
            peaks = {name: (peak, p["engine_rank_peak_extra_bytes" if name.startswith("engine")
                                    else "trainer_rank_peak_extra_bytes"])
                     for name, peak in r["peak_extra_by_process"].items()}
        over += [(where, name, peak, bound) for name, (peak, bound) in peaks.items() if peak > bound + NOISE]
        # where the time goes (bench `split`): the disk rows' parts, the per-rank distributed rows'
        want = {"disk": {"export_s", "file_write_s", "write_wait_s", "fsync_s", "read_hash_s", "copy_s", "load_s"},
                "distributed": {"export_s", "send_wait_s"}}.get(r["method"], set())
        if want and (r["layout"] == "engine" or r["method"] == "disk"):
            assert want <= set(r["split"]), (where, r["split"])
            assert all(v >= 0 for v in r["split"].values()), (where, r["split"])
        # the disk rows time the steady state: after keep-N (disk_keep 2) dropped a version whose
        # files the timed syncs reuse; the warm-up syncs' seconds are in the row
        assert len(r["warmup_seconds"]) == (3 if r["method"] == "disk" else 1), (where, r["warmup_seconds"])
        assert all(s > 0 for s in r["warmup_seconds"]), (where, r["warmup_seconds"])
    return over


# a narrow, deep FP8 model: 32 layers of 128 x 128 blocks, 52 MiB in bf16 (four 16 MiB buckets of
# full tensors, two of per-rank ones at TP 2),
# whose largest quantized tensor is 0.25 MiB, so the quantizer's float32 temporaries stay near 1 MiB
# while a quantized bucket is 8 MiB or more
FP8_DEEP = """model:
  model_type: qwen2
  vocab_size: 4096
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 32
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 128
  max_position_embeddings: 256
  rms_norm_eps: 1.0e-6
  rope_theta: 10000.0
  tie_word_embeddings: false
"""


@pytest.mark.timeout(400)
def test_fp8_peaks_stay_within_the_quantized_buckets_each_transport_holds(tmp_path):
    """FP8 over several buckets (tensor and distributed x full and engine, 16 MiB): every byte
    figure equals the plan's, and every measured peak stays within the plan's bound, which counts
    the quantized buckets each transport holds at once (`plan.quantized_buffers`), each as large as
    the largest quantized bucket of its plan. Before: one quantized bucket of the all-FP8 size
    (8 MiB) for every row, where the pipelined per-rank tensor path and the distributed method's
    trainer rank 0 hold two, and a bucket with the bf16 embedding quantizes to more: the tensor
    engine-layout device peaked at 48 MiB and distributed trainer rank 0 at 52 MiB, against 42 MiB.
    The bench's FP8 budgets are the plan's too (before: the bench added one all-FP8 bucket)."""
    model = tmp_path / "fp8-deep.yaml"
    model.write_text(FP8_DEEP)
    job = dict(models=(str(model),), methods=("tensor", "distributed"), layouts=("full", "engine"),
               bucket_mb=(16.0,), dtype="bfloat16", quantization=("fp8",))
    exact = EXACT
    rows = _bench(**job)
    assert {(r["method"], r["layout"]) for r in rows} == {(m, lay) for m in ("tensor", "distributed")
                                                          for lay in ("full", "engine")}
    assert all(r["quantization"] == "fp8" and _plan_of(r)["buckets"] >= 2 for r in rows)
    over = _check_rows(rows, exact)
    if over:    # noise does not come back in a second job; a buffer the plan does not count does
        again = {(where, name) for where, name, *_ in _check_rows(_bench(**job), exact)}
        over = [o for o in over if (o[0], o[1]) in again]
    assert not over, over


@pytest.mark.timeout(120)
def test_plan_counts_the_all_to_all_of_fused_moe_experts_exactly():
    """An MoE model whose experts FSDP2 shards as fused [E, 2I, H] tensors, cut per expert on
    export: the all-to-all bytes each trainer rank receives are the plan's, for the tensor method
    and for the disk method's per-rank files (whose rows ran host-shared, 0 bytes in, whatever
    --share-host-memory said)."""
    rows = _bench(models=("tiny-qwen3-moe",), methods=("tensor", "disk"), layouts=("engine",),
                  share_host_memory=(False,), bucket_mb=(0.25,))
    assert {r["method"] for r in rows} == {"tensor", "disk"}
    assert all(r["reshard_path"] == "all-to-all" and r["trainer_rank_bytes_in"] > 0
               and r["share_host_memory"] is False for r in rows), [(r["method"], r["reshard_path"]) for r in rows]
    for r in rows:
        p = _plan_of(r)
        assert {k: r[k] for k in EXACT if k in r} == {k: p[k] for k in EXACT if k in r}


def test_refusal_names_the_figures_and_suggests_the_largest_bucket_that_fits():
    job = dict(model="qwen3-30b-a3b", method="tensor", layout="full", dtype="bfloat16", ranks=8, tp=8,
               trainer_resident_bytes=4 * 2**30)
    with pytest.raises(PlanError) as info:
        plan_row(PlanJob(bucket_bytes=8 * 2**30, **job), "h100-node")
    msg, best = str(info.value), info.value.suggested_bucket_bytes
    for w in ("2 x max(bucket 8.0 GiB, largest tensor", "largest tensor", "exceeds", "gpu_memory_utilization 0.85", "--bucket-mb"):
        assert w in msg, (w, msg)
    assert best and best % MiB == 0 and f"--bucket-mb {best // MiB}" in msg
    ok = plan_row(PlanJob(bucket_bytes=best, **job), "h100-node")     # the suggestion fits ...
    assert ok["memory_budget_bytes"] <= ok["memory_free_bytes"]
    with pytest.raises(PlanError):                                     # ... and is the largest
        plan_row(PlanJob(bucket_bytes=best + MiB, **job), "h100-node")
    with pytest.raises(PlanError, match="no bucket fits"):             # the trainer's fp32 shard alone
        plan_row(PlanJob(bucket_bytes=2**30, **{**job, "trainer_resident_bytes": None}), "h100-node")


@pytest.mark.timeout(60)
def test_a_235b_moe_plans_on_the_meta_device():
    row = plan_row(PlanJob("qwen3-235b-a22b", "tensor", "engine", 2**30, "bfloat16", None, 8, 2, 8,
                           trainer_resident_bytes=0), "h100-node")
    _, module = meta_model("qwen3-235b-a22b")
    assert all(p.device.type == "meta" for p in module.parameters())
    assert 234e9 < row["params"] < 236e9 and row["bytes"] == 2 * row["params"]    # bf16
    assert row["engine_rank_bytes_in"] >= row["engine_rank_shard_bytes"]     # + alignment padding
    assert row["engine_calls"] == row["buckets"] > 1 and row["seconds"] > 0


def test_fp8_budget_adds_the_quantized_buckets_each_transport_holds():
    """As many quantized buckets as each transport keeps at once: the tensor method one per bucket
    in flight (two for pipelined per-rank buckets), the distributed method's trainer rank 0 two
    for full tensors and one per buffer set per-rank, disk one; each the largest quantized bucket
    of the plan, which is more than half a bf16 bucket where it holds the bf16 embedding."""
    from fsdp_sync.plan import quantized_bucket_bytes

    base = dict(model="tiny-fp8", bucket_bytes=MiB, dtype="bfloat16", ranks=2, tp=2, engine="reference")
    want = {("tensor", "full", True): 1, ("tensor", "engine", True): 2, ("tensor", "engine", False): 1,
            ("distributed", "full", True): 2, ("distributed", "full", False): 2,
            ("distributed", "engine", True): 2, ("distributed", "engine", False): 1,
            ("disk", "full", True): 1, ("disk", "engine", True): 1}
    for (method, layout, piped), n in want.items():
        job = dict(base, method=method, layout=layout, pipelined=piped)
        bf16, fp8 = plan_row(PlanJob(**job), CPU), plan_row(PlanJob(**job, quantization="fp8"), CPU)
        assert fp8["bytes"] < bf16["bytes"] and fp8["engine_rank_shard_bytes"] < bf16["engine_rank_shard_bytes"]
        q, scratch = fp8["quantized_bucket_bytes"], fp8["quantize_scratch_bytes"]
        assert fp8["memory_budget_bytes"] - bf16["memory_budget_bytes"] == n * q + scratch, (method, layout, piped)
        assert fp8["memory_budget_rule"].endswith((f"{n} quantized buckets" if n > 1 else "the quantized bucket")
                                                  + " + the quantizer's scratch")
        # the quantizer's scratch: the largest tensor it quantizes on this path, whole or its engine rank's piece
        from fsdp_sync.weights.fp8 import quantize_scratch_bytes
        from fsdp_sync.weights.layout import layout_for

        lay = layout_for(meta_model("tiny-fp8")[0], 2)
        shapes = lay.engine_shapes() if layout == "engine" else lay.hf_shapes
        assert scratch == max(quantize_scratch_bytes(shapes[n], 2) for n in shapes if n.endswith("proj.weight"))
    # qwen2-160m's embedding and lm_head (46.9 MiB each, half of it per engine rank at TP 2) stay
    # bf16: the quantized copy of a 64 MiB bucket that holds one is more than the all-FP8 32 MiB
    for method, layout in (("tensor", "full"), ("tensor", "engine"), ("distributed", "full")):
        row = plan_row(PlanJob("qwen2-160m", method, layout, 64 * MiB, "bfloat16", "fp8", 2, 2, 2), "h100-node")
        assert row["quantized_bucket_bytes"] > 40 * MiB > quantized_bucket_bytes(64 * MiB, torch.bfloat16), row


BAD = [
    ("plan --bucket-mb 0", ["--bucket-mb", "positive number"]),
    ("plan --ranks 3 --tp 2", ["--ranks 3", "--tp 2", "multiple"]),
    ("plan --ep 3 --tp 2", ["--ep 3", "--tp 2", "divide"]),
    ("plan --models nope", ["--models", "'nope'"]),
    ("plan --layout auto", ["--layout", "full, engine"]),
    ("plan --cluster mars", ["--cluster", "h100-node", "this-machine"]),
    ("plan --gpu-memory-utilization 1.5", ["--gpu-memory-utilization", "(0, 1)"]),
    ("plan --config-json /nonexistent/config.json", ["--config-json", "no such file"]),
    ("plan --models tiny --tp 3 --ranks 3", ["--models tiny", "--tp 3", "num_attention_heads"]),
    ("plan --recipe nope", ["--recipe", "no such file or shipped plan sweep"]),
    ("plan --recipe bucket_sweep", ["--recipe", "shipped plan sweep: 'bucket_sweep'", "plan_moe_h100"]),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[a for a, _ in BAD])
def test_bad_plan_flags_give_one_line_and_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv.split())
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def test_plan_cli_writes_rows_under_the_bench_names(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    from fsdp_sync.models import load_config

    cfg.write_text(json.dumps(load_config("tiny-qwen3-moe").to_dict()))
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--config-json", str(cfg), "--methods", "tensor,distributed,disk",
                   "--layout", "full,engine", "--ranks", "2", "--tp", "2", "--ep", "2", "--bucket-mb", "0.25",
                   "--cluster", "h100-node", "--engine", "reference", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["ep"] == 2 for r in rows)
    for k in ("engine_rank_bytes_in", "engine_rank_shard_bytes", "trainer_rank_bytes_in", "peak_extra_bytes",
              "memory_budget_bytes", "seconds", "engine_calls", "bytes"):
        assert all(k in r for r in rows), k
    assert "refused" not in capsys.readouterr().out
    # a plan that cannot fit: refused, with the bucket that would, exit 1
    rc = cli.main(["plan", "--models", "qwen3-30b-a3b", "--ranks", "8", "--tp", "8", "--dtype", "bfloat16",
                   "--bucket-mb", "8192", "--trainer-resident-gib", "4", "--cluster", "h100-node"])
    text = capsys.readouterr().out
    assert rc == 1 and "refused" in text and "--bucket-mb" in text


def _phase(row: dict, what: str) -> float:
    hits = [p["seconds"] for p in row["phases"] if p["what"].startswith(what)]
    assert len(hits) == 1, (what, [p["what"] for p in row["phases"]])
    return hits[0]


def test_a_cpu_hosts_costs_are_priced_only_where_measured():
    """A CPU host's first touch of the sync's fresh buffers, an engine mapping a shared bucket and
    its cores: each priced from its own figure (bytes over the rate), absent on a cluster
    without them (a GPU preset), and the pipeline not overlapped when processes outnumber cores."""
    import dataclasses

    host = dataclasses.replace(CPU, cores=2, touch_gbps=2.0, map_gbps=10.0, collective_gbps=0.5)
    job = dict(model="small", method="tensor", bucket_bytes=MiB, dtype="float32", ranks=2, tp=2,
               engine="reference")
    full = plan_row(PlanJob(layout="full", **job), host)
    unit = full["largest_tensor_bytes"]        # small: every tensor over 1 MiB goes alone
    assert _phase(full, "first touch of the sync's fresh buffers") == pytest.approx(unit // 2 / 2e9)
    assert _phase(full, "engine rank maps") == pytest.approx(full["engine_rank_bytes_in"] / 10e9)
    assert _phase(full, "engine calls") == pytest.approx(full["engine_calls"] * (CPU.call_s + 2 * CPU.collective_s))
    bare = plan_row(PlanJob(layout="full", **job), CPU)
    assert not [p for p in bare["phases"] if "touch" in p["what"] or "maps" in p["what"]]

    piped = plan_row(PlanJob(layout="engine", **job), dataclasses.replace(host, cores=0))
    assert piped["estimate_rule"].endswith("(pipelined)")
    turns = plan_row(PlanJob(layout="engine", **job), host)        # 2 ranks + 2 workers on 2 cores
    assert "not overlapped: 4 processes on 2 cores" in turns["estimate_rule"]
    assert turns["seconds"] == pytest.approx(sum(p["seconds"] for p in turns["phases"]))
    assert turns["seconds"] > piped["seconds"]

    # the reference engine stages what the disaggregated methods push: two copies of its shard
    dist_job = dict(job, method="distributed", share_host_memory=False)
    ref = plan_row(PlanJob(layout="full", **dist_job), host)
    sgl = plan_row(PlanJob(layout="full", **{**dist_job, "engine": "sglang"}), host)
    assert _phase(ref, "engine rank copies") == pytest.approx(2 * _phase(sgl, "engine rank copies"))
    # the trainer's gather at the collectives' rate, the sends to the engines at the link's
    assert _phase(ref, "gather the other ranks'") == pytest.approx(
        (ref["model_bytes"] - ref["model_bytes"] // 2) / 0.5e9 + ref["buckets"] * CPU.collective_s)


def test_cluster_figures_are_checked_and_old_cluster_files_still_load(tmp_path):
    from fsdp_sync.plan import load_cluster

    with pytest.raises(ValueError, match="touch_gbps must be >= 0"):
        Cluster("x", "cpu", 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, touch_gbps=-1.0)
    old = {k: v for k, v in CPU.to_dict().items() if k not in ("cores", "touch_gbps", "map_gbps", "collective_gbps")}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(old))
    assert load_cluster(path) == CPU            # the costs it does not name stay unpriced


@pytest.mark.timeout(600)
def test_this_machine_is_measured():
    import os

    from fsdp_sync.cli.plan import measure_this_machine

    c = measure_this_machine(nbytes=8 * MiB, repeats=2)
    assert c.device == "cpu" and c.cores == len(os.sched_getaffinity(0))
    for f in ("d2d_gbps", "intra_gbps", "touch_gbps", "map_gbps", "collective_gbps", "disk_write_gbps",
              "disk_read_gbps", "call_s", "collective_s"):
        assert getattr(c, f) > 0, f
    # solved from three timed syncs on a shared host: each >= 0 (noise may zero one), together
    # the one-bucket sync's seconds beyond its bytes
    assert min(c.tensor_s, c.bucket_s, c.sync_s) >= 0 and c.tensor_s + c.bucket_s + c.sync_s > 0
    assert "fresh shared buffer" in c.source and "us/tensor" in c.source and "ms/bucket" in c.source
    # the FP8 quantizer, timed on this machine's device: a rate and a per-tensor cost
    assert c.quantize_gbps > 0 and c.quantize_tensor_s >= 0 and "FP8 bucket quantizer on cpu" in c.source


# what `_measure_rank` and `_measure_sync_rank` returned on a host, figures as measured there
HOST = {"copy_s": 0.02, "gather_s": 0.5, "gather_bytes": 32 * MiB, "collective_s": 2e-4, "call_s": 1e-4,
        "disk_write_s": 0.1, "disk_read_s": 0.05, "send_s": 0.04, "touch_s": 0.01, "map_s": 0.005}
COSTS = {"full": {"tensor_s": 3e-5, "bucket_s": 4e-3, "sync_s": 2e-3},
         "engine": {"tensor_s": 5e-5, "bucket_s": 6e-3, "sync_s": 4e-3},
         "quantize": {"quantize_gbps": 150.0, "quantize_tensor_s": 4e-5,
                      "quantize_measured": "89 MiB in 7 tensors 0.6 ms, 5.0 MiB in 112 tensors 4.5 ms"}}


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_this_machine_with_gpus_is_a_gpu_cluster(gpus):
    """Issue 35: `plan --cluster this-machine` on a GPU host prices the GPU, not the host: device
    cuda, its GPUs and their memory, d2d from a copy on GPU 0, intra from a copy between two GPUs
    (one GPU: the host's send, said in the source), no host-only costs (cores, first touch,
    mapping); the measured per-tensor, per-bucket, per-sync and quantizer costs on both kinds."""
    from fsdp_sync.cli.plan import GPU_COPY, cluster_of

    dev = None if not gpus else {"name": "NVIDIA H100 80GB HBM3", "count": gpus, "memory": 85 * 10**9,
                                 "copy_s": 0.0006, **({"peer_copy_s": 0.003} if gpus > 1 else {})}
    c = cluster_of(HOST, {**COSTS, "device": dev}, 64 * MiB, 2, 16 * 2**30)
    send = 64 * MiB / 0.04 / 1e9
    assert c.tensor_s == pytest.approx(4e-5) and c.bucket_s == pytest.approx(5e-3) and c.sync_s == pytest.approx(3e-3)
    assert (c.quantize_gbps, c.quantize_tensor_s) == (150.0, 4e-5) and "89 MiB in 7 tensors" in c.source
    assert c.inter_gbps == pytest.approx(send) and c.call_s == 1e-4 and c.collective_s == 2e-4
    if not gpus:
        assert (c.device, c.gpus_per_node, c.memory_per_gpu, c.cores) == ("cpu", 1024, 16 * 2**30, 2)
        assert c.d2d_gbps == pytest.approx(64 * MiB / 0.02 / 1e9) and c.touch_gbps > 0 and c.map_gbps > 0
        return
    assert (c.device, c.gpus_per_node, c.memory_per_gpu) == ("cuda", gpus, 85 * 10**9)
    assert c.d2d_gbps == pytest.approx(GPU_COPY / 0.0006 / 1e9)
    assert (c.cores, c.touch_gbps, c.map_gbps, c.collective_gbps) == (0, 0.0, 0.0, 0.0)
    assert "NVIDIA H100 80GB HBM3" in c.source and "tensor-method syncs on cuda" in c.source
    if gpus == 1:
        assert c.intra_gbps == pytest.approx(send) and "one GPU: intra is the host's gloo send" in c.source
    else:
        assert c.intra_gbps == pytest.approx(GPU_COPY / 0.003 / 1e9) and "GPU 0 to GPU 1" in c.source
    # a plan on it is a GPU plan: a one-rank FP8 sync prices the quantizer on top of the bytes
    job = PlanJob(model="tiny-fp8", method="tensor", layout="engine", bucket_bytes=64 << 10, dtype="bfloat16",
                  ranks=1, tp=1, engine="reference", quantization="fp8")
    row = plan_row(job, c)
    assert row["device"] == "cuda" and _phase(row, "quantize to FP8") > 0


@pytest.mark.parametrize("method, layout", [("tensor", "full"), ("tensor", "engine"), ("distributed", "full"),
                                            ("distributed", "engine"), ("disk", "full"), ("disk", "engine")])
def test_fp8_quantization_is_priced_as_each_transport_quantizes(method, layout):
    """What the busiest trainer rank passes through the quantizer: every rank the whole model
    (tensor, full), its own engine rank's share (tensor, engine), rank 0 the whole model or every
    engine rank's share (distributed), each writer its part (disk); priced at the cluster's rate
    plus its per-tensor cost, and not at all where the cluster has no quantizer figures."""
    import dataclasses

    from fsdp_sync.weights.fp8 import quantized_layout
    from fsdp_sync.weights.layout import layout_for

    q = dataclasses.replace(CPU, quantize_gbps=0.5, quantize_tensor_s=1e-4)
    job = PlanJob(model="tiny-fp8", method=method, layout=layout, bucket_bytes=64 << 10, dtype="bfloat16",
                  ranks=2, tp=2, engine="reference", quantization="fp8")
    row, bare = plan_row(job, q), plan_row(job, CPU)
    cfg, module = meta_model("tiny-fp8")
    held = quantized_layout(layout_for(cfg, 2), "fp8")
    model = sum(p.numel() * 2 for p in module.parameters())
    whole = len([n for n in held.hf_shapes if n in held.quantized])
    shard = sum(math.prod(s) * 2 for s in layout_for(cfg, 2).engine_shapes().values())
    # disk, full: bucket k written (and quantized) by writer k % 2; the busier writer's share
    from fsdp_sync.weights.export import param_metas
    from fsdp_sync.weights.bucket import plan_buckets

    buckets = plan_buckets(param_metas(module, torch.bfloat16), 64 << 10)
    q_in = [n for n in held.hf_shapes if n in held.quantized]
    writers = [(sum(b.payload_bytes for b in buckets[w::2]),
                sum(e.name in q_in for b in buckets[w::2] for e in b.entries)) for w in range(2)]
    want = {("tensor", "full"): (model, whole), ("distributed", "full"): (model, whole),
            ("disk", "full"): (max(w[0] for w in writers), max(w[1] for w in writers)),
            ("tensor", "engine"): (shard, None),
            ("distributed", "engine"): (2 * shard, None), ("disk", "engine"): (shard, None)}[(method, layout)]
    assert row["quantize_bytes_in"] == pytest.approx(want[0], rel=0.01), row["quantize_bytes_in"]
    if want[1] is not None:
        assert row["quantized_tensors"] == math.ceil(want[1])
    assert _phase(row, "quantize to FP8") == pytest.approx(row["quantize_bytes_in"] / 0.5e9
                                                           + row["quantized_tensors"] * 1e-4)
    assert not [p for p in bare["phases"] if p["what"].startswith("quantize")]


@pytest.mark.parametrize("layout", ["full", "engine"])
def test_per_tensor_per_bucket_and_per_sync_costs_are_priced_for_the_tensor_method(layout):
    """Issue 35: what bytes do not explain (a GPU sync of qwen2-1500m: one copy launch per tensor,
    one engine round trip per bucket) is priced where the cluster has the figures: the tensors as
    the sync counts them (full: every exported tensor; engine: every engine parameter, qkv and
    gate_up fused), the buckets' engine calls at ``bucket_s`` instead of ``call_s`` + 2
    collectives, one bracket per sync; absent (not priced) on a cluster without them."""
    import dataclasses

    from fsdp_sync.weights.layout import layout_for

    job = PlanJob(model="tiny", method="tensor", layout=layout, bucket_bytes=64 << 10, dtype="float32",
                  ranks=1, tp=1, engine="reference")
    priced = dataclasses.replace(CPU, tensor_s=1e-4, bucket_s=3e-3, sync_s=5e-3)
    row, bare = plan_row(job, priced), plan_row(job, CPU)
    tensors = row["exported_tensors"] if layout == "full" else len(layout_for(meta_model("tiny")[0], 1).engine_shapes())
    assert row["sync_tensors"] == tensors and (layout == "full" or tensors < row["exported_tensors"])
    assert _phase(row, "per-tensor host work") == pytest.approx(tensors * 1e-4)
    assert _phase(row, "engine calls") == pytest.approx(row["buckets"] * 3e-3) and row["buckets"] > 1
    assert _phase(row, "per-sync engine bracket") == pytest.approx(5e-3)
    assert row["seconds"] == pytest.approx(bare["seconds"] + tensors * 1e-4 + row["buckets"] * (
        3e-3 - CPU.call_s - 2 * CPU.collective_s) + 5e-3)
    assert not [p for p in bare["phases"] if p["what"].startswith(("per-tensor", "per-sync"))]
    with pytest.raises(ValueError, match="tensor_s must be >= 0"):
        dataclasses.replace(CPU, tensor_s=-1.0)


def test_sglang_at_tp_2_on_cuda_budgets_the_buffers_that_take_turns():
    """SGLang at TP > 1 may answer before every rank read a CUDA bucket, so the trainer's buffers
    take turns (`transport.buffers.ReusedBuffer`'s lag): one bucket more where two are in flight
    (per-rank buckets, pipelined), one more quantized bucket; not for the reference engine (it
    answers once every worker's copies are done), TP 1, or the full layout without FP8."""
    def row(**kw) -> dict:
        job = dict(model="qwen2-1500m", method="tensor", layout="engine", bucket_bytes=64 * MiB,
                   dtype="bfloat16", ranks=2, fsdp=2, tp=2, engine="sglang")
        return plan_row(PlanJob(**{**job, **kw}), "h100-node")

    def budget(**kw) -> tuple[int, str]:
        r = row(**kw)
        return r["memory_budget_bytes"], r["memory_budget_rule"]

    turns, rule = budget()
    base, base_rule = budget(engine="reference")
    assert rule.startswith("3 x") and base_rule.startswith("2 x"), (rule, base_rule)
    assert turns - base == max(64 * MiB, row()["largest_tensor_bytes"])
    assert budget(tp=1) == budget(tp=1, engine="reference")
    assert budget(layout="full") == budget(layout="full", engine="reference")
    assert budget(pipelined=False) == budget(pipelined=False, engine="reference")
    q_turns, q_rule = budget(layout="full", quantization="fp8")
    q_base, _ = budget(layout="full", quantization="fp8", engine="reference")
    assert "2 quantized buckets" in q_rule and q_turns > q_base


def test_a_pipeline_overlaps_sides_not_the_copies_that_share_one_memory():
    """Pipelining makes bucket k+1 while bucket k is sent and loaded: the trainer's phases still
    follow one another (fill, then touch its next buffer), the engine's too, and a colocated
    engine's copies go through the memory the trainer fills, so they take turns with the trainer's.
    On this 2-core host the old rule (the slowest single phase) put the engine-layout row of
    qwen2-160m at 0.15 s against 0.25-0.27 s measured (docs/plan.md); it is now 0.23 s."""
    import dataclasses

    host = dataclasses.replace(CPU, cores=0, touch_gbps=1.4, map_gbps=12.7, tensor_s=2e-4,
                               bucket_s=2e-3, sync_s=4e-3)
    row = plan_row(PlanJob(model="small", method="tensor", layout="engine", bucket_bytes=MiB,
                           dtype="float32", ranks=1, tp=1, engine="reference"), host)
    assert row["estimate_rule"].endswith("(pipelined)")
    ph = {p["what"]: p["seconds"] for p in row["phases"]}
    copies = (_phase(row, "copy my shard") + _phase(row, "first touch of the sync's")
              + _phase(row, "engine rank copies"))
    overheads = _phase(row, "engine calls") + _phase(row, "per-tensor") + _phase(row, "per-sync")
    assert row["seconds"] >= copies + overheads
    assert row["seconds"] < sum(ph.values())          # the engine's mapping still overlaps

    # disaggregated: the trainer's gather and fill in turn, overlapped with the send and the load
    dist = plan_row(PlanJob(model="small", method="distributed", layout="full", bucket_bytes=MiB,
                            dtype="float32", ranks=2, tp=1, engine="sglang",
                            share_host_memory=False), dataclasses.replace(CPU, cores=0))
    assert dist["estimate_rule"].endswith("(pipelined)")
    trainer = _phase(dist, "copy my shard") + _phase(dist, "gather the other ranks'")
    assert dist["seconds"] >= trainer
    assert dist["seconds"] < sum(p["seconds"] for p in dist["phases"])


def test_plan_job_checks_its_field_types():
    """A bool field takes a bool (a YAML "no" is a truthy str), an integer field an int (not True,
    which equals 1), a fraction a number: each refused as a ValueError naming the field."""
    job = dict(model="tiny", method="tensor", layout="engine", bucket_bytes=MiB, ranks=2, tp=2)
    for kw, field in [({"share_host_memory": "no"}, "share_host_memory"), ({"pipelined": "false"}, "pipelined"),
                      ({"share_host_memory": 1}, "share_host_memory"), ({"ranks": True}, "ranks"),
                      ({"fsdp": True}, "fsdp"), ({"bucket_bytes": 1.5}, "bucket_bytes"),
                      ({"replicas": "2", "method": "disk"}, "replicas"),
                      ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
                      ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
                      ({"trainer_resident_bytes": -1}, "trainer_resident_bytes"),
                      ({"trainer_dtype": "int8"}, "trainer_dtype")]:
        with pytest.raises(ValueError, match=field):
            PlanJob(**{**job, **kw})
    assert PlanJob(**job, share_host_memory=False, pipelined=False).share_host_memory is False


RECIPES = [     # (YAML under plan:, the words of its one-line refusal)
    ("models: tiny\nmethods: tensor\nranks: 0", ["ranks: 0", "positive integer"]),
    ("models: [nope]", ["models: 'nope'", "no model recipe"]),
    ("models: [tiny]\nbucket_mb: [-5]", ["bucket_mb: -5", "positive number"]),
    ("models: [tiny]\nbucket_mb: [64, 0.0000001]", ["bucket_mb: 1e-07", "at least 1 byte"]),
    ("models: [tiny]\ncluster: nope", ["cluster: 'nope'", "h100-node"]),
    ("models: [tiny]\nmethods: [teleport]", ["methods: 'teleport'", "tensor, distributed, disk"]),
    ("models: [tiny]\ndtype: int8", ["dtype: 'int8'", "float32"]),
    ("models: [tiny]\ngpu_memory_utilization: 2", ["gpu_memory_utilization: 2", "(0, 1)"]),
    ("models: [tiny]\nshare_host_memory: maybe", ["share_host_memory: 'maybe'", "on or off"]),
    ("models: [tiny]\npipelined: [true]", ["pipelined: [True]", "one value"]),
    ("models: [tiny]\nranks: [true]", ["ranks: True", "positive integer"]),
    ("models: [tiny]\nfsdp: 3", ["fsdp: 3", "1, 2"]),
    ("models: [tiny]\ntrainer_resident_gib: -1", ["trainer_resident_gib: -1", ">= 0"]),
    ("models: [tiny]\ncluster: bad-cluster.json", ["cluster: bad-cluster.json", "unknown cluster fields"]),
    # a model its tp / quantization cannot split (H82: named "--models tiny at --tp 3", flags never given)
    ("models: [tiny]\ntp: [3]\nmethods: [disk]", ["models: tiny at tp 3 ep 1", "num_attention_heads (4)"]),
    ("models: [tiny]\nquantization: fp8", ["models: tiny at tp 2 ep 1 quantization fp8", "block FP8"]),
]


@pytest.mark.parametrize("body, words", RECIPES, ids=[b.splitlines()[-1] for b, _ in RECIPES])
def test_recipe_values_are_checked_as_the_flags_are(body, words, tmp_path, capsys, monkeypatch):
    """Every value a recipe gives is checked as its flag's text is: one line naming the recipe,
    the key and the value, exit code 2, no traceback from PlanJob or load_cluster."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad-cluster.json").write_text(json.dumps({**CPU.to_dict(), "warp_gbps": 1.0}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("plan:\n  " + body.replace("\n", "\n  ") + "\n")
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["plan", "--recipe", str(recipe)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    for w in ["--recipe", str(recipe), *words]:
        assert w in err, (w, err)
    assert f"--recipe {recipe}: " in err and "--tp" not in err and "--models" not in err, err  # its keys, not flags


def test_a_recipes_bool_spellings_are_read_as_the_flags_are(tmp_path, monkeypatch):
    """``share_host_memory: "no"`` and ``pipelined: "false"`` are off, as ``--share-host-memory no``
    is (they were read as True: a host-shared row showing ``pipelined: "false"``); ``layout:``,
    the flag's name, is the key ``layouts``."""
    from fsdp_sync.cli.plan import plan_rows

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu.json").write_text(json.dumps(CPU.to_dict()))
    recipe = tmp_path / "r.yaml"
    recipe.write_text('plan:\n  models: [tiny]\n  layout: [engine]\n  pipelined: "false"\n'
                      '  share_host_memory: "no"\n  cluster: cpu.json\n  quantization: null\n')
    args = cli.parse_args(["plan", "--recipe", str(recipe)])
    assert args.sweep["share_host_memory"] is False and args.sweep["pipelined"] is False
    (row,) = plan_rows(args.sweep, CPU)
    assert row["share_host_memory"] is False and row["pipelined"] is False
    assert row["reshard_path"] == "all-to-all" and row["trainer_rank_bytes_in"] > 0


@pytest.mark.timeout(120)
def test_a_colocated_gpu_has_one_budget():
    """The tensor method's engine shares the trainer's GPU: its budget is the device's, the
    trainer's rule with the same layout, pipelining, turns and quantization (it was the bare
    2 x rule: 1.74 GiB beside the trainer's 2.32 GiB for one GPU of plan_moe_h100)."""
    moe = dict(model="qwen3-30b-a3b", method="tensor", bucket_bytes=256 * MiB, dtype="bfloat16",
               ranks=8, tp=8, gpu_memory_utilization=0.7)
    fp8 = dict(model="tiny-fp8", method="tensor", bucket_bytes=MiB, dtype="bfloat16", ranks=2, tp=2,
               quantization="fp8")
    for job in (dict(moe, layout="engine"), dict(moe, layout="full"), dict(fp8, layout="engine"),
                dict(fp8, layout="full"), dict(fp8, layout="engine", engine="reference")):
        row = plan_row(PlanJob(**job), "h100-node")
        assert row["engine_memory_budget_bytes"] == row["memory_budget_bytes"] == row["peak_extra_bytes"], job
        assert row["engine_memory_budget_rule"] == row["memory_budget_rule"] + " (the trainer's device)"
    assert plan_row(PlanJob(**moe, layout="engine"), "h100-node")["memory_budget_rule"].startswith("3 x")


def test_disk_full_rows_count_the_all_gather():
    """The disk method's HF files are cut from gathered buckets: without the host-shared buffer
    each trainer rank receives the other ranks' shards, the bytes its own gather phase prices."""
    big = plan_row(PlanJob("qwen3-30b-a3b", method="disk", layout="full", bucket_bytes=1 << 30,
                           dtype="bfloat16", ranks=8, tp=8), "h100-node")
    assert big["path"] == "all-gather" and _phase(big, "gather the other ranks'") > 0
    # the busiest rank: the others' pieces, whole experts broadcast by the rank that holds them
    assert big["trainer_rank_bytes_in"] >= big["allgather_bytes_in"] > 50e9
    job = dict(model="small", method="disk", layout="full", bucket_bytes=MiB, dtype="float32", tp=2)
    assert plan_row(PlanJob(**job, ranks=2), CPU)["trainer_rank_bytes_in"] == 0          # host-shared
    off = plan_row(PlanJob(**job, ranks=2, share_host_memory=False), CPU)
    assert off["path"] == "all-gather" and off["trainer_rank_bytes_in"] > 0
    one = plan_row(PlanJob(**{**job, "tp": 1}, ranks=1), CPU)
    assert one["path"] == "local" and one["trainer_rank_bytes_in"] == 0


def test_the_reference_engine_copies_per_rank_disk_files_once():
    """The reference engine hashes a per-rank disk file, then reads it straight into its weights
    (`weights.verified_file`): one copy, not the staged second copy it makes of Hugging Face files
    and distributed updates (the plan priced one for per-rank files too: 1.91x the bench's time)."""
    def load(layout, method="disk"):
        row = plan_row(PlanJob("small", method=method, layout=layout, bucket_bytes=MiB, dtype="float32",
                               ranks=2, tp=2, engine="reference"), CPU)
        (p,) = [p for p in row["phases"] if p["what"].startswith("engine rank copies its shard in")]
        return row, p

    row, per_rank = load("engine")
    assert "staged" not in per_rank["what"]
    assert per_rank["seconds"] == pytest.approx(row["engine_rank_bytes_in"] / (CPU.d2d_gbps * 1e9))
    for method, layout in (("disk", "full"), ("distributed", "engine")):
        row, staged = load(layout, method)
        assert "staged" in staged["what"], (method, layout)


def test_fsdp1_plans_the_state_dict_type_the_sync_exports_through():
    """--fsdp 1 planned the all-to-all of flat-parameter pieces (8,925,696 bytes into a rank of
    `small` at 2 ranks, a 24 MiB budget) whatever the sync exported through; SyncConfig's default,
    fsdp1_state_dict "full", has torch all-gather the whole model on every rank (17,838,592 bytes
    measured, path local, RSS up 82-92 MB). Now the plan follows the type, SyncConfig's default."""
    from fsdp_sync.config import SyncConfig

    job = dict(model="small", method="tensor", layout="engine", bucket_bytes=MiB, dtype="float32", ranks=2,
               fsdp=1, tp=2, share_host_memory=False, engine="reference")
    assert PlanJob(**job).fsdp1_state_dict == SyncConfig().fsdp1_state_dict == "full"
    full, sharded, local = (plan_row(PlanJob(**job, fsdp1_state_dict=k), CPU) for k in ("full", "sharded", "local"))
    fsdp2 = plan_row(PlanJob(**{**job, "fsdp": 2}), CPU)
    model = full["params"] * 4
    assert (full["reshard_path"], full["trainer_rank_bytes_in"]) == ("local", 17_838_592 == model // 2 and model // 2)
    # its own engine rank's buffers (none exchanged), the state dict's 2 x the model (before: every
    # engine rank's buffers, 2 x 2 x 8 MiB, which the tensor method no longer builds)
    assert full["memory_budget_bytes"] == 2 * 8 * MiB + 8 * MiB + 2 * model >= 92 * 10**6
    # the disk method's writer: the buffers of the files it writes, ceil(tp / ranks) a bucket
    for tp, n in ((2, 1), (4, 2)):
        disk = plan_row(PlanJob(**{**job, "method": "disk", "tp": tp}), CPU)
        assert disk["memory_budget_bytes"] == 3 * n * 8 * MiB + 8 * MiB + 2 * model, (tp, disk["memory_budget_rule"])
    assert sharded["trainer_rank_bytes_in"] == model // 2 + fsdp2["trainer_rank_bytes_in"] == 19_418_112
    assert (local["reshard_path"], local["trainer_rank_bytes_in"]) == ("all-to-all", 8_925_696)
    assert local["memory_budget_bytes"] == fsdp2["memory_budget_bytes"]
    assert _phase(full, "FSDP1's state dict") > 0 and not [p for p in local["phases"] if "state dict" in p["what"]]
    with pytest.raises(ValueError, match="fsdp1_state_dict must be"):
        PlanJob(**job, fsdp1_state_dict="fulll")


@pytest.mark.parametrize("model,ranks,want", [("tiny-qwen2-moe", 2, 330_368), ("tiny-mixtral", 8, 713_312)])
def test_the_all_gather_counts_the_busiest_rank(model, ranks, want):
    """The full layout's trainer_rank_bytes_in was model - model // ranks (330,112; 662,368): the
    bytes the busiest rank receives (counted on the collectives) are more where torch.chunk splits
    unevenly and one rank holds an expert whole (broadcast from it)."""
    row = plan_row(PlanJob(model, "tensor", "full", MiB, "float32", None, ranks, 2, 2,
                           share_host_memory=False), CPU)
    assert row["trainer_rank_bytes_in"] == want
    dist = plan_row(PlanJob(model, "distributed", "full", MiB, "float32", None, ranks, 2, 2), CPU)
    counts = sum(math.prod(p.shape) for p in meta_model(model)[1].parameters()) * 4
    assert dist["path"] == "gather" and dist["trainer_rank_bytes_in"] < counts   # only rank 0 receives


def test_a_cpu_host_is_checked_against_its_ram_without_a_gpu_fraction():
    """On a CPU host (--cluster this-machine) the plan kept 15% of the RAM (1 - 0.85) and refused a
    1-layer qwen2 of 131,072 vocab (2.19 GB fp32) that syncs on a 23.5 GiB host (RSS up 1.07 GB).
    Now every trainer rank's and engine worker's rule together against the RAM, less the shards."""
    import dataclasses

    from fsdp_sync.models import load_config

    cfg = load_config("qwen2-160m", vocab_size=131072, hidden_size=2048, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2)
    host = dataclasses.replace(CPU, memory_per_gpu=int(23.5 * 2**30))
    job = dict(model=cfg, method="tensor", layout="full", bucket_bytes=64 * MiB, dtype="float32", ranks=1, tp=1)
    row = plan_row(PlanJob(**job), host)
    model = row["model_bytes"]
    assert row["memory_free_bytes"] == host.memory_per_gpu - 2 * model       # trainer shard + engine weights
    small = dataclasses.replace(CPU, memory_per_gpu=2 * model + row["memory_budget_bytes"] // 2)
    with pytest.raises(PlanError, match="host's .* RAM .* gpu_memory_utilization is a GPU's"):
        plan_row(PlanJob(**job), small)
    two = plan_row(PlanJob(**{**job, "method": "distributed", "ranks": 2}), host)    # the sum of every process
    assert two["memory_free_bytes"] == host.memory_per_gpu - model - model
