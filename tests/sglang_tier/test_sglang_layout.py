"""fsdp_sync's layout map and per-rank buckets against SGLang's own model classes: Qwen2, Llama,
Qwen3 (dense), Qwen3-MoE, Qwen2-MoE and Mixtral.

`sglang_models.py` (two processes at once, one for the dense cases and one for the MoE cases,
forked from one that imported SGLang's modules) builds
SGLang's model class for each TP rank on CPU and checks, for Qwen2 (untied, a vocab SGLang pads),
Qwen2 tied, Llama with attention biases and Qwen3 (tied, per-head q/k norms) at TP 1, 2 and 4 (TP 4
replicates tiny's 2 KV heads), and for Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral at TP 1,
2, 4 and EP 2 (SGLang's ``--ep-size``: over TP 2 and TP 4):

- SGLang's parameter names and per-rank shapes equal `layout.TPLayout.engine_shapes()`;
- SGLang's default loading path (``model.load_weights`` of the full HF tensors: its stacked-params
  mapping and the layers' weight loaders) gives, bit for bit, `layout.shard_state_dict`'s shard;
- SGLang's own ``WeightUpdater.update_weights_from_tensor`` with ``load_format`` =
  `engines.sglang.loader.LOADER` (a ``--custom-weight-loader``) and our per-rank bucket payloads in
  ``LocalSerializedTensor``s loads the same bits into a NaN-filled model, every parameter
  written, vocab padding rows zero.

- MoE: SGLang builds its FusedMoE (``fused_moe_triton.layer.FusedMoE``, unquantized, the only
  class its CPU path picks) with ``w13_weight`` [E_local, 2*I_local, H] (gate rows, then up) and
  ``w2_weight`` [E_local, H, I_local], unpadded, and its own rank arithmetic
  (``runtime_context.derive_spawn_ranks``) puts the same experts and slices on each rank as ours;
  its loader takes the Hub per-expert names and fills them with our shard's bits;
- SGLang's ``WeightChecker`` (the ``/weights_checker`` checksum action's per-worker code) on the
  models both loaders filled reports, per TP rank and parameter, what `engines.sglang.checksums`
  computes from the trainer's tensors (Qwen2 TP 2, Qwen3-MoE TP 2 and TP 4 / EP 2), and a tensor the
  trainer changed after the engine loaded is named with exactly the TP ranks that hold it.

One difference, kept and asserted: SGLang 0.5.23 builds every Qwen3-MoE layer sparse and ignores
``mlp_only_layers`` (so the MoE cases set it to []); a model with dense layers among MoE ones
cannot be served by SGLang, while the layout map (and the reference engine) follow the checkpoint.

The disk method's per-rank checkpoint (``layout="engine"``) against SGLang's ``sharded_state``
format: SGLang's ``ShardedStateLoader`` pattern globs exactly our files of each rank, and for all
models (untied and tied) their tensor names and shapes are the keys that loader requires (a tied
model's embedding under ``lm_head.weight``: its ``_filter_subtensors`` keeps the smaller of two
aliased keys, and so do our files). SGLang's own
``WeightUpdater.update_weights_from_disk(dir, "sharded_state")`` answers ``success=False``
("Failed to get model loader": it takes only a ``DefaultModelLoader``) before reading anything,
which is why fsdp_sync refuses ``layout="engine"`` with the disk method against `SGLangEngine`.

Not checked here (needs a GPU or a running server): SGLang's post-load repacking
(``process_weights_after_loading``: AMX packing on a CPU with AMX, which this one lacks, and the GPU
runners' layouts), starting a server from a per-rank checkpoint
(``--load-format sharded_state``), CUDA IPC payloads, the scheduler / TP-worker
processes and their RPCs, the forward pass (SGLang's CPU kernels are not installed), and the HTTP
route with a custom loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
# [recipe, overrides, tp, ep, options]; "checksum": run SGLang's WeightChecker on the model its
# own loader filled and compare with `engines.sglang.checksums`, "stale": the HF tensor the
# trainer changes after the engine loaded
ALL_SPARSE = {"mlp_only_layers": []}     # SGLang builds every Qwen3-MoE layer sparse (see below)
CASES = [[recipe, ov, tp, 1, {"checksum": True} if (recipe, tp) == ("tiny", 2) and ov.get("vocab_size") else {}]
         for recipe, ov in [("tiny", {"vocab_size": 999}), ("tiny-tied", {}),
                            ("tiny", {"model_type": "llama", "attention_bias": True}), ("tiny-qwen3", {})]
         for tp in (1, 2, 4)]
# TP 3: the padded vocabulary (999 -> 1024) does not split in three, so SGLang pads it to a
# multiple of 64 x 3 (1152: 384 rows a rank; 0.5.23 everywhere, 0.5.12 on CPU)
CASES += [["tiny", {"vocab_size": 999, "hidden_size": 96, "intermediate_size": 192,
                    "num_attention_heads": 6, "num_key_value_heads": 3}, 3, 1, {}]]
MOE_CASES = ([["tiny-qwen3-moe", ALL_SPARSE, tp, ep, {}] for tp, ep in ((1, 1), (4, 1), (2, 2))]
             + [["tiny-qwen3-moe", ALL_SPARSE, 2, 1,
                 {"checksum": True, "stale": "model.layers.0.mlp.experts.3.gate_proj.weight"}],
                ["tiny-qwen3-moe", ALL_SPARSE, 4, 2,
                 {"checksum": True, "stale": "model.layers.2.mlp.experts.6.down_proj.weight"}]]
             + [[recipe, {}, tp, ep, {}] for recipe in ("tiny-qwen2-moe", "tiny-mixtral")
                for tp, ep in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2))]
             + [["tiny-qwen3-moe", {}, 2, 1, {"shapes_only": True}]])
STALE_RANKS = {"model.layers.0.mlp.experts.3.gate_proj.weight": ("model.layers.0.mlp.experts.w13_weight", [0, 1]),
               # EP 2 over TP 4: experts 4..7 live on TP ranks 2 and 3 (moe_ep_rank = tp_rank // 2)
               "model.layers.2.mlp.experts.6.down_proj.weight": ("model.layers.2.mlp.experts.w2_weight", [2, 3])}


def _run(*parts: list) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_models.py"),
                           *[json.dumps(cases) for cases in parts]],
                          capture_output=True, text=True, timeout=280, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"sglang_models.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    results = json.loads(line[len("RESULT "):])
    assert len(results) == len(parts)
    return results


@pytest.fixture(scope="module")
def every():
    """Dense cases and MoE cases, each in a process of its own (both at once)."""
    return tuple(_run(CASES, MOE_CASES))


@pytest.fixture(scope="module")
def results(every):
    """Per TP rank of every case SGLang builds as the layout map says."""
    return {k: v for part in every for k, v in part.items()
            if not k.startswith("checksum|") and "params" in v}


@pytest.mark.timeout(600)
def test_every_case_ran(every, results):
    ranks = sum(c[2] for c in CASES + MOE_CASES if not c[4].get("shapes_only"))
    assert len(results) == ranks   # every TP rank of every case
    checks = [k for part in every for k in part if k.startswith("checksum|")]
    assert len(checks) == sum(1 for c in CASES + MOE_CASES if c[4].get("checksum")) == 3


@pytest.mark.timeout(300)
def test_sglang_builds_its_fused_moe_with_sglangs_expert_ranks(results):
    """On CPU SGLang builds its one FusedMoE class (fused_moe_triton.layer.FusedMoE, the
    unquantized method: w13 [E_local, 2*I_local, H], w2 [E_local, H, I_local], no padding), and
    its own rank arithmetic gives TP rank r expert group r // (tp/ep), slice r % (tp/ep)."""
    moe = 0
    for key, r in results.items():
        recipe, _, tp, rank, ep = key.split("|")
        if "moe" in recipe or "mixtral" in recipe:
            moe += 1
            assert r["moe_classes"] == ["sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"], key
            moe_tp = int(tp) // int(ep[2:])
            assert r["moe_ranks"] == [int(rank) // moe_tp, int(rank) % moe_tp], key
    assert moe == sum(c[2] for c in MOE_CASES if not c[4].get("shapes_only"))


@pytest.mark.timeout(300)
def test_sglang_qwen3_moe_ignores_mlp_only_layers(every):
    """SGLang 0.5.23's Qwen3-MoE declares every layer sparse (``stage_facts``: "all layers are
    sparse"), so a config with ``mlp_only_layers`` (the recipe's dense layer 1) gets an MoE block
    there where the checkpoint has a dense MLP: the layout map follows the checkpoint (and the
    reference engine), so exactly layer 1's MLP differs. Such a model cannot be served by SGLang."""
    r = every[1]["tiny-qwen3-moe|{}|2|0|ep1"]
    a, b = r["sglang_shapes"], r["layout_shapes"]
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    p = "model.layers.1.mlp."
    assert diff == {p + "gate.weight": ([8, 64], None), p + "experts.w13_weight": ([8, 32, 64], None),
                    p + "experts.w2_weight": ([8, 64, 16], None), p + "gate_up_proj.weight": (None, [128, 64]),
                    p + "down_proj.weight": (None, [64, 64])}, diff


@pytest.mark.timeout(300)
def test_sglang_weight_checker_equals_our_checksums(every):
    """SGLang's own WeightChecker (what /weights_checker runs per TP worker, CPU: sha256) on the
    model SGLang's loader filled gives, for every parameter of every TP rank, the hash
    `engines.sglang.checksums` computes from the trainer's full tensors; the model our custom loader
    filled gives the same; `Checker` finds nothing to report."""
    for part in every:
        for key, r in part.items():
            if not key.startswith("checksum|"):
                continue
            tp = int(key.split("|")[3])
            assert len(r["sglang"]) == tp and r["checked"] > 0, key
            for rank, (theirs, via_ours) in enumerate(zip(r["sglang"], r["sglang_our_loader"])):
                info = theirs["parallelism_info"]
                assert (info["tp_rank"], info["tp_size"], info["role"]) == (rank, tp, "target"), key
                # every parameter, nothing else (the rotary cache buffer is skipped by SGLang)
                assert theirs["checksums"] == r["ours"][str(rank)], (key, rank)
                assert via_ours["checksums"] == theirs["checksums"], (key, rank)
            assert r["same"] == [], (key, r["same"])


@pytest.mark.timeout(300)
def test_a_stale_expert_is_named_with_its_tp_ranks(every):
    stale = [(k, r) for part in every for k, r in part.items() if k.startswith("checksum|") and r["stale_name"]]
    assert len(stale) == 2
    for key, r in stale:
        param, ranks = STALE_RANKS[r["stale_name"]]
        assert len(r["stale"]) == len(ranks), r["stale"]
        for line, rank in zip(r["stale"], ranks):
            assert line.startswith(f"{param!r} on TP rank {rank}: SGLang hashes "), line


@pytest.mark.timeout(300)
def test_sglang_parameter_shapes_are_the_layout_maps(results):
    for key, r in results.items():
        assert r["sglang_shapes"] == r["layout_shapes"], key


@pytest.mark.timeout(300)
def test_sglang_default_loader_cuts_the_same_shards(results):
    """SGLang's load_weights of the Hub tensors (per-expert names through
    FusedMoE.make_expert_params_mapping) into a NaN-filled model: our shard bit for bit, every
    element written, vocab padding rows zeroed (VocabParallelEmbedding.weight_loader fills 0)."""
    for key, r in results.items():
        for name, p in r["params"].items():
            assert p["a"] == p["ours"] and not p["a_nan"] and p["a_pad_zero"], (key, name)


@pytest.mark.timeout(300)
def test_custom_loader_through_sglangs_weight_updater(results):
    for key, r in results.items():
        assert r["buckets"] > 1 and r["calls"] == [[True, "Success"]] * r["buckets"], key
        for name, p in r["params"].items():
            assert p["b"] == p["ours"] and not p["b_nan"] and p["b_pad_zero"], (key, name)


@pytest.mark.timeout(300)
def test_disk_rank_files_against_sglangs_sharded_state_format(results):
    checked = 0
    for key, r in results.items():
        recipe, _, tp, rank, ep = key.split("|")
        if ep != "ep1":
            assert r["disk_files"] is None, key     # the disk method has no expert parallelism
            continue
        checked += 1
        # SGLang's pattern for this rank finds this rank's files, several parts (16 KiB buckets)
        assert len(r["disk_files"]) > 1, key
        assert all(f.startswith(f"model-rank-{rank}-part-") for f in r["disk_files"]), key
        # names and per-rank shapes; a tied model's one embedding under lm_head.weight, as
        # SGLang's _filter_subtensors keys it
        assert r["disk_keys"] == r["sharded_state_keys"], key
        if recipe in ("tiny-tied", "tiny-qwen3"):
            assert "lm_head.weight" in r["disk_keys"] and "model.embed_tokens.weight" not in r["disk_keys"], key
    assert checked > len(CASES)


@pytest.mark.timeout(300)
def test_sglang_disk_update_refuses_sharded_state(results):
    answers = [r["disk_update"] for r in results.values() if r["disk_update"] is not None]
    assert len(answers) == sum(1 for c in CASES + MOE_CASES if c[3] == 1 and not c[4].get("shapes_only"))
    for ok, message in answers:
        assert ok is False and message.startswith("Failed to get model loader") \
            and "ShardedStateLoader" in message, message
