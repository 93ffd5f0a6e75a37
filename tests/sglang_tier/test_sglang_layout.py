"""fsdp_sync's layout map and per-rank buckets against SGLang's own Qwen2 / Llama model classes.

`sglang_models.py` (one process of its own) builds SGLang's model class for each TP rank on CPU and
checks, for Qwen2 (untied, a vocab SGLang pads), Qwen2 tied and Llama with attention biases, at
TP 1, 2 and 4 (TP 4 replicates tiny's 2 KV heads):

- SGLang's parameter names and per-rank shapes equal `layout.TPLayout.engine_shapes()`;
- SGLang's default loading path (``model.load_weights`` of the full HF tensors: its stacked-params
  mapping and the layers' weight loaders) gives, bit for bit, `layout.shard_state_dict`'s shard;
- SGLang's own ``WeightUpdater.update_weights_from_tensor`` with ``load_format`` =
  `sglang_loader.LOADER` (a ``--custom-weight-loader``) and our per-rank bucket payloads in
  ``LocalSerializedTensor``s loads the same bits into a NaN-filled model, every parameter
  written, vocab padding rows zero.

Not checked here (needs a GPU or a running server): CUDA IPC payloads, the scheduler / TP-worker
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
