"""An adapter whose target modules lie outside SGLang's ``--lora-target-modules`` is refused before
anything moves, naming the modules outside and the flag to launch with: `lora_sync.check_engine`
(and `SGLangEngine.load_lora_adapter_from_tensors` itself) asks `SGLangEngine.lora_refusal`, which
compares the adapter's ``target_modules`` with the server's ``lora_target_modules`` as SGLang's
``LoRAMemoryPool.can_support`` does (both normalized: ``q_proj`` / ``k_proj`` / ``v_proj`` are one
``qkv_proj``; an adapter on ``"all-linear"`` passes; a server launched with ``all`` is not checked).

SGLang's own refusal comes late: ``validate_new_adapter`` answers the load success=False ("...
incompatible with the current LoRA memory pool configuration", naming no module), after a sync
paused generation and unloaded the adapter served under that name. The fake here refuses as SGLang
does (its own small table, not fsdp_sync's); the decisions are checked against the installed
SGLang's own functions, 0.5.23 and 0.5.12, in tests/sglang_tier/test_h11_lora_targets_real.py.

And verl's path (`integrations.verl_lora.load_adapter`: unload where listed, then load) asks the
engine's refusal before the unload: a refused adapter leaves the one served in place.
"""

from __future__ import annotations

import pytest
import torch

import fake_sglang as fake
from fsdp_sync import lora_sync
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError
from fsdp_sync.integrations import verl_lora
from test_sgladapt_lora_rank import SERVER_LORA_ARGS, SGLANG_RANK_REFUSAL

pytestmark = pytest.mark.timeout(60)

_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def sglang_accepts(targets, served) -> bool:
    """SGLang's can_support on the target modules alone (the fake's copy, read from 0.5.23)."""
    def norm(ms):
        return {_STACKED.get(m.split(".")[-1], m.split(".")[-1]) for m in ms}
    if isinstance(targets, str):
        return targets in ("all", "all-linear")
    return "all" in norm(targets) or norm(targets) <= norm(served)


def config(targets, r=8) -> dict:
    return {"r": r, "lora_alpha": 16, "target_modules": targets, "peft_type": "LORA"}


def tensors(targets, r=8) -> list[tuple[str, torch.Tensor]]:
    mods = targets if not isinstance(targets, str) else ["q_proj", "v_proj"]
    out = []
    for m in mods:
        where = "mlp" if m.split(".")[-1] in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        base = f"base_model.model.model.layers.0.{where}.{m.split('.')[-1]}"
        out += [(f"{base}.lora_A.weight", torch.full((r, 16), 0.25, dtype=torch.bfloat16)),
                (f"{base}.lora_B.weight", torch.full((16, r), 0.5, dtype=torch.bfloat16))]
    return out


def launched(engine, args: dict) -> None:
    """``engine`` (the fake's) answers server info and loads as SGLang launched with ``args``."""
    info, load = engine.get_server_info, engine.load_lora

    def get_server_info():
        return {**info(), **args}

    def load_lora(lora_name, per_rank, config_dict, **kw):
        if not sglang_accepts(config_dict["target_modules"], args["lora_target_modules"]):
            return fake.lora_update(False, SGLANG_RANK_REFUSAL.format(name=lora_name, r=config_dict["r"]))
        return load(lora_name, per_rank, config_dict, **kw)

    engine.get_server_info, engine.load_lora = get_server_info, load_lora


@pytest.fixture(scope="module")
def server():
    with fake.FakeSGLangServer(tp_size=2, version="0.5.23") as srv:
        launched(srv.engine, SERVER_LORA_ARGS)           # --lora-target-modules q_proj v_proj
        yield srv


