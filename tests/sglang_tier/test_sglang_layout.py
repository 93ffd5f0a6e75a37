"""fsdp_sync's layout map and per-rank buckets against SGLang's own Qwen2 / Llama model classes.

`sglang_models.py` (one process of its own) builds SGLang's model class for each TP rank on CPU and
checks, for Qwen2 (untied, a vocab SGLang pads), Qwen2 tied and Llama with attention biases, at
TP 1, 2 and 4 (TP 4 replicates tiny's 2 KV heads):

- SGLang's parameter names and per-rank shapes equal `layout.TPLayout.engine_shapes()`;
- SGLang's default loading path (``model.load_weights`` of the full HF tensors: its stacked-params
  mapping and the layers' weight loaders) gives, bit for bit, `layout.shard_state_dict`'s shard;
- SGLang's own ``WeightUpdater.update_weights_from_tensor`` with ``load_format`` =
  `engines.sglang.loader.LOADER` (a ``--custom-weight-loader``) and our per-rank bucket payloads in
  ``LocalSerializedTensor``s loads the same bits into a NaN-filled model, every parameter
  written, vocab padding rows zero.

The disk method's per-rank checkpoint (``layout="engine"``) against SGLang's ``sharded_state``
format: SGLang's ``ShardedStateLoader`` pattern globs exactly our files of each rank, and for all
models (untied and tied) their tensor names and shapes are the keys that loader requires (a tied
model's embedding under ``lm_head.weight``: its ``_filter_subtensors`` keeps the smaller of two
aliased keys, and so do our files). SGLang's own
``WeightUpdater.update_weights_from_disk(dir, "sharded_state")`` answers ``success=False``
("Failed to get model loader": it takes only a ``DefaultModelLoader``) before reading anything,
which is why fsdp_sync refuses ``layout="engine"`` with the disk method against `SGLangEngine`.

Not checked here (needs a GPU or a running server): starting a server from a per-rank checkpoint
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
CASES = [[recipe, ov, tp]
         for recipe, ov in [("tiny", {"vocab_size": 999}), ("tiny-tied", {}),
                            ("tiny", {"model_type": "llama", "attention_bias": True})]
         for tp in (1, 2, 4)]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_models.py"), json.dumps(CASES)],
                          capture_output=True, text=True, timeout=280, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"sglang_models.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(300)
def test_every_case_ran(results):
    assert len(results) == sum(tp for _, _, tp in CASES)   # every TP rank of every case


@pytest.mark.timeout(300)
def test_sglang_parameter_shapes_are_the_layout_maps(results):
    for key, r in results.items():
        assert r["sglang_shapes"] == r["layout_shapes"], key


@pytest.mark.timeout(300)
def test_sglang_default_loader_cuts_the_same_shards(results):
    for key, r in results.items():
        for name, p in r["params"].items():
            assert p["a"] == p["ours"], (key, name)


@pytest.mark.timeout(300)
def test_custom_loader_through_sglangs_weight_updater(results):
    for key, r in results.items():
        assert r["buckets"] > 1 and r["calls"] == [[True, "Success"]] * r["buckets"], key
        for name, p in r["params"].items():
            assert p["b"] == p["ours"] and not p["b_nan"] and p["b_pad_zero"], (key, name)


@pytest.mark.timeout(300)
def test_disk_rank_files_against_sglangs_sharded_state_format(results):
    for key, r in results.items():
        recipe, _, tp, rank = key.split("|")
        # SGLang's pattern for this rank finds this rank's files, several parts (16 KiB buckets)
        assert len(r["disk_files"]) > 1, key
        assert all(f.startswith(f"model-rank-{rank}-part-") for f in r["disk_files"]), key
        # names and per-rank shapes; a tied model's one embedding under lm_head.weight, as
        # SGLang's _filter_subtensors keys it
        assert r["disk_keys"] == r["sharded_state_keys"], key
        if recipe == "tiny-tied":
            assert "lm_head.weight" in r["disk_keys"] and "model.embed_tokens.weight" not in r["disk_keys"], key


@pytest.mark.timeout(300)
def test_sglang_disk_update_refuses_sharded_state(results):
    answers = [r["disk_update"] for r in results.values() if r["disk_update"] is not None]
    assert len(answers) == len(CASES)
    for ok, message in answers:
        assert ok is False and message.startswith("Failed to get model loader") \
            and "ShardedStateLoader" in message, message
