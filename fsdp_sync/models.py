"""Model configs the demo, benchmarks and tests build models from: no download, ever.

`load_config(spec)` takes a recipe name (``fsdp_sync/recipes/models/<name>.yaml``, shipped with the
package), a path to a YAML recipe or
to a Hugging Face ``config.json`` (or a folder holding one), or a ``transformers`` config, and
returns a ``transformers`` config. `build_model(config, seed)` builds a randomly initialized causal
LM from it, the same on every rank for the same seed.

`check_config(config)` refuses, naming the key and the value, sizes no model can be built from (a
count or size that is not a positive integer, heads that do not group, a head_dim of 0):
`load_config` runs it on every config it returns, so the demo, the benchmarks, the plan, the
reference engine and `fsdp-sync serve` refuse such a config before anything is built.

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
from typing import Any, Mapping

import torch

__all__ = ["RECIPES_DIR", "load_config", "check_config", "build_model", "model_recipes", "count_params",
           "hf_config_json"]

# The model recipes ship inside the package (package data), so an installed wheel has them too.
# FSDP_SYNC_RECIPES points at another folder holding ``models/<name>.yaml``.
RECIPES_DIR = Path(os.environ.get("FSDP_SYNC_RECIPES", Path(__file__).resolve().parent / "recipes"))


def model_recipes() -> list[str]:
    return sorted(p.stem for p in (RECIPES_DIR / "models").glob("*.yaml"))


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
             "num_experts", "num_local_experts", "num_experts_per_tok", "decoder_sparse_step")
"""Config keys that count or size something: a positive integer where given (None: the family's
default). 0 or a negative number divides by zero or makes a negative dimension when the model is
built; 0 layers, 0 vocabulary or a 0-wide MLP builds a model that syncs nothing worth having."""


def check_config(config: Any, source: str = "model config") -> None:
    """Refuse (ValueError: ``<source>: <key> must be ..., got <value>``) a config, a mapping or a
    ``transformers`` config, that no model can be built from: a `SIZE_KEYS` value that is not a
    positive integer (a bool, a float, a string such as ``"64"``), a negative
    ``shared_expert_intermediate_size``, num_attention_heads not a multiple of
    num_key_value_heads, no head_dim with hidden_size < num_attention_heads (head_dim 0), or
    num_experts_per_tok above the experts. Keys a mapping leaves out are not checked (the
    family's defaults are sound)."""
    if isinstance(config, Mapping):
        d = config
    else:
        d = {k: getattr(config, k) for k in (*SIZE_KEYS, "shared_expert_intermediate_size")
             if hasattr(config, k)}     # attributes: a family's own names map onto these

    def given(key: str) -> Any:
        v = d.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    for key in SIZE_KEYS:
        v = d.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{source}: {key} must be a positive integer, got {v!r}")
    shared = d.get("shared_expert_intermediate_size")
    if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 0):
        raise ValueError(f"{source}: shared_expert_intermediate_size must be an integer >= 0 (0: no "
                         f"shared expert), got {shared!r}")
    heads, kv, hidden = given("num_attention_heads"), given("num_key_value_heads"), given("hidden_size")
    if heads and kv and heads % kv:
        raise ValueError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads "
                         f"(each key/value head serves a whole group of query heads), got "
                         f"num_attention_heads {heads}, num_key_value_heads {kv}")
    if heads and hidden and d.get("head_dim") is None and hidden < heads:
        raise ValueError(f"{source}: head_dim is hidden_size // num_attention_heads = {hidden} // {heads} "
                         f"= 0: give hidden_size >= num_attention_heads, or a head_dim")
    experts = next((k for k in ("num_experts", "num_local_experts") if given(k)), None)
    top_k = given("num_experts_per_tok")
    if experts and top_k and top_k > d[experts]:
        raise ValueError(f"{source}: num_experts_per_tok must be at most {experts} ({d[experts]}), "
                         f"got {top_k}")


FILE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
"""What a model config file (a recipe, a config.json) must state: `load_config` refuses one that
leaves any out, which transformers would build at its family's defaults."""


def _check_stated(d: dict[str, Any], path: Path) -> None:
    """Refuse a config file that leaves out a `FILE_KEYS` key (under its own name or the family's,
    e.g. GPT-2's ``n_embd`` for ``hidden_size``): transformers would fill it with its defaults."""
    from transformers import CONFIG_MAPPING

    kind = d.get("model_type")
    aliases = getattr(CONFIG_MAPPING[kind], "attribute_map", {}) if kind in CONFIG_MAPPING else {}
    missing = [k for k in FILE_KEYS if k not in d and aliases.get(k) not in d]
    if missing:
        raise ValueError(f"{path} gives no {', '.join(missing)}: a model config file must state "
                         f"{', '.join(FILE_KEYS)} (every Hugging Face config.json does); left out, "
                         f"transformers' defaults ({kind or 'qwen2'}'s) would build another model "
                         f"than the file describes")


def _from_dict(d: dict[str, Any], source: str):
    from transformers import AutoConfig

    check_config(d, source)          # before transformers sees it: its own errors are tracebacks
    d = dict(d)
    model_type = d.pop("model_type", "qwen2")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as exc:   # noqa: BLE001 - a strict-dataclass field error is no ValueError
        raise ValueError(f"{source}: {' '.join(str(exc).split())}") from None
    # with the family's defaults for the keys left out (Mixtral's 8 key/value heads, Qwen3-MoE's
    # top-8): said so, as the file did not give the value refused
    check_config(cfg, f"{source} (with {model_type}'s defaults for the keys it leaves out)")
    cfg.use_cache = True
    return cfg


def load_config(spec: Any = "tiny", **overrides: Any):
    """A ``transformers`` config from a recipe name, a YAML/JSON path, a folder, or a config;
    checked by `check_config` (ValueError naming the file, the key and the value)."""
    from transformers import PretrainedConfig

    source = "model config"
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
        source = str(path)
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
        _check_stated(d, path)
    for drop in ("architectures", "transformers_version", "_name_or_path"):
        d.pop(drop, None)
    d.update(overrides)
    return _from_dict(d, source)


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
        own = d.get("quantization_config") or {}
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
        # the layers the sync left unquantized (`weights.fp8_config`): without the list, an engine
        # started from this checkpoint would build them FP8 and read their bf16 bytes as FP8
        d["quantization_config"].update({k: own[k] for k in ("ignored_layers", "modules_to_not_convert")
                                         if own.get(k)})
    return d