def test_targets_outside_the_servers_are_refused_before_anything_is_sent(server):
    a = SGLangEngine(base_url=server.url, retry_backoff_s=0.01)
    # inside: k_proj is SGLang's qkv_proj, as q_proj and v_proj; "all-linear" passes as in SGLang
    for ok in (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"], ["v_proj"], "all-linear", "all",
               ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]):
        assert sglang_accepts(ok, SERVER_LORA_ARGS["lora_target_modules"])
        assert a.lora_refusal(config(ok)) is None, ok
    a.load_lora_adapter_from_tensors("L", tensors(["q_proj", "k_proj", "v_proj"]),
                                     config(["q_proj", "k_proj", "v_proj"]))
    assert "L" in server.engine.loras
    sent = server.hits.get("/load_lora_adapter_from_tensors")
    for bad, outside, flag in (
            (["q_proj", "v_proj", "o_proj"], ["o_proj"], "o_proj q_proj v_proj"),
            (["gate_proj", "up_proj", "q_proj"], ["gate_proj", "up_proj"], "gate_proj q_proj up_proj v_proj"),
            (["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"],
             ["model.layers.0.self_attn.o_proj"], "model.layers.0.self_attn.o_proj q_proj v_proj")):
        assert not sglang_accepts(bad, SERVER_LORA_ARGS["lora_target_modules"])
        why = a.lora_refusal(config(bad))
        assert why is not None and f"its target_modules {outside} lie outside SGLang 0.5.23" in why, why
        assert "--lora-target-modules ['q_proj', 'v_proj']" in why and \
            f"restart SGLang with --lora-target-modules {flag} (or all)" in why, why
        assert lora_sync.check_engine(a, config(bad), "L", None) == \
            f"adapter 'L': the engine would refuse it: {why}"
        with pytest.raises(SGLangError, match=r"lie outside .*nothing was sent"):
            a.load_lora_adapter_from_tensors("M", tensors(bad), config(bad))
    why = a.lora_refusal(config(["q_proj", "v_proj", "o_proj"]))
    assert "SGLang's LoRA weights ['o_proj'] are not among ['qkv_proj']" in why, why
    # a string SGLang does not read (it raises "Only 'all' or 'all-linear' ...") is refused too
    why = a.lora_refusal(config(".*proj"))
    assert why is not None and "target_modules='.*proj'" in why and "'all-linear'" in why, why
    assert server.hits.get("/load_lora_adapter_from_tensors") == sent
    assert "M" not in server.engine.loras and "L" in server.engine.loras


def test_a_server_launched_with_all_or_without_the_flag_is_not_checked():
    for args in (dict(SERVER_LORA_ARGS, lora_target_modules=["all"]),
                 dict(SERVER_LORA_ARGS, lora_target_modules=None, lora_paths=["/a"]),
                 {k: v for k, v in SERVER_LORA_ARGS.items() if k != "lora_target_modules"}):
        with fake.FakeSGLangServer(tp_size=1, version="0.5.12") as srv:
            info = srv.engine.get_server_info
            srv.engine.get_server_info = lambda info=info, args=args: {**info(), **args}
            a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
            assert a.lora_refusal(config(["q_proj", "v_proj", "o_proj", "down_proj"])) is None, args


def test_in_process_the_servers_set_is_read_from_its_server_args():
    eng = fake.FakeSGLangEngine(tp_size=1)
    eng.get_server_info = None              # what ServerArgs holds after __post_init__: a set
    eng.server_args = type("ServerArgs", (), dict(SERVER_LORA_ARGS, tp_size=1,
                                                  lora_target_modules={"q_proj", "v_proj"}))()
    a = SGLangEngine(eng, tp_size=1)
    with pytest.raises(SGLangError, match=r"its target_modules \['down_proj'\] lie outside"):
        a.load_lora_adapter_from_tensors("L", tensors(["q_proj", "down_proj"]), config(["q_proj", "down_proj"]))
    assert not [c for c in eng.calls if c[0] == "load_lora_adapter_from_tensors"]
    a.load_lora_adapter_from_tensors("L", tensors(["q_proj", "v_proj"]), config(["q_proj", "v_proj"]))
    assert "L" in eng.loras


