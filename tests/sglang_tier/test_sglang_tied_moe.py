"""A tied MoE model against SGLang's own model classes: the head no sync writes.

SGLang's Qwen3-MoE, Qwen2-MoE and Mixtral classes build a ``ParallelLMHead`` of their own and
ignore ``tie_word_embeddings``, while a tied trainer's head is its embedding (the layout map has no
``lm_head.weight``, and a sync sends none). `sglang_models.py` builds them tied: each holds an
``lm_head.weight`` the layout lacks (so `served_config.SEPARATE_HEAD` names exactly these
families, which fsdp_sync refuses to sync into SGLang tied), and for Qwen3-MoE at TP 2 SGLang's own
``WeightChecker`` on the model its loader filled reports that head, which `checksums.Checker`
names on both TP ranks instead of finding the engine clean.
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
TIED = {"tie_word_embeddings": True}
CASES = [["tiny-qwen3-moe", {**TIED, "mlp_only_layers": []}, 2, 1, {"checksum": True}],
         ["tiny-qwen2-moe", TIED, 2, 1, {"shapes_only": True}],
         ["tiny-mixtral", TIED, 2, 1, {"shapes_only": True}]]


@pytest.fixture(scope="module")
def every() -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_models.py"), json.dumps(CASES)],
                          capture_output=True, text=True, timeout=280, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"sglang_models.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    (part,) = json.loads(line[len("RESULT "):])
    return part


@pytest.mark.timeout(300)
def test_sglang_keeps_a_head_of_its_own_for_exactly_the_refused_families(every):
    from fsdp_sync.engines.sglang.served_config import SEPARATE_HEAD

    families = set()
    for key, r in every.items():
        if key.startswith("checksum|"):
            continue
        assert "lm_head.weight" in r["sglang_shapes"] and "lm_head.weight" not in r["layout_shapes"], key
        assert set(r["sglang_shapes"]) - set(r["layout_shapes"]) == {"lm_head.weight"}, key
        families.add(key.split("|")[0])
    assert families == {"tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"}
    assert set(SEPARATE_HEAD) == {"qwen3_moe", "qwen2_moe", "mixtral"}


@pytest.mark.timeout(300)
def test_sglang_verify_names_the_head_no_sync_writes(every):
    (r,) = [v for k, v in every.items() if k.startswith("checksum|")]
    for theirs in r["sglang"]:
        assert "lm_head.weight" in theirs["checksums"]
    assert r["checked"] > 0 and r["same"], r["same"]
    assert r["same"] == ["'lm_head.weight' on TP ranks 0, 1: SGLang holds it, but the trainer's layout has "
                         "no such parameter, so no sync writes it"], r["same"]
