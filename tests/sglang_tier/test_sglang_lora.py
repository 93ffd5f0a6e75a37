"""fsdp_sync's LoRA adapter against SGLang's own LoRA code: names, target modules, scaling, and
each TP rank's slices of A and B (`sglang_lora.py`, one subprocess, CPU).

For a tiny Qwen2 at TP 1, 2 and 4 (TP 4 and a one-KV-head variant at TP 2 replicate KV heads),
a Qwen3 (head_dim 32 != hidden / heads) at TP 2, and adapters on all seven linear layers, on q/v
only (peft's default: SGLang stacks a zero k) and on q/k/v/gate/down (a zero up):

- every tensor fsdp_sync sends (the real export under `lora_sync.peft_name`, with
  `lora_sync.adapter_config`) is, bit for bit, where SGLang's ``LoRAAdapter
  .initialize_weights_from_tensors`` stacks it (qkv_proj = [q; k; v], gate_up_proj = [gate; up]),
  nothing else is held, nothing lands outside the decoder layers;
- ``get_normalized_target_modules`` of our config gives the reference engine's fused modules,
  and ``get_target_module_name`` places every weight SGLang holds (its memory pool skips or
  raises on one it cannot place);
- SGLang's ``scaling = lora_alpha / r`` equals the reference engine's `LoRAConfig.scale`;
- per TP rank, on SGLang's model built for that rank, ``get_lora_layer`` wraps qkv_proj,
  gate_up_proj and o_proj / down_proj as QKVParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA
  and RowParallelLinearWithLoRA, and their ``slice_lora_a_weights`` / ``slice_lora_b_weights``
  equal, bit for bit, the blocks of `engines.reference.lora.shard_adapter`'s stacked A and
  block-diagonal B (B's rows at SGLang's output offsets, zeros off the blocks; a slice the adapter
  does not target is zero in SGLang's); SGLang's own torch kernels' delta (``sgemm_lora_a_fwd`` /
  ``sgemm_lora_b_fwd``) equals `LoRAShard.apply`'s (float32, 1e-6).

Negative controls (what SGLang is given is faulty, ours not) must be caught: a doubled
lora_alpha, k and v swapped, a tensor under a name SGLang skips silently, a transposed B.

Which target sets SGLang serves at all, checked for every subset of q/k/v and gate/up: it stacks
q/k/v only from q_proj and needs v_proj beside it, and gate/up only from gate_proj. On q/k without
v its ``initialize_weights_from_tensors`` raises KeyError; on k or v without q, or up without gate,
it loads the adapter unstacked and its memory pool (``load_lora_weight_to_buffer``, run here on
CPU) raises when it places it, which a server does when a request first uses the adapter.
`lora_sync.sglang_refusal` lets through exactly the sets SGLang serves (`lora_sync.check_engine`
refuses the others by name before an SGLang engine is touched); the reference engine serves
every subset.

Run as `make test-sglang` does, for 0.5.23 and, from SGLANG_OLD_TESTS, 0.5.12 (whose slice
methods take the TP rank as an argument and read k's size from ``output_sizes``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
STACK = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
ALL = list(STACK)
QV, NO_UP = ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"]
# [recipe, overrides, tp, r, lora_alpha, control, targets]
CASES = [["tiny", {}, 1, 6, 10, None], ["tiny", {}, 2, 6, 10, None], ["tiny", {}, 4, 6, 10, None],
         ["tiny", {"num_key_value_heads": 1}, 2, 6, 10, None], ["tiny-qwen3", {}, 2, 4, 16, None],
         ["tiny", {}, 2, 6, 10, None, QV], ["tiny", {}, 2, 6, 10, None, NO_UP]]
CONTROLS = [["tiny", {}, 2, 6, 10, c] for c in ("alpha", "swap_kv", "dropped", "transposed", "rslora")]
# every subset of q/k/v and of gate/up (with o_proj), at TP 1: served by SGLang or not
SUBSETS = [["tiny", {}, 1, 4, 8, None, [m for m, on in zip(ALL, bits) if on]]
           for bits in itertools.product((0, 1), (0, 1), (0, 1), (1,), (0, 1), (0, 1), (0,))]


def key(case: list) -> str:
    recipe, ov, tp, r, alpha, control = case[:6]
    targets = case[6] if len(case) > 6 else None
    return f"{recipe}|{json.dumps(ov, sort_keys=True)}|{tp}|{r}|{alpha}|{control}|{','.join(targets or ['all'])}"


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_lora.py"),
                           json.dumps(CASES + CONTROLS + SUBSETS)],
                          capture_output=True, text=True, timeout=280, env=env, cwd=HERE)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"sglang_lora.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(300)
def test_every_case_ran_on_the_sglang_asked_for(results):
    want = os.environ.get("FSDP_SYNC_SGLANG_VERSION")
    if want:
        assert results["version"] == want, results["version"]
    for case in CASES + CONTROLS + SUBSETS:
        assert "raised" not in results[key(case)], (key(case), results[key(case)].get("raised"))


@pytest.mark.timeout(300)
def test_sglang_takes_our_adapter_exactly(results):
    """No problem at all: names, targets, scaling, and per TP rank every module's A / B blocks and
    delta (see the module docstring)."""
    for case in CASES:
        r = results[key(case)]
        assert r["problems"] == [], (key(case), r["problems"][:5])


@pytest.mark.timeout(300)
def test_every_module_of_every_rank_was_compared(results):
    for case in CASES:
        recipe, _, tp, rr, alpha = case[:5]
        targets = case[6] if len(case) > 6 else ALL
        s = results[key(case)]["stats"]
        fused = sorted({STACK[t] for t in targets})
        assert s["normalized_targets"] == fused, key(case)
        assert s["modules_checked"] == s["pool_compared"] == 2 * len(fused) * tp, key(case)  # 2 layers
        assert s["scaling"] == [alpha / rr, alpha / rr], key(case)
        # the tensors sent: peft's names, 2 layers x targets x (A, B)
        assert len(s["sent"]) == 2 * len(targets) * 2 and all(
            n.startswith("base_model.model.model.layers.") and ".default." not in n for n in s["sent"]), key(case)
        assert s["config"]["r"] == rr and s["config"]["lora_alpha"] == alpha, key(case)
        # SGLang's model was built for each rank (its layers' own tp_rank / tp_size)
        assert s["layer_ranks"] == [[rank, rank, tp] for rank in range(tp)], key(case)
        kinds = {"qkv_proj": "QKVParallelLinearWithLoRA(QKVParallelLinear)",
                 "gate_up_proj": "MergedColumnParallelLinearWithLoRA(MergedColumnParallelLinear)",
                 "o_proj": "RowParallelLinearWithLoRA(RowParallelLinear)",
                 "down_proj": "RowParallelLinearWithLoRA(RowParallelLinear)"}
        assert s["classes"] == sorted({kinds[f] for f in fused}), key(case)
        assert 0 < s["max_delta_diff"] <= 1e-6, key(case)


@pytest.mark.timeout(300)
def test_negative_controls_are_caught(results):
    p = {c[5]: results[key(c)]["problems"] for c in CONTROLS}
    assert p["alpha"][0] == ("scaling: SGLang's lora_alpha / r = 3.3333333333333335, our engine's "
                             "LoRAConfig.scale = 1.6666666666666667"), p["alpha"][:2]
    assert len([m for m in p["alpha"] if "delta differs" in m]) == 16          # every module, both ranks
    qkv = "base_model.model.model.layers.1.self_attn.qkv_proj"
    assert {m.split(": ")[0] for m in p["swap_kv"]} == {"names"} | {
        f"rank {rk} model.layers.1.self_attn.qkv_proj{part}" for rk in (0, 1)
        for part in (" k_proj", " v_proj", "")}, p["swap_kv"]
    assert [m.split(" [")[0] for m in p["swap_kv"] if m.startswith("names")] == [
        f"names: SGLang's '{qkv}.lora_{ab}.weight'" for ab in "AB"], p["swap_kv"]
    assert p["dropped"][0] == "names: SGLang's adapter holds no " \
        "'base_model.model.model.layers.1.mlp.down_proj.lora_A.weight'", p["dropped"]
    assert any("o_proj o_proj: lora_B block differs" in m for m in p["transposed"]), p["transposed"]
    assert all("layers.1.self_attn.o_proj" in m for m in p["transposed"]), p["transposed"]
    # use_rslora=True: SGLang serves alpha / r (10 / 6) where peft trained alpha / sqrt(r)
    # (10 / sqrt(6) = 4.08): why fsdp_sync refuses the flag (peft_names.UNSERVED) instead of sending it
    rs = results[key(CONTROLS[-1])]
    assert rs["stats"]["config"].get("use_rslora") in (None, False) and not rs["problems"], rs["problems"]
    assert rs["stats"]["scaling"] == [10 / 6, 10 / 6] and abs(10 / 6 - 10 / 6 ** 0.5) > 2


@pytest.mark.timeout(300)
def test_sglang_serves_exactly_the_target_subsets_we_let_through(results):
    """For every subset of q/k/v and gate/up: SGLang's own code takes the adapter (no raise in
    ``initialize_weights_from_tensors`` or its memory pool, every weight placed) exactly when
    `lora_sync.sglang_refusal` lets it through, and then takes it exactly (no problem at all)."""
    from fsdp_sync.lora_sync import sglang_refusal

    served = 0
    for case in SUBSETS:
        r = results[key(case)]
        s = r["stats"]
        sglang_ok = "sglang_raised" not in s and "pool_raised" not in s and not s["sglang_unplaced"]
        assert sglang_ok is (sglang_refusal(case[6]) is None), (case[6], r["problems"][:3])
        if sglang_ok:
            served += 1
            assert r["problems"] == [], (case[6], r["problems"][:3])
        assert "ours_refused" not in s, case[6]            # the reference engine serves them all
    assert served == 3 * 3                                 # (none, q+v, q+k+v) x (none, gate, gate+up)


@pytest.mark.timeout(300)
def test_how_sglang_fails_on_the_others(results):
    """The two ways (module docstring): q/k without v raises KeyError in its adapter; v without q
    or up without gate is left unstacked, which its memory pool cannot place (ValueError)."""
    by = {",".join(c[6]): results[key(c)]["stats"] for c in SUBSETS}
    assert by["q_proj,k_proj,o_proj"]["sglang_raised"].startswith(
        "KeyError: 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight'"), by["q_proj,k_proj,o_proj"]
    s = by["v_proj,o_proj,up_proj"]
    assert s["sglang_unplaced"] and all(".v_proj." in n or ".up_proj." in n for n in s["sglang_unplaced"])
    assert s["pool_raised"][0].startswith("ValueError: Cannot find target module name for "), s["pool_raised"]
