"""`fsdp-sync plan --recipe`: a plan sweep's YAML read into the sweep's values, each checked as its
flag's text is (`args`: the flag's own ``type=``), so a recipe and the command line refuse the same
values with the same one line, naming the recipe, the key and the value; and the argparse types
only the plan's flags use (``--cluster``, ``--gpu-memory-utilization``).

A recipe's keys are the flags' names with underscores (``layout`` or ``layouts``, as a bench
recipe's: `args.recipe_keys_named`; not both), under ``plan:``; a list key takes a list or one
value. Values are never coerced by truthiness: ``share_host_memory: "no"`` is off, as
``--share-host-memory no`` is, and ``"maybe"`` is refused (``bool("no")`` is True).

Not here: the cross-flag rules and the model checks (`plan.check_plan_args`), the planning.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import args as ca
from ..plan_lora import ALL_LINEAR

__all__ = ["DEFAULTS", "LISTS", "cluster_spec", "fraction", "lora_targets", "read_recipe"]

DEFAULTS = {"models": ("qwen2-160m",), "methods": ("tensor",), "layouts": ("full",), "bucket_mb": (64.0,),
            "ranks": (2,), "tp": (2,), "ep": (1,), "quantization": (None,), "replicas": None,
            "dtype": "float32", "fsdp": 2, "share_host_memory": True, "pipelined": True,
            "gpu_memory_utilization": 0.85, "trainer_dtype": "float32", "trainer_resident_gib": None,
            "cluster": "this-machine", "engine": "sglang", "fsdp1_state_dict": "full",
            "free_cache_engine": True, "weights_cpu_backup": False, "lora_r": None,
            "lora_targets": ALL_LINEAR}
"""The sweep's keys and their values when neither the recipe nor a flag gives one."""
LISTS = ("models", "methods", "layouts", "bucket_mb", "ranks", "tp", "ep", "quantization")
"""The keys that sweep: one plan per combination of their values."""
_NULLABLE = ("quantization", "replicas", "trainer_resident_gib", "lora_r")   # YAML null: none / the default


def cluster_spec(text: str) -> str:
    """``--cluster``: a preset's name, ``this-machine``, or a cluster JSON file."""
    from ..plan import CLUSTERS

    if text in CLUSTERS or text == "this-machine" or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(sorted(CLUSTERS))}, this-machine, or a "
                                     f"cluster JSON file, got {text!r}")


def fraction(text: str) -> float:
    """``--gpu-memory-utilization``: a number in (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}")
    return v


def _fsdp(text: str) -> int:
    return int(ca.choice_of(("1", "2"))(text))


def _checks() -> dict:
    """Each key's check of one value: its flag's ``type=`` (of one item, for a list key)."""
    from ..config import FSDP1_STATE_DICTS, METHODS
    from ..plan import ENGINES

    return {"models": ca.model_spec, "methods": ca.choice_of(METHODS), "layouts": ca.choice_of(("full", "engine")),
            "bucket_mb": ca.mib, "ranks": ca.positive_int, "tp": ca.positive_int, "ep": ca.positive_int,
            "quantization": ca.choice_of(("none", "fp8")), "replicas": ca.positive_int, "dtype": ca.dtype_name,
            "fsdp": _fsdp, "share_host_memory": ca.on_off, "pipelined": ca.on_off,
            "gpu_memory_utilization": fraction, "trainer_dtype": ca.dtype_name,
            "trainer_resident_gib": ca.nonnegative_float, "cluster": cluster_spec, "engine": ca.choice_of(ENGINES),
            "fsdp1_state_dict": ca.choice_of(FSDP1_STATE_DICTS), "free_cache_engine": ca.on_off,
            "weights_cpu_backup": ca.on_off, "lora_r": ca.positive_int, "lora_targets": lora_targets}


def lora_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets``: comma-separated module names (peft's ``target_modules``)."""
    names = tuple(t.strip() for t in text.split(","))
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated module names (q_proj,v_proj), got {text!r}")
    return names


def _value(path: str, key: str, value: Any, check: Any) -> Any:
    """``key: value`` checked as the flag's text would be (YAML's ``2`` as ``"2"``, ``false`` as
    ``"False"``); ValueError names the recipe, the key and the value."""
    def one(x: Any) -> Any:
        if x is None and key in _NULLABLE:
            return None
        try:
            if isinstance(x, (list, tuple, dict)) or x is None:
                raise argparse.ArgumentTypeError(f"expected one value, got {x!r}")
            return check(str(x))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--recipe {path}: {key}: {x!r}: {exc}") from None

    if key == "lora_targets" and isinstance(value, (list, tuple)):     # a YAML list of names
        value = ",".join(map(str, value))
    if key not in LISTS:
        return one(value)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"--recipe {path}: {key}: an empty list; give at least one value")
    return tuple(one(x) for x in items)


def read_recipe(path: str) -> dict:
    """The checked values a plan recipe gives (the keys of `DEFAULTS` it names; a list key as a
    tuple). ValueError: an unknown key, or a value its flag would refuse."""
    d = ca.recipe_mapping(path, "plan")    # one line for a file YAML cannot read
    try:
        d = ca.recipe_keys_named(d)        # ``layout``, the flag's name, or ``layouts``, the bench's
    except ValueError as exc:
        raise ValueError(f"--recipe {path}: {exc}") from None
    unknown = sorted(set(map(str, d)) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"--recipe {path}: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
    checks = _checks()
    return {k: _value(path, k, v, checks[k]) for k, v in d.items()}