def test_without_the_check_sglang_refuses_late_after_the_unload(server):
    """The control: SGLang's own refusal names no module and comes after the sync unloaded the
    adapter SGLang served under that name."""
    a = SGLangEngine(base_url=server.url, retry_backoff_s=0.01)
    good = ["q_proj", "v_proj"]
    lora_sync.load_adapter(a, "C", dict(tensors(good)), config(good))
    a.lora_refusal = lambda cfg, metas=(): None            # the check taken away
    bad = ["q_proj", "v_proj", "o_proj"]
    with pytest.raises(Exception, match="incompatible with the current LoRA memory pool") as err:
        lora_sync.load_adapter(a, "C", dict(tensors(bad)), config(bad))
    assert "o_proj" not in str(err.value)
    assert "C" not in server.engine.loras                  # unloaded before the refused load


@pytest.mark.parametrize("why", ["targets", "rank"])
def test_verls_swap_leaves_the_served_adapter_when_the_engine_would_refuse(server, why):
    """verl_lora.load_adapter unloads verl's adapter where /v1/models lists it, then loads: the
    engine's refusal is asked first, so nothing is unloaded (before: the unload, then the load's
    own up-front refusal, and SGLang served no adapter under verl's name)."""
    a = SGLangEngine(base_url=server.url, retry_backoff_s=0.01)
    good = ["q_proj", "v_proj"]
    verl_lora.load_adapter(a, tensors(good), config(good))
    held = server.engine.loras[verl_lora.LORA_NAME]["tensors"]
    bad, cfg = (["q_proj", "o_proj"], config(["q_proj", "o_proj"])) if why == "targets" \
        else (good, config(good, r=16))
    unloads = server.hits.get("/unload_lora_adapter", 0)
    with pytest.raises(ValueError, match=r"adapter 'verl_actor_lora_name': the engine would refuse "
                                         r"it: .*nothing was unloaded or sent"):
        verl_lora.load_adapter(a, tensors(bad, r=cfg["r"]), cfg)
    assert server.hits.get("/unload_lora_adapter", 0) == unloads
    assert server.engine.loras[verl_lora.LORA_NAME]["tensors"] is held      # still served, whole
    a.unload_lora_adapter(verl_lora.LORA_NAME)


def test_an_all_linear_adapter_with_tensors_outside_the_servers_modules_is_refused(server):
    """SGLang takes an adapter on "all-linear" whatever the server's --lora-target-modules (its
    can_support returns True for "all"), then its memory pool loads only the tensors whose name
    holds one of its modules and skips the others with a warning: served without them. Refused
    up front from the tensors' names, naming the modules; tensors inside pass."""
    a = SGLangEngine(base_url=server.url, retry_backoff_s=0.01)
    metas = lambda ts: [(n, t.dtype, tuple(t.shape)) for n, t in ts]   # noqa: E731
    inside = tensors(["q_proj", "k_proj", "v_proj"])
    assert a.lora_refusal(config("all-linear"), metas(inside)) is None
    for more in (["o_proj"], ["gate_proj", "up_proj", "down_proj"]):
        ts = inside + tensors(more)
        why = a.lora_refusal(config("all-linear"), metas(ts))
        assert why is not None and f"its tensors on {sorted(more)} lie outside its " \
            f"--lora-target-modules ['q_proj', 'v_proj']" in why and "skips them" in why, why
        assert f"--lora-target-modules {' '.join(sorted(more + ['q_proj', 'v_proj']))} (or all)" in why, why
        sent = server.hits.get("/load_lora_adapter_from_tensors", 0)
        with pytest.raises(SGLangError, match=r"its tensors on .* lie outside .*nothing was sent"):
            a.load_lora_adapter_from_tensors("A", ts, config("all-linear"))
        assert server.hits.get("/load_lora_adapter_from_tensors", 0) == sent
    a.load_lora_adapter_from_tensors("A", inside, config("all-linear"))
    assert "A" in server.engine.loras
    a.unload_lora_adapter("A")
