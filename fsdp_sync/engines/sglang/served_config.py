"""The model config an SGLang server serves, for the manager's first-sync config check.

SGLang's ``/get_model_info`` names the model (``model_path``) but not its config; ``fsdp-sync
serve`` adds the whole Hugging Face config (``hf_config``). `served_config` reads that, or, for a
real SGLang server started from a local directory this process can read, that directory's
``config.json``. Either is rebuilt as a transformers config of its ``model_type`` (so absent keys
take transformers' defaults, as they do on the trainer's side), and `config_check` compares the
values that change the engine's math. None when neither is there: the check is skipped, as for
any engine that does not expose its config.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

__all__ = ["served_config", "config_from_dict"]


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
