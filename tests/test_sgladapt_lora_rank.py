"""An adapter whose rank exceeds SGLang's ``--max-lora-rank`` (or any adapter into a server started
without LoRA) is refused by `SGLangEngine` before anything is sent, naming the rank and the
server's limit: `lora_sync.check_engine` asks `SGLangEngine.lora_refusal` on every engine before
any is paused, unloaded or loaded.

SGLang's own answer comes late: ``LoRAManager.validate_new_adapter`` (0.5.12 and 0.5.23) answers
the load success=False (`SGLANG_RANK_REFUSAL`, which names the rank but not the limit) only once
the sync has paused generation and unloaded the adapter SGLang served under that name. The fake
answers as the real server does: its server info carries the LoRA launch arguments a server
started with ``--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj`` reports
(`SERVER_LORA_ARGS`), and its load refuses a larger rank with SGLang's message; both are checked
against the installed SGLang's own ``ServerArgs`` and ``validate_new_adapter`` in the sglang tier
(``tests/sglang_tier/test_sgladapt_lora_rank.py``).
"""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake
from fsdp_sync import lora_sync
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError

pytestmark = pytest.mark.timeout(60)

# what SGLang's server info says of a server started with
# --enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj (0.5.12 and 0.5.23)
SERVER_LORA_ARGS = {"enable_lora": True, "max_lora_rank": 8, "lora_paths": None,
                    "lora_target_modules": ["q_proj", "v_proj"]}
# and of one started without LoRA (0.5.23's resolved enable_lora is None; 0.5.12's False)
NO_LORA_ARGS = {"enable_lora": None, "max_lora_rank": None, "lora_paths": None}
# LoRAManager.validate_new_adapter's refusal (0.5.12 and 0.5.23), the load's error_message
SGLANG_RANK_REFUSAL = ("LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
                       "pool configuration. Please ensure that the LoRA adapter's rank is within the "
                       "configured `--max-lora-rank` and that the target modules are included in "
                       "`--lora-target-modules`.")


def config(r: int) -> dict:
    return {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def tensors(r: int) -> list[tuple[str, torch.Tensor]]:
    base = "base_model.model.model.layers.0.self_attn"
    return [(f"{base}.{m}.lora_{ab}.weight", torch.full(shape, 0.5, dtype=torch.bfloat16))
            for m in ("q_proj", "v_proj") for ab, shape in (("A", (r, 16)), ("B", (16, r)))]


def as_launched(engine, args: dict) -> None:
    """``engine`` (the fake's) answers server info and LoRA loads as SGLang launched with ``args``."""
    info, load = engine.get_server_info, engine.load_lora

    def get_server_info():
        return {**info(), **args}

    def load_lora(lora_name, per_rank, config_dict, **kw):
        if not args.get("enable_lora"):
            return fake.lora_update(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if config_dict["r"] > args["max_lora_rank"]:
            return fake.lora_update(False, SGLANG_RANK_REFUSAL.format(name=lora_name, r=config_dict["r"]))
        return load(lora_name, per_rank, config_dict, **kw)

    engine.get_server_info, engine.load_lora = get_server_info, load_lora


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_an_adapter_over_max_lora_rank_is_refused_before_it_is_sent(version):
    with fake.FakeSGLangServer(tp_size=2, version=version) as srv:
        as_launched(srv.engine, SERVER_LORA_ARGS)
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        a.load_lora_adapter_from_tensors("L", tensors(8), config(8))      # at the limit: loads
        assert srv.engine.loras["L"]["config"]["r"] == 8
        assert a.lora_refusal(config(8)) is None
        why = a.lora_refusal(config(16))
        assert "r=16" in why and "--max-lora-rank 8" in why and f"SGLang {version}" in why, why
        # the sync's check on every engine, before any pause, unload or load
        assert lora_sync.check_engine(a, config(16), "L", None) == \
            f"adapter 'L': the engine would refuse it: {why}"
        with pytest.raises(SGLangError, match=r"r=16 exceeds .*--max-lora-rank 8.*nothing was sent"):
            a.load_lora_adapter_from_tensors("M", tensors(16), config(16))
        assert srv.hits.get("/load_lora_adapter_from_tensors") == 1
        assert "M" not in srv.engine.loras and srv.engine.opened_payloads == 2
        info_asks = srv.hits.get("/server_info", 0)
        a.lora_refusal(config(4))
        assert srv.hits.get("/server_info", 0) == info_asks      # launch arguments: asked once


def test_a_server_without_lora_is_refused_and_one_that_does_not_say_is_not_checked():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        as_launched(srv.engine, NO_LORA_ARGS)
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        why = lora_sync.check_engine(a, config(4), "L", None)
        assert why is not None and "enable_lora=None" in why and "--enable-lora" in why, why
        with pytest.raises(SGLangError, match="started without LoRA"):
            a.load_lora_adapter_from_tensors("L", tensors(4), config(4))
        assert "/load_lora_adapter_from_tensors" not in srv.hits
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:   # no LoRA arguments reported
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        assert a.lora_refusal(config(64)) is None
        a.load_lora_adapter_from_tensors("L", tensors(4), config(4))
        assert "L" in srv.engine.loras


@pytest.mark.parametrize("through", ["get_server_info", "server_args"])
def test_in_process_the_limit_is_read_from_the_engine(through):
    eng = fake.FakeSGLangEngine(tp_size=1)
    if through == "get_server_info":
        as_launched(eng, SERVER_LORA_ARGS)
    else:            # an engine without get_server_info: its server_args
        eng.get_server_info = None
        eng.server_args = type("ServerArgs", (), dict(SERVER_LORA_ARGS, tp_size=1))()
    a = SGLangEngine(eng, tp_size=1)
    with pytest.raises(SGLangError, match=r"r=16 exceeds SGLang 0\.5\.23's --max-lora-rank 8|"
                                          r"r=16 exceeds this SGLang server.*--max-lora-rank 8"):
        a.load_lora_adapter_from_tensors("L", tensors(16), config(16))
    assert not [c for c in eng.calls if c[0] == "load_lora_adapter_from_tensors"]
    a.load_lora_adapter_from_tensors("L", tensors(8), config(8))
    assert "L" in eng.loras


def test_without_the_check_sglang_refuses_late_naming_no_limit():
    """The control: SGLang's own refusal (what came back before the check) names no limit, and
    comes after the sync unloaded the adapter SGLang served under that name."""
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        as_launched(srv.engine, SERVER_LORA_ARGS)
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        a.load_lora_adapter_from_tensors("L", tensors(8), config(8))
        a.lora_refusal = lambda cfg, metas=(): None            # the check taken away
        lora_sync.load_adapter(a, "L", dict(tensors(8)), config(8))   # a reload at the limit works
        with pytest.raises(Exception, match="with rank 16 is incompatible") as err:
            lora_sync.load_adapter(a, "L", dict(tensors(16)), config(16))
        assert "8" not in str(err.value).split("rank 16", 1)[1]
        assert "L" not in srv.engine.loras                     # unloaded before the refused load
