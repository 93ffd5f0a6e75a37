"""A model config whose ``quantization_config`` makes the engine FP8, planned or synced unquantized
(plan3 audit, D2).

SGLang and ``fsdp-sync serve`` both build a model whose config carries a block-FP8
``quantization_config`` in FP8, whatever their ``--quantization``. ``fsdp-sync plan --quantization
none`` planned such a model as bf16 (3.5 MiB for tiny-fp8), while the sync of the same job refuses;
and the sync's refusal advised "start the engine with quantization=None", which cannot help: the
config forces FP8. Now the plan refuses with the sync's reason, and both name the config's
quantization_config and what to change.
"""

from __future__ import annotations

import types

import pytest
import torch

QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
      "ignored_layers": ["model.layers.0.mlp.down_proj"]}
WHY = (r"the model config's quantization_config \{quant_method: 'fp8', weight_block_size: \[128, 128\], "
       r"activation_scheme: 'dynamic', ignored_layers: \['model\.layers\.0\.mlp\.down_proj'\]\} makes the "
       r"engine serve block FP8 whatever its --quantization .* quantize the sync "
       r"\(SyncConfig\(quantization='fp8'\), fsdp-sync plan --quantization fp8\)")


def _config(qc=QC):
    from fsdp_sync.models import load_config

    return load_config("tiny-fp8", quantization_config=dict(qc))


@pytest.mark.parametrize("method, layout", [("tensor", "full"), ("distributed", "engine"), ("disk", "full")])
def test_the_plan_refuses_an_fp8_config_planned_unquantized_as_the_sync_does(method, layout):
    from fsdp_sync.plan import PlanError, PlanJob, plan_row

    with pytest.raises(PlanError, match=WHY):
        plan_row(PlanJob(_config(), method, layout, 1 << 20, "bfloat16", None, 2, 2, 2, engine="reference"),
                 "h100-node")
    def planned(qc):
        return plan_row(PlanJob(_config(qc), method, layout, 1 << 20, "bfloat16", "fp8", 2, 2, 2,
                                engine="reference"), "h100-node")["bytes"]

    def sent(qc):      # what the sync's quantizer sends (tests/test_fp8_ignored_layers.py: bit for bit)
        from fsdp_sync.config import SyncConfig
        from fsdp_sync.models import build_model
        from fsdp_sync.weights import quantize

        with torch.device("meta"):
            module = build_model(_config(qc), seed=0)
        return sum(m.nbytes for m in quantize.sync_metas(module, SyncConfig(quantization="fp8", dtype=torch.bfloat16)))

    every = {k: v for k, v in QC.items() if k != "ignored_layers"}
    assert planned(QC) == sent(QC) > planned(every) == sent(every), (planned(QC), sent(QC), planned(every))
    # a config without quantization_config plans either way
    plain = _config({})
    assert plan_row(PlanJob(plain, method, layout, 1 << 20, "bfloat16", None, 2, 2, 2, engine="reference"),
                    "h100-node")["quantization"] is None


def test_the_syncs_refusal_names_the_configs_quantization_config_not_a_restart():
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.config_check import check_engine
    from fsdp_sync.models import build_model

    with torch.device("meta"):
        module = build_model(_config(), seed=0)
    engine = types.SimpleNamespace(quantization="fp8", tp_size=1)    # what ReferenceEngine resolves it to
    with pytest.raises(ValueError, match=r"the engine serves quantization='fp8': " + WHY) as err:
        check_engine(module, engine, SyncConfig(quantization=None), None, where="rank 0/1")
    assert "start the engine with quantization=None" not in str(err.value), err.value
    # an engine started fp8 on a config without quantization_config: a restart does help
    with torch.device("meta"):
        plain = build_model(_config({}), seed=0)
    with pytest.raises(ValueError, match=r"start the engine with quantization=None"):
        check_engine(plain, engine, SyncConfig(quantization=None), None, where="rank 0/1")
