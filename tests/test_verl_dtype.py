"""verl's ``rollout.dtype`` as `SyncConfig.from_verl` reads it (CPU tier, no verl needed).

verl hands ``rollout.dtype`` to SGLang's ``--dtype`` as written, so every spelling SGLang takes is
valid there: ``half`` and ``float`` map as SGLang maps them, and ``auto`` is the dtype SGLang reads
from the model's config (`config.auto_dtype`, SGLang 0.5.x's ``_get_and_verify_dtype``): resolved
where the Hugging Face config is at hand, refused by name where it is not.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.config import SyncConfig, auto_dtype


def _verl(dtype) -> dict:
    return {"actor_rollout_ref": {"rollout": {"dtype": dtype}}}


@pytest.mark.parametrize("spelling, want", [("half", torch.float16), ("float", torch.float32),
                                            ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_sglangs_spellings_of_rollout_dtype(spelling, want):
    assert SyncConfig.from_verl(_verl(spelling)).dtype == want


def test_auto_is_the_dtype_sglang_serves_the_models_config_in():
    hf = lambda **kw: SimpleNamespace(model_type=kw.pop("model_type", "qwen2"), **kw)  # noqa: E731
    assert SyncConfig.from_verl(_verl("auto"), hf_config=hf(dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert SyncConfig.from_verl(_verl("auto"), hf_config=hf(dtype="float16")).dtype == torch.float16
    # a float32 checkpoint (or none said) is served in float16; a Gemma's in bfloat16
    assert SyncConfig.from_verl(_verl("auto"), hf_config=hf(dtype=torch.float32)).dtype == torch.float16
    assert auto_dtype(hf()) == torch.float16
    assert auto_dtype(hf(model_type="gemma2", dtype="float32")) == torch.bfloat16
    # transformers 4's attribute; SGLang's own spellings of a config's dtype
    assert auto_dtype(hf(torch_dtype="bfloat16")) == torch.bfloat16
    assert auto_dtype(hf(dtype="half")) == torch.float16
    assert auto_dtype(hf(dtype=torch.float16, architectures=["LlavaLlamaForCausalLM"])) == torch.float16
    # an override (the adapter's custom.fsdp_sync.dtype) wins over rollout.dtype
    assert SyncConfig.from_verl(_verl("half"), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_auto_without_the_models_config_or_of_a_multimodal_one_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"rollout\.dtype='auto' is the dtype SGLang reads from the "
                                         r"model's config, which is not at hand here; set "
                                         r"rollout\.dtype to the dtype the engine serves"):
        SyncConfig.from_verl(_verl("auto"))
    mm = SimpleNamespace(model_type="qwen2_vl", dtype=torch.bfloat16, text_config=SimpleNamespace())
    with pytest.raises(ValueError, match=r"rollout\.dtype='auto' for a model whose config has text_config"):
        SyncConfig.from_verl(_verl("auto"), hf_config=mm)
    with pytest.raises(ValueError, match=r"rollout\.dtype: unknown rollout dtype 'float8'"):
        SyncConfig.from_verl(_verl("float8"))
    # an overridden rollout.dtype is not read, so not refused
    assert SyncConfig.from_verl(_verl("auto"), dtype="float32").dtype == torch.float32
