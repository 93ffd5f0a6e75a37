"""`fsdp-sync plan`'s byte arithmetic against the code that really splits, packs and writes the
bytes, in-process (audit H19's mutation pass of plan.py / plan_bytes.py; every test here killed a
mutant the plan tests without a bench run let through):

- each trainer rank's elements of every exported tensor (`plan_bytes.fsdp_counts`) at a world
  that does not divide the rows: FSDP2's ``Shard(0)`` is torch.chunk's split (a fused expert
  tensor's per-expert parts ranges of the rank's chunk, named as the export names them), FSDP1's
  flat parameter torch's own ``FlatParamHandle`` shard (padded to a multiple of the world), and
  the FSDP1 state dict's all-gather the padded shards;
- the distributed method's buckets: SGLang's tight layout (`bucket.plan_tight`, not the padded
  `plan_buckets`), a model whose norms are not 16-byte multiples, where the two differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_sync.plan import meta_model
from fsdp_sync.plan_bytes import fsdp1_unit_numels, fsdp_counts, state_dict_bytes_in


def test_fsdp2_counts_are_torch_chunks_split_and_the_exports_names():
    """World 3 over rows of 64, 128, 512 and 8 experts (none divides): torch.chunk gives the
    trailing rank fewer rows (or none); the plan counts what chunk gives each rank. A fused expert
    tensor ([E, 2I, H]) is cut per expert on export: its parts' counts are the ranges of each
    rank's chunk, and every name the export yields is counted. Killed: a floor split (the last
    rank's remainder dropped) and fused tensors counted under their own name."""
    from fsdp_sync.weights.export import param_metas

    for name in ("tiny", "tiny-qwen3-moe"):
        _, module = meta_model(name)
        world = 3
        counts = fsdp_counts(module, world, 2)
        assert set(counts) == {m.name for m in param_metas(module)}, name
        fused = {}
        for pn, p in dict(module.named_parameters()).items():
            want = tuple(c.numel() for c in torch.chunk(torch.empty(p.shape, device="meta"), world, 0))
            want += (0,) * (world - len(want))
            hf = pn
            if hf in counts:
                assert counts[hf] == want, (name, hf, counts[hf], want)
            else:                      # a fused tensor: its parts' counts sum to the chunk's
                fused[pn] = want
        parts = [k for k in counts if ".experts." in k]
        if name == "tiny-qwen3-moe":
            assert fused and parts, (fused, parts[:3])
            for pn, want in fused.items():
                prefix = pn.rsplit(".", 1)[0] + "."        # ...mlp.experts.
                ends = ("gate_proj.weight", "up_proj.weight") if pn.endswith("gate_up_proj") else ("down_proj.weight",)
                mine = [counts[k] for k in counts if k.startswith(prefix) and k.endswith(ends)]
                assert tuple(sum(c[r] for c in mine) for r in range(world)) == want, (pn, want)


def test_fsdp1_counts_are_torchs_flat_parameter_shards():
    """World 3, one flat parameter per decoder layer and the root's: each rank's elements of a
    unit are torch's `FlatParamHandle._get_unpadded_shard` of it, and the FSDP1 state dict's
    all-gather brings world - 1 padded shards (`_get_shard`) of every unit. Killed: an unpadded
    split (a unit's last elements on no rank), a state dict counted without the padding, and a
    tied model's shared embedding counted twice."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    for name in ("tiny", "tiny-tied"):     # tied: one flat parameter holds the shared embedding once
        _, module = meta_model(name)
        world = 3
        counts = fsdp_counts(module, world, 1)
        units = fsdp1_unit_numels(module)
        assert sum(units) == sum(p.numel() for p in module.parameters()), name
        assert any(n % world for n in units), units          # the padding matters here
        per_rank = [sum(c[r] for c in counts.values()) for r in range(world)]
        torch_rank = [sum(FlatParamHandle._get_unpadded_shard(torch.empty(n), r, world)[0].numel()
                          for n in units) for r in range(world)]
        assert per_rank == torch_rank, (name, per_rank, torch_rank)
        padded = sum(FlatParamHandle._get_shard(torch.empty(n), 0, world)[0].numel() for n in units)
        assert state_dict_bytes_in(module, world, "full", 4) == (world - 1) * padded * 4
        assert state_dict_bytes_in(module, world, "local", 4) == 0


# a Qwen2 whose norms (68 bf16 = 136 bytes) are not 16-byte multiples: SGLang's tight buckets
# and the padded ones differ (12 against 13 at 13,456 bytes); tied, so that per-rank files hold
# its embedding under the name SGLang's loader wants (`hf_checkpoint.rank_tensor_name`)
ODD = """model:
  model_type: qwen2
  vocab_size: 510
  hidden_size: 68
  intermediate_size: 100
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 16
  max_position_embeddings: 256
  rms_norm_eps: 1.0e-6
  rope_theta: 10000.0
  tie_word_embeddings: true
