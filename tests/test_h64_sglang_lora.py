"""H64: `SGLangEngine.lora_refusal` of an adapter on "all-linear" against a server whose
``--lora-target-modules`` pool holds several of SGLang's modules (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``): a tensor is loaded where its module, stacked as SGLang stacks it,
is ANY of the pool's; only tensors on a module outside every one are refused (SGLang's pool would
skip them). With a pool of one module (tests/test_h11_lora_targets.py) "any" and "all" agree, so
reading it as "all" (every adapter on "all-linear" refused) went unseen."""

from __future__ import annotations

import pytest

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine
from test_h11_lora_targets import config, tensors
from test_sgladapt_lora_rank import SERVER_LORA_ARGS

pytestmark = pytest.mark.timeout(60)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_an_all_linear_adapter_inside_a_pool_of_several_modules_passes():
    eng = fake.FakeSGLangEngine(tp_size=1)
    eng.get_server_info = None
    eng.server_args = type("ServerArgs", (), dict(SERVER_LORA_ARGS, tp_size=1,
                                                  lora_target_modules=ATTN + ["down_proj"]))()
    a = SGLangEngine(eng, tp_size=1)
    metas = lambda ts: [(n, t.dtype, tuple(t.shape)) for n, t in ts]   # noqa: E731
    for inside in (ATTN, ATTN + ["down_proj"], ["o_proj"]):
        assert a.lora_refusal(config("all-linear"), metas(tensors(inside))) is None, inside
    why = a.lora_refusal(config("all-linear"), metas(tensors(ATTN + ["gate_proj", "up_proj"])))
    assert why is not None and "its tensors on ['gate_proj', 'up_proj'] lie outside" in why, why
    a.load_lora_adapter_from_tensors("L", tensors(ATTN), config("all-linear"))
    assert "L" in eng.loras
