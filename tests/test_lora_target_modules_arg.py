"""`ReferenceEngine`'s ``lora_target_modules`` taken as SGLang's ``--lora-target-modules``: a list of
module names or "all" / "all-linear". A single other string was split into its characters
(``"q_proj"`` -> q, _, p, ...) and every adapter loaded later refused listing them (H51's audit)."""

from __future__ import annotations

import pytest

from fsdp_sync.engines.reference.engine import ReferenceEngine
from fsdp_sync.engines.reference.engine_args import check_target_modules
from fsdp_sync.engines.reference.lora import LoRAConfig
from fsdp_sync.engines.reference.lora_calls import LoRACalls


def _pool(modules):
    calls = LoRACalls()
    calls.lora_target_modules = check_target_modules(modules)
    return calls


def _cfg(*targets):
    return LoRAConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": list(targets)})


def test_a_single_module_name_as_a_string_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"lora_target_modules .* got the string 'q_proj': pass \['q_proj'\]"):
        ReferenceEngine("tiny", lora_target_modules="q_proj")


@pytest.mark.parametrize("bad", [[], ["q_proj", 3], [""], 7])
def test_what_is_not_a_list_of_names_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"lora_target_modules must be a non-empty list of module names"):
        check_target_modules(bad)


@pytest.mark.parametrize("word", ["all", "all-linear"])
def test_all_takes_any_decoder_module(word):
    assert _pool(word)._lora_refusal(_cfg("q_proj", "down_proj")) is None


def test_a_list_takes_its_modules_and_refuses_others_naming_them():
    pool = _pool(["q_proj", "k_proj", "v_proj"])
    assert pool._lora_refusal(_cfg("q_proj", "v_proj")) is None
    why = pool._lora_refusal(_cfg("q_proj", "down_proj"))
    assert why is not None and "['down_proj'] are not in the engine's lora_target_modules" in why, why