"""
BUCKET = 13_456


@pytest.mark.timeout(120)
def test_one_ranks_syncs_move_and_write_the_plans_bytes(tmp_path):
    """One trainer rank (in this process) syncs the odd model into a reference engine of TP 2 by
    the distributed and disk methods, full and per-rank: the buckets, engine calls, bytes, each
    engine rank's bytes in (what it received or read from the files, its own count) and the
    files written (their number and sizes on disk) are the plan's. Killed: the distributed
    method's full buckets planned padded (13, where SGLang's tight layout sends 12), its per-rank
    buckets planned at the whole bucket (trainer rank 0 holds tp of them: each bucket / tp), its
    engine calls counted per bucket, a disk engine rank's reads without the other files' slices,
    and per-rank files sized under the engine's names (a tied model's embedding is written as
    ``lm_head.weight``, `hf_checkpoint.rank_tensor_name`: another header size)."""
    import tempfile

    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.plan import Cluster, PlanJob, plan_row
    from fsdp_sync.weights import bucket as bk
    from fsdp_sync.weights.export import param_metas

    path = tmp_path / "odd.yaml"
    path.write_text(ODD)
    cfg = load_config(str(path))
    module = build_model(cfg, seed=0)
    metas = param_metas(module, torch.bfloat16)
    assert len(bk.plan_tight(metas, BUCKET)) != len(bk.plan_buckets(metas, BUCKET))
    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    torch.set_num_threads(1)
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.bfloat16) as engine:
        for method in ("distributed", "disk"):
            for layout in ("full", "engine"):
                where = (method, layout)
                d = tempfile.mkdtemp(dir=tmp_path)
                kw = {"disk_dir": d, "disk_keep": 1} if method == "disk" else {}
                m = FSDPShardingManager(module, [engine], config=SyncConfig(
                    method=method, layout=layout, dtype=torch.bfloat16, bucket_bytes=BUCKET,
                    memory_probe="off", **kw))
                try:
                    with m:
                        pass
                    s = m.stats
                finally:
                    m.close()
                p = plan_row(PlanJob(str(path), method, layout, BUCKET, "bfloat16", None, 1, 2, 2,
                                     engine="reference"), cpu)
                got = {"buckets": s.buckets, "engine_calls": s.engine_calls, "bytes": s.bytes,
                       "engine_rank_bytes_in": s.extra.get("engine_rank_bytes_in", s.bytes)}
                assert got == {k: p[k] for k in got}, (where, got)
                if method == "disk":
                    files = [f for f in Path(d).rglob("*.safetensors")]
                    assert (len(files), sum(f.stat().st_size for f in files)) == (p["files"], p["file_bytes"]), where


def test_disk_fp8_quantizer_load_is_the_busiest_of_the_trainer_ranks_writers():
    """The disk method's bucket k is written, and quantized, by trainer rank k mod ranks (every
    rank sees the directory on one host: `transport.disk`'s ``writers[k % len(writers)]``), not
    by engine rank: at 4 trainer ranks and TP 2 the busiest writer takes every fourth bucket.
    Killed: the writers counted by engine rank (every second bucket, twice the load)."""
    from fsdp_sync.plan import Cluster, PlanJob, plan_row
    from fsdp_sync.weights import bucket as bk
    from fsdp_sync.weights.export import param_metas

    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    bucket = 48 << 10
    row = plan_row(PlanJob("tiny-fp8", "disk", "full", bucket, "bfloat16", "fp8", 4, 2, 2, engine="reference"), cpu)
    plan = bk.plan_buckets(param_metas(meta_model("tiny-fp8")[1], torch.bfloat16), bucket)
    by_writer = [sum(b.payload_bytes for b in plan[w::4]) for w in range(4)]
    by_engine_rank = [sum(b.payload_bytes for b in plan[w::2]) for w in range(2)]
    assert len(plan) >= 8 and max(by_writer) < max(by_engine_rank), (len(plan), by_writer)
    assert row["quantize_bytes_in"] == max(by_writer), (row["quantize_bytes_in"], by_writer)


def test_an_engine_that_stages_is_budgeted_its_shard_beside_what_arrives():
    """The reference engine copies what a disaggregated sync pushes aside until the commit (its
    whole shard, `plan.reference_engine_stages`), except for per-rank disk files, which it reads
    straight into its weights; SGLang loads in place. The engine rank's budget is what arrives
    at once (max(bucket, largest tensor)) plus that shard where it stages, as the bench holds its
    engine workers' measured peaks to it. Killed: the staged shard left out of the engine's budget."""
    from fsdp_sync.plan import Cluster, PlanJob, plan_row

    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    for method, layout, stages in (("distributed", "full", True), ("distributed", "engine", True),
                                   ("disk", "full", True), ("disk", "engine", False)):
        rows = {e: plan_row(PlanJob("tiny", method, layout, 64 << 10, "bfloat16", None, 2, 2, 2, engine=e), cpu)
                for e in ("reference", "sglang") if not (e == "sglang" and layout == "engine")}
        r = rows["reference"]
        arrives = max(r["bucket_bytes"], r["largest_tensor_bytes"])
        assert r["engine_memory_budget_bytes"] == arrives + (r["engine_rank_shard_bytes"] if stages else 0), (method, layout)
        assert ("staged" in r["engine_memory_budget_rule"]) == stages, (method, layout)
        if "sglang" in rows:
            assert rows["sglang"]["engine_memory_budget_bytes"] == arrives, (method, layout)


def test_a_per_rank_disk_writer_is_budgeted_every_engine_ranks_buffer_it_writes():
    """Per-rank files: trainer rank w writes engine rank i's file of bucket k where
    ``writers[(k * tp + i) % W] == w`` (``writers[i % W]`` on the all-to-all path,
    `transport.disk_ranked.write_rank_buckets`): at 3 writers and TP 4 one of them writes two
    engine ranks' buffers of a bucket, so its budget is 3 x 2 buffers, not 3 x 1. Killed: the
    buffers per writer counted as tp // ranks (1 here)."""
    from fsdp_sync.plan import Cluster, PlanJob, plan_row

    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    ranks, tp = 3, 4
    most = max(sum(1 for i in range(tp) if (k * tp + i) % ranks == w) for k in range(ranks) for w in range(ranks))
    assert most == 2
    for share in (True, False):
        r = plan_row(PlanJob("tiny", "disk", "engine", 64 << 10, "bfloat16", None, ranks, 2, tp,
                             engine="reference", share_host_memory=share), cpu)
        unit = max(r["bucket_bytes"], r["largest_tensor_bytes"])
        assert r["memory_budget_bytes"] == 3 * most * unit + r["largest_tensor_bytes"], (share, r["memory_budget_rule"])
        assert r["memory_budget_rule"].startswith(f"3 x {most} x "), r["memory_budget_rule"]


