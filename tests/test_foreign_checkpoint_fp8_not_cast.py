"""A Hugging Face checkpoint that is not a sync's version has its floating-point tensors cast to
the engine's dtype (as SGLang's loader does), but never an FP8 tensor: block-FP8 bytes cast
without their scales are other weights. Such a checkpoint is refused naming the tensor and both
dtypes, and nothing is loaded; the same checkpoint in bfloat16 loads, cast, into a float32 engine.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import WeightUpdateError, checksum_named_tensors
from fsdp_sync.models import build_model, load_config


@pytest.mark.timeout(120)
def test_an_fp8_tensor_of_a_foreign_checkpoint_is_refused_and_a_bf16_one_is_cast(tmp_path):
    cfg = load_config("tiny")
    sd = {k: v.detach().clone().contiguous() for k, v in build_model(cfg, seed=3).state_dict().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    fp8_dir, bf16_dir = tmp_path / "fp8", tmp_path / "bf16"
    fp8_dir.mkdir()
    bf16_dir.mkdir()
    save_file({**sd, name: sd[name].to(torch.float8_e4m3fn)}, str(fp8_dir / "model.safetensors"))
    bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    save_file(bf16, str(bf16_dir / "model.safetensors"))
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        served = engine.weights_checksum()
        with pytest.raises(WeightUpdateError) as info:
            engine.update_weights_from_disk(str(fp8_dir))
        assert (f"model.safetensors: expected dtype float32 for {name!r} on TP rank 0, got "
                f"float8_e4m3fn") in str(info.value)
        assert engine.weights_checksum() == served              # nothing was loaded
        engine.update_weights_from_disk(str(bf16_dir))
        assert engine.weights_checksum() == checksum_named_tensors(
            (k, v.to(torch.float32)) for k, v in bf16.items())
