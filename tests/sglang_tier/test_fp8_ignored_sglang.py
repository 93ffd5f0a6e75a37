"""A checkpoint config's ignored FP8 layers, read by SGLang 0.5.23's own ``Fp8Config`` and loaded by
its own Qwen2 loader, on CPU (plan3 audit; `make test-sglang`).

Before, the manager's quantizer ignored ``quantization_config.ignored_layers``: SGLang's Qwen2
built from ``{ignored_layers: [model.layers.0.mlp.down_proj]}`` took the raw FP8 values of that
weight into its unquantized parameter and dropped the scale ('Parameter ..._scale_inv not found in
params_dict'): max |served - trainer| 447.9. Checked here, in one subprocess (this file run as a
script behind the tier's import stand-ins):

- for several lists (``ignored_layers`` and ``modules_to_not_convert``, with and without
  ``model.``, fused shards, a layer's experts, ``SGLANG_FP8_IGNORED_LAYERS``), the tensors the
  sync quantizes (`weights.fp8_config.ignored_layers` of the config) are those SGLang's
  ``Fp8Config.from_config`` + ``is_layer_skipped`` build FP8; where the sync refuses the list,
  SGLang's reading and the reference engine's (`engines.reference.quant.resolve`) truly differ or
  SGLang refuses it too;
- the sync's own stream (`quantize.for_sync` of a module with that config, `StreamQuantizer.named`)
  loaded by SGLang's Qwen2 ``load_weights`` leaves every SGLang parameter equal to the trainer's
  weight (an ignored layer, bit for bit) or to our FP8 pair (a quantized one), no scale unloaded.
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
QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
IGNORED = "model.layers.0.mlp.down_proj"
MOE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
       "head_dim": 128, "moe_intermediate_size": 256, "mlp_only_layers": []}
LISTS = [  # (recipe, overrides, quantization_config's lists, SGLANG_FP8_IGNORED_LAYERS)
    ("tiny-fp8", {}, {"ignored_layers": [IGNORED, "model.layers.1.self_attn"]}, ""),
    ("tiny-fp8", {}, {"modules_to_not_convert": ["layers.0.mlp", "lm_head"]}, ""),
    ("tiny-fp8", {}, {"ignored_layers": ["mlp"]}, ""),
    ("tiny-fp8", {}, {"ignored_layers": ["model.mlp"]}, ""),                       # SGLang: 'mlp' too
    ("tiny-fp8", {}, {"ignored_layers": ["model.layers.0.self_attn.q_proj"]}, ""),  # one fused shard
    ("tiny-fp8", {}, {"ignored_layers": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]}, ""),
    ("tiny-fp8", {}, {"ignored_layers": [], "modules_to_not_convert": ["model.layers.0.mlp"]}, ""),
    ("tiny-fp8", {}, {"ignored_layers": ["model.layers.1"]}, "model.layers.1.mlp"),
    ("tiny-fp8", {}, {}, "model.layers.0.mlp"),
    ("tiny-qwen3-moe", MOE, {"ignored_layers": ["model.layers.1.mlp.experts"]}, ""),
    ("tiny-qwen3-moe", MOE, {"ignored_layers": ["layers.1.mlp.experts.0.gate_proj"]}, ""),
    ("tiny-qwen3-moe", MOE, {"modules_to_not_convert": ["model.layers.0.mlp.experts.3.down_proj"]}, ""),
]


def _rules() -> list:
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    from fsdp_sync.engines.reference.quant import resolve
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8, fp8_config
    from fsdp_sync.weights.layout import layout_for

    out = []
    for recipe, ov, lists, env in LISTS:
        os.environ[fp8_config.ENV] = env
        cfg = load_config(recipe, **ov, quantization_config={**QC, **lists})
        layout = layout_for(cfg, 1)
        default = fp8.quantized_names(layout)
        row = {"lists": lists, "env": env}
        try:
            qcfg = Fp8Config.from_config({**QC, **lists})       # reads the variable too
            row["sglang"] = sorted(n for n in default if not is_layer_skipped(
                layout.engine_name(n).rsplit(".", 1)[0], qcfg.ignored_layers,
                fused_mapping=qcfg.packed_modules_mapping))
        except ValueError as exc:
            row["sglang"] = f"refused: {exc}"
        try:
            row["reference"] = sorted(fp8.quantized_names(layout, resolve(cfg, "fp8")["ignored"]))
        except ValueError as exc:
            row["reference"] = f"refused: {exc}"
        try:
            row["ours"] = sorted(fp8.quantized_names(layout, fp8_config.ignored_layers(cfg, layout)))
        except ValueError as exc:
            row["ours"] = f"refused: {exc}"
        out.append(row)
    os.environ[fp8_config.ENV] = ""
    return out


def _load() -> dict:
    """SGLang's Qwen2 (TP 1) built with the checkpoint's Fp8Config, loading the sync's FP8 stream."""
    import shutil
    import tempfile

    import torch
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    import sglang_models as sm
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import fp8, quantize
    from fsdp_sync.weights.export import iter_params

    qc = {**QC, "ignored_layers": [IGNORED]}
    cfg = load_config("tiny-fp8", quantization_config=dict(qc))
    hf = build_model(cfg, seed=7).eval()
    quant = quantize.for_sync(hf, SyncConfig(quantization="fp8", dtype=torch.bfloat16), 1)
    full = {k: v.detach().to(torch.bfloat16).clone() for k, v in iter_params(hf)}
    stream = list(quant.named(iter(full.items())))
    sent = dict(stream)
    d = tempfile.mkdtemp(prefix="fsdp-sync-sgl-ignored-")
    try:
        scfg = load_config("tiny-fp8", quantization_config=dict(qc))
        scfg.architectures = [sm.CLASSES[scfg.model_type][1]]
        scfg.torch_dtype = torch.bfloat16
        scfg.save_pretrained(d)
        model = sm.build(lambda c: sm.model_class(c.model_type)(c, quant_config=Fp8Config.from_config(qc)),
                         scfg, d, 1, 0, 1)
        params = dict(model.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        model.load_weights(iter(stream))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    name = IGNORED + ".weight"
    p = params[name]
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    q, s = fp8.quantize_block("w", torch.cat([full["model.layers.0.mlp.gate_proj.weight"],
                                              full["model.layers.0.mlp.up_proj.weight"]]))
    return {
        "sent_dtype": str(sent[name].dtype), "sent_scale": fp8.scale_name(name) in sent,
        "param_dtype": str(p.dtype), "has_scale": fp8.scale_name(name) in params,
        "equal": bool(torch.equal(p.detach().float(), full[name].float())),
        "max_diff": float((p.detach().float() - full[name].float()).abs().max()),
        "gate_up_fp8_equal": bool(gate_up.dtype == torch.float8_e4m3fn and torch.equal(
            gate_up.detach().view(torch.uint8), q.view(torch.uint8))),
        "gate_up_scale_equal": bool(torch.equal(params["model.layers.0.mlp.gate_up_proj.weight_scale_inv"].detach(), s)),
        "unloaded_scales": sorted(n for n, t in params.items() if n.endswith("_scale_inv")
                                  and torch.equal(t.detach(), before[n])),
        "quantized": len(quant.hf),
    }


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1",
           "SGLANG_FP8_IGNORED_LAYERS": ""}
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_sync_quantizes_what_sglangs_fp8config_builds_fp8_or_refuses_a_list_read_apart(report):
    refused = 0
    for row in report["rules"]:
        where = (row["lists"], row["env"])
        if isinstance(row["ours"], str):          # refused: the engines read the list apart, or refuse it
            refused += 1
            assert row["sglang"] != row["reference"] or row["sglang"].startswith("refused"), where
            continue
        assert row["ours"] == row["sglang"] == row["reference"], where
    assert refused == 5, [r["lists"] for r in report["rules"] if isinstance(r["ours"], str)]


def test_sglangs_loader_gets_the_ignored_layer_unquantized_and_the_rest_fp8(report):
    r = report["load"]
    assert (r["sent_dtype"], r["sent_scale"]) == ("torch.bfloat16", False), r
    assert not r["has_scale"] and r["param_dtype"] != "torch.float8_e4m3fn", r
    assert r["equal"] and r["max_diff"] == 0.0, r           # was 447.9: raw FP8 values as weights
    assert r["gate_up_fp8_equal"] and r["gate_up_scale_equal"], r
    assert r["unloaded_scales"] == [], r
    assert r["quantized"] == 13, r


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    import sglang_models  # noqa: F401  (installs the import stand-ins before sglang is imported)

    out = {"rules": _rules(), "load": _load()}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)   # as sglang_models.py: SGLang may leave non-daemon threads behind
