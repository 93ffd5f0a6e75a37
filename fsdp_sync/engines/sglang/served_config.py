"""The model config an SGLang server serves, for the manager's first-sync config check.

SGLang's ``/get_model_info`` names the model (``model_path``) but not its config; ``fsdp-sync
serve`` adds the whole Hugging Face config (``hf_config``). `served_config` reads that, or, for a
real SGLang server started from a local directory this process can read, that directory's
``config.json``. Either is rebuilt as a transformers config of its ``model_type`` (so absent keys
take transformers' defaults, as they do on the trainer's side), and `config_check` compares the
values that change the engine's math. None when neither is there: the check is skipped, as for
any engine that does not expose its config.

`model_refusal` says why SGLang itself (not ``fsdp-sync serve`` behind its API) would serve a
trainer's model other than the trainer computes it, whatever a sync sends: its Qwen3-MoE,
Qwen2-MoE and Mixtral classes (0.5.12 and 0.5.23) always build an lm_head of their own and ignore
``tie_word_embeddings``, and nothing fills that head for a tied model (`SEPARATE_HEAD`); its Llama
MLP has no biases whatever ``mlp_bias`` says, and its loader skips the ones a sync sends.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

__all__ = ["served_config", "config_from_dict", "SEPARATE_HEAD", "model_refusal"]

SEPARATE_HEAD = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
"""Families whose SGLang model class builds a ``ParallelLMHead`` of its own whatever
``tie_word_embeddings`` says (``model_type`` -> the class), in 0.5.12 and 0.5.23."""


def served_config(model_info: Any) -> Any | None:
    """The config of the model a server reports in ``/get_model_info`` (see module), or None."""
    if not isinstance(model_info, dict):
        return None
    d = model_info.get("hf_config")
    path = model_info.get("model_path")
    if not isinstance(d, dict) and isinstance(path, str):
        try:
            with open(os.path.join(path, "config.json")) as f:
                d = json.load(f)
        except (OSError, ValueError):
            return None
    return config_from_dict(d) if isinstance(d, dict) else None


class _Config(SimpleNamespace):
    """A config of a model type transformers does not know: its values as attributes."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def config_from_dict(d: dict) -> Any:
    """A transformers config of ``d["model_type"]`` built from ``d``; the values as attributes
    when transformers does not know the type."""
    import transformers

    d = dict(d)
    model_type = d.pop("model_type", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError, TypeError):
        return _Config(model_type=model_type, **d)


def model_refusal(config: Any) -> str | None:
    """Why SGLang would serve the model of ``config`` (the trainer's) other than it computes, or
    None: a Llama with ``mlp_bias`` (SGLang's MLP has no biases and drops the ones it is sent), or a
    tied model of a `SEPARATE_HEAD` family, whose head SGLang keeps apart and no sync
    writes (a tied trainer exports no ``lm_head.weight``: its head is ``embed_tokens``)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "llama" and bool(getattr(config, "mlp_bias", False)):
        return ("mlp_bias=True for a 'llama' model: SGLang's LlamaMLP (0.5.12 and 0.5.23) builds "
                "gate_up_proj and down_proj without biases and its loader skips every MLP .bias it is "
                "sent, so SGLang would serve the model without the trainer's MLP biases; train it with "
                "mlp_bias=False or serve it with fsdp_sync's reference engine")
    if model_type in SEPARATE_HEAD and bool(getattr(config, "tie_word_embeddings", False)):
        return (f"tie_word_embeddings=True for a {model_type!r} model: SGLang's {SEPARATE_HEAD[model_type]} "
                f"always builds an lm_head of its own and ignores the tie, and a tied trainer sends no "
                f"lm_head.weight (its head is model.embed_tokens.weight), so SGLang would keep serving "
                f"the head it was started with; untie the model (tie_word_embeddings=False with an "
                f"lm_head of its own) or serve it with fsdp_sync's reference engine")
    return None