def test_the_refusal_suggests_the_largest_whole_mib_below_a_fractional_bucket():
    """A bucket of 7.5 MiB that does not fit where 7 MiB does: the suggestion is 7 MiB, the
    largest whole MiB at or below the bucket asked for. Killed: the search starting one MiB lower
    (it suggested 6)."""
    from fsdp_sync.plan import Cluster, PlanError, PlanJob, plan_row

    small = Cluster("small-gpu", "cuda", 8, 100 * 2**20, 1000.0, 100.0, 10.0, 1.0, 1.0, 1e-3, 1e-5)
    job = dict(model="tiny", method="tensor", layout="full", dtype="bfloat16", ranks=2, tp=2)
    with pytest.raises(PlanError) as info:
        plan_row(PlanJob(bucket_bytes=15 * 2**19, **job), small)
    best = info.value.suggested_bucket_bytes
    assert best == 7 * 2**20 and "--bucket-mb 7" in str(info.value), str(info.value)
    assert plan_row(PlanJob(bucket_bytes=best, **job), small)["memory_budget_bytes"] > 0


def test_the_fp8_scratch_is_the_largest_piece_each_layout_quantizes():
    """The quantizer's scratch (`fp8.quantize_scratch_bytes`) of the largest tensor it quantizes:
    per-rank buckets an engine rank's fused piece (``gate_up_proj``: 2 x intermediate rows / tp),
    full buckets the whole Hugging Face tensor. At TP 1 the fused piece is twice the largest
    Hugging Face projection (at TP 2 the two coincide). Killed: per-rank buckets priced on the
    Hugging Face shapes."""
    from fsdp_sync.plan import Cluster, PlanJob, plan_row
    from fsdp_sync.weights.fp8 import quantize_scratch_bytes
    from fsdp_sync.weights.layout import layout_for

    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    lay = layout_for(meta_model("tiny-fp8")[0], 1)
    for layout, shapes in (("engine", lay.engine_shapes()), ("full", lay.hf_shapes)):
        row = plan_row(PlanJob("tiny-fp8", "tensor", layout, 1 << 20, "bfloat16", "fp8", 1, 2, 1,
                               engine="reference"), cpu)
        want = max(quantize_scratch_bytes(tuple(shapes[n]), 2) for n in shapes if n.endswith("proj.weight"))
        assert row["quantize_scratch_bytes"] == want, (layout, row["quantize_scratch_bytes"], want)
