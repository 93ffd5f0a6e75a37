"""H64: `fsdp_sync.integrations.verl_lora` against verl 0.9.1's own rules (`make test-verl`): which
runs verl serves as an adapter (``lora_served_as_adapter``, ``lora_rank_of``: what it sends then
depends on it), the base weights' names (``_strip_lora_base_layer``), and the adapter config
(``normalize_peft_config_for_sglang``) of a real peft ``LoraConfig``: ours must read each as verl
does, or the adapter refuses (or mis-sends) syncs verl makes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


def verl_function(module_file: str, name: str):
    """A top-level function of verl's sglang_rollout package, taken from its source: the module
    imports sglang, which this venv (verl's, no extras) does not have."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("verl.workers.rollout.sglang_rollout")
    path = Path(spec.submodule_search_locations[0]) / module_file
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    space: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), space)
    return space[name]


def test_adapter_runs_and_ranks_as_verl_decides_them():
    from verl.workers.rollout.sglang_rollout.utils import lora_rank_of, lora_served_as_adapter

    from fsdp_sync.integrations import verl_lora

    for rank, lora in [(0, {}), (8, {}), (0, {"rank": 16}), (4, {"rank": 8}), (8, {"merge": True}),
                       (8, {"merge": 1}), (8, {"merge": "true"}), (8, {"merge": False}),
                       (8, {"merge": 0}), (8, {"merge": None}), (0, {"rank": 4, "merge": 1})]:
        mc = SimpleNamespace(lora_rank=rank, lora=dict(lora))
        assert verl_lora.lora_rank(mc) == lora_rank_of(mc), (rank, lora)
        assert verl_lora.served_as_adapter(mc) == bool(lora_served_as_adapter(mc)), (rank, lora)


def test_base_names_and_the_adapter_config_as_verl_sends_them():
    from peft import LoraConfig
    from verl.workers.rollout.sglang_rollout.utils import normalize_peft_config_for_sglang

    _strip_lora_base_layer = verl_function("sglang_rollout.py", "_strip_lora_base_layer")

    from fsdp_sync.integrations import verl_lora

    for name in ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.norm.weight",
                 "model.layers.1.mlp.down_proj.base_layer.bias", "model.base_layer_x.weight"):
        assert verl_lora.base_name(name) == _strip_lora_base_layer(name), name
    for tm in (["q_proj", "v_proj", "k_proj"], "all-linear"):
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=tm).to_dict()
        ours, theirs = verl_lora.normalize_peft_config(cfg), normalize_peft_config_for_sglang(cfg)
        assert ours["peft_type"] == theirs["peft_type"] == "LORA"
        assert ours["r"] == theirs["r"] and ours["lora_alpha"] == theirs["lora_alpha"]
        if isinstance(tm, str):
            assert ours["target_modules"] == theirs["target_modules"] == tm
        else:
            assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"]) == sorted(tm)
