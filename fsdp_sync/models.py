"""Model configs the demo, benchmarks and tests build models from: no download, ever.

`load_config(spec)` takes a recipe name (``fsdp_sync/recipes/models/<name>.yaml``, shipped with the
package), a path to a YAML recipe or
to a Hugging Face ``config.json`` (or a folder holding one), or a ``transformers`` config, and
returns a ``transformers`` config. `build_model(config, seed)` builds a randomly initialized causal
LM from it, the same on every rank for the same seed.

`hf_config_json(module, dtype)` is the config.json a checkpoint of a (possibly FSDP1-wrapped)
module gets.

Not here: sharding the model (callers wrap it with FSDP) or loading weights.
"""

from __future__ import annotations

import contextlib

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["RECIPES_DIR", "load_config", "build_model", "model_recipes", "count_params", "hf_config_json"]

# The model recipes ship inside the package (package data), so an installed wheel has them too.
# FSDP_SYNC_RECIPES points at another folder holding ``models/<name>.yaml``.
RECIPES_DIR = Path(os.environ.get("FSDP_SYNC_RECIPES", Path(__file__).resolve().parent / "recipes"))


def model_recipes() -> list[str]:
    return sorted(p.stem for p in (RECIPES_DIR / "models").glob("*.yaml"))


def _from_dict(d: dict[str, Any]):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", "qwen2")
    cfg = AutoConfig.for_model(model_type, **d)
    cfg.use_cache = True
    return cfg


def load_config(spec: Any = "tiny", **overrides: Any):
    """A ``transformers`` config from a recipe name, a YAML/JSON path, a folder, or a config."""
    from transformers import PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        d = spec.to_dict()
    elif isinstance(spec, dict):
        d = dict(spec)
    else:
        spec = str(spec)
        path = Path(spec)
        if not path.exists() and not path.suffix:
            path = RECIPES_DIR / "models" / f"{spec}.yaml"
            if not path.exists():
                raise FileNotFoundError(f"no model recipe {spec!r}: expected {path} "
                                        f"(known: {', '.join(model_recipes())}) or a config path")
        if path.is_dir():
            path = path / "config.json"
        if path.suffix in (".yaml", ".yml"):
            from omegaconf import OmegaConf

            try:
                d = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            except Exception as exc:   # noqa: BLE001 - yaml's and omegaconf's many error types
                raise ValueError(f"{path} is not a YAML recipe: {type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())}") from None
            d = d.get("model", d) if isinstance(d, dict) else d
        else:
            try:
                d = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path} is not a JSON config: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a mapping of config fields (a Hugging Face "
                             f"config.json), got a {type(d).__name__}")
    for drop in ("architectures", "transformers_version", "_name_or_path"):
        d.pop(drop, None)
    d.update(overrides)
    return _from_dict(d)


def build_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None) -> torch.nn.Module:
    """A randomly initialized causal LM for ``config``: identical on every process for one seed
    (and one device kind). ``device="cuda"`` allocates and initializes on the GPU: a 7B model
    is built in seconds there, against minutes of single-threaded CPU initialization. None: the
    ambient default device (a ``with torch.device("meta"):`` block, or the CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, tensors), counting tied tensors once."""
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return sum(p.numel() for p in seen.values()), len(seen)


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside FSDP1 wrappers (FSDP2 keeps the module itself)."""
    while hasattr(module, "_fsdp_wrapped_module"):
        module = module._fsdp_wrapped_module
    return module


def hf_config_json(module: torch.nn.Module, dtype: torch.dtype | None,
                    quantization: str | None = None) -> dict | None:
    """config.json as ``save_pretrained`` writes it (architectures, dtype of the saved tensors;
    ``quantization="fp8"``: the ``quantization_config`` of a block-FP8 checkpoint), or None when
    the module has no HF config."""
    model = _hf_model(module)
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    d = json.loads(copy.deepcopy(config).to_json_string(use_diff=True))
    arch = next((c.__name__ for c in type(model).__mro__
                 if c.__module__.startswith("transformers.")
                 and c.__name__.endswith(("ForCausalLM", "Model", "LMHeadModel"))), None)
    if arch is not None:
        d["architectures"] = [arch]
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        d["dtype"] = name
        if "torch_dtype" in d:
            d["torch_dtype"] = name
    if quantization == "fp8":     # a block-FP8 checkpoint as SGLang and transformers read one
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
    return d
