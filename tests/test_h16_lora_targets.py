"""The reference engine's ``lora_target_modules`` bound (SGLang's ``--lora-target-modules``) and
`lora_sync.check_engine`'s compare an adapter's modules as SGLang's ``LoRAMemoryPool.can_support``
does: both sides normalized (q/k/v -> qkv_proj, gate/up -> gate_up_proj, `peft_names.sglang_targets`),
nothing refused when the engine's bound holds "all". Before, they compared raw names: with
``("q_proj", "v_proj")`` a k_proj adapter was refused though SGLang takes it (its pool holds
qkv_proj), and ``("all",)`` refused every adapter. What SGLang refuses (a module outside its pool)
is still refused, naming the modules and the flag; `SGLangEngine.lora_refusal` (its in-process
form, on the fake SGLang of tests/test_h11_lora_targets.py) is the yardstick.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(60)

QV = ("q_proj", "v_proj")
# (engine's lora_target_modules, adapter's target_modules, those SGLang refuses; [] it takes it)
CASES = [
    (QV, ["q_proj", "v_proj"], []),
    (QV, ["q_proj", "k_proj", "v_proj"], []),          # k_proj is SGLang's qkv_proj too
    (QV, ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
          "model.layers.0.self_attn.v_proj"], []),
    (QV, ["q_proj", "v_proj", "o_proj"], ["o_proj"]),
    (QV, ["gate_proj", "up_proj", "q_proj", "v_proj"], ["gate_proj", "up_proj"]),
    (("gate_proj", "q_proj", "v_proj"), ["gate_proj", "up_proj", "down_proj"], ["down_proj"]),
    (("gate_proj", "down_proj", "q_proj", "v_proj"), ["gate_proj", "up_proj", "down_proj"], []),
    (("qkv_proj", "o_proj"), ["q_proj", "k_proj", "v_proj", "o_proj"], []),  # SGLang's own names
    (("all",), ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], []),
    (("all",), ["q_proj", "k_proj", "v_proj"], []),
]

def _cfg(targets, r=4):
    return {"r": r, "lora_alpha": 8, "target_modules": list(targets), "peft_type": "LORA"}


def _reference(allowed):
    """The reference engine's LoRA calls (its refusal needs no workers without tensors)."""
    from fsdp_sync.engines.reference.lora_calls import LoRACalls

    e = LoRACalls()
    e.lora_target_modules, e.max_lora_rank = tuple(allowed), 8
    return e


def _sglang(allowed):
    """`SGLangEngine` in-process on the fake SGLang, launched with ``--lora-target-modules allowed``."""
    import fake_sglang as fake
    from fsdp_sync.engines.sglang import SGLangEngine

    eng = fake.FakeSGLangEngine(tp_size=1)
    eng.get_server_info = None
    eng.server_args = type("ServerArgs", (), {"enable_lora": True, "max_lora_rank": 8, "lora_paths": None,
                                              "tp_size": 1, "lora_target_modules": set(allowed)})()
    return SGLangEngine(eng, tp_size=1)


@pytest.mark.parametrize("allowed,targets,outside", CASES)
def test_the_reference_engine_bounds_target_modules_as_sglang_does(allowed, targets, outside):
    from types import SimpleNamespace

    from fsdp_sync.lora_sync import check_engine

    theirs = _sglang(allowed).lora_refusal(_cfg(targets))
    assert (theirs is None) is not outside, theirs          # the yardstick agrees with the table
    ours = _reference(allowed).lora_refusal(_cfg(targets))
    stub = SimpleNamespace(load_lora_adapter_from_tensors=lambda *a, **k: None, lora_adapters={},
                           lora_target_modules=tuple(allowed))
    bound = check_engine(stub, _cfg(targets), "L", None)
    if not outside:
        assert ours is None and bound is None, (ours, bound)
        return
    assert f"its target_modules {outside} lie outside" in theirs, theirs
    for why in (ours, bound):
        assert why is not None and f"target_modules {outside} are not in the engine's lora_target_modules " \
            f"{list(allowed)}" in why and "--lora-target-modules" in why, why


def test_a_real_reference_engine_loads_k_proj_on_q_v_and_refuses_o_proj():
    """End to end: an engine launched with lora_target_modules=("q_proj", "v_proj") loads an adapter
    on q/k/v (served bit for bit), and refuses one on o_proj before any worker is touched, naming
    the module and the flag; the adapter it serves stays."""
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.engines.base import WeightUpdateError
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    def adapter(targets):
        m = add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=8, targets=targets, seed=2)
        return {n.replace(".default", ""): p.detach().clone() for n, p in m.named_parameters() if ".lora_" in n}

    qkv = adapter(("q_proj", "k_proj", "v_proj"))
    assert any(".k_proj." in n for n in qkv)
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, lora_target_modules=QV,
                         dtype=torch.float32) as eng:
        eng.load_lora_adapter_from_tensors("L", list(qkv.items()), _cfg(["q_proj", "k_proj", "v_proj"]))
        got, want = eng.lora_tensors("L"), {n.removeprefix("base_model.model."): t for n, t in qkv.items()}
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        o = adapter(("o_proj",))
        with pytest.raises(WeightUpdateError, match=r"target_modules \['o_proj'\] are not in the engine's "
                                                    r"lora_target_modules \['q_proj', 'v_proj'\].*--lora-target-modules"):
            eng.load_lora_adapter_from_tensors("M", list(o.items()), _cfg(["o_proj"]))
        assert set(eng.lora_adapters) == {"L"}
