"""H92: an SGLang server restarted at the same URL with other LoRA launch arguments (a smaller
``--max-lora-rank``, fewer ``--lora-target-modules``, no ``--enable-lora``).

`SGLangEngine` read the server's LoRA limits once and kept them, though every sync's
``begin_weight_update`` reads the server's info again (its TP size and release, H86). After such a
restart the next base sync's checks passed on the old limits, the base was sent, and SGLang refused
the adapter's load itself, naming no limit, after the sync had unloaded the adapter it served
(/tmp/h92/repro.py). Now the limits follow that same per-sync answer (no request of their own): a
sync whose adapter the new limits refuse is refused at ``begin_weight_update``, before anything is
sent, naming the limit, the server's value, the adapter's and what to do; the checks after it read
the new limits; limits that did not change cost nothing more.
"""

from __future__ import annotations

import json

import pytest
import torch

import fake_sglang as fake
from fsdp_sync import lora_sync
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError

pytestmark = pytest.mark.timeout(60)

# what SGLang's server info says of a server started with
# --enable-lora --max-lora-rank 8 --lora-target-modules o_proj q_proj v_proj (0.5.12 and 0.5.23)
LAUNCH = {"enable_lora": True, "max_lora_rank": 8, "lora_paths": None,
          "lora_target_modules": ["o_proj", "q_proj", "v_proj"]}
# LoRAManager.validate_new_adapter's refusal (0.5.12 and 0.5.23): it names no limit
SGLANG_REFUSAL = ("LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
                  "pool configuration. Please ensure that the LoRA adapter's rank is within the "
                  "configured `--max-lora-rank` and that the target modules are included in "
                  "`--lora-target-modules`.")


def launched(srv, args: dict) -> None:
    """The fake server answers server info, LoRA loads and weight versions as SGLang launched with
    ``args``, read at every call: changing ``args`` is a restart with other arguments."""
    engine = srv.engine
    info, load, route = engine.get_server_info, engine.load_lora, srv._route
    engine.weight_version = "default"

    def get_server_info():
        return {**info(), **args}

    def load_lora(lora_name, per_rank, config_dict, **kw):
        if not args.get("enable_lora"):
            return fake.lora_update(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        pool, targets = args.get("lora_target_modules"), config_dict["target_modules"]
        if config_dict["r"] > args["max_lora_rank"] or (
                pool not in (None, ["all"]) and not set(targets) <= set(pool)):
            return fake.lora_update(False, SGLANG_REFUSAL.format(name=lora_name, r=config_dict["r"]))
        return load(lora_name, per_rank, config_dict, **kw)

    def answer(method, path, body):        # 0.5.23 keeps the weight version in /get_model_info
        if path == "/get_model_info":
            srv.hits[path] = srv.hits.get(path, 0) + 1
            return 200, "application/json", json.dumps({"weight_version": engine.weight_version})
        return route(method, path, body)

    engine.get_server_info, engine.load_lora, srv._route = get_server_info, load_lora, answer


def config(r: int, targets=("q_proj", "v_proj", "o_proj")) -> dict:
    return {"r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "peft_type": "LORA"}


def tensors(r: int, targets=("q_proj", "v_proj", "o_proj")) -> list[tuple[str, torch.Tensor]]:
    base = "base_model.model.model.layers.0.self_attn"
    return [(f"{base}.{m}.lora_{ab}.weight", torch.full(shape, 0.5))
            for m in targets for ab, shape in (("A", (r, 16)), ("B", (16, r)))]


def base_sync(eng, value: float) -> None:
    """A base sync's calls on infer-TP rank 0, as `TensorTransport` makes them: the bracket first."""
    eng.begin_weight_update()
    try:
        eng.update_weights_from_bucket([("w", torch.full((2, 3), value))])
    except BaseException:
        eng.end_weight_update(abort=True)
        raise
    eng.end_weight_update()


def delta(srv, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in srv.hits.items() if v != before.get(k, 0)}


RESTARTS = [
    ({"max_lora_rank": 4},
     ["(max_lora_rank 8 -> 4: restarted?)", "its rank r=8 exceeds", "--max-lora-rank 4",
      "max_lora_rank=4", "restart SGLang with --max-lora-rank >= 8", "train the adapter with r <= 4"]),
    ({"lora_target_modules": ["q_proj", "v_proj"]},          # (q/k/v: one qkv_proj for SGLang)
     ["(lora_target_modules ['o_proj', 'q_proj', 'v_proj'] -> ['q_proj', 'v_proj']: restarted?)",
      "its target_modules ['o_proj'] lie outside", "--lora-target-modules ['q_proj', 'v_proj']",
      "restart SGLang with --lora-target-modules o_proj q_proj v_proj",
      "target_modules within ['q_proj', 'v_proj']"]),
    ({"enable_lora": False},
     ["(enable_lora True -> False: restarted?)", "enable_lora=False", "--enable-lora --max-lora-rank"]),
]


@pytest.mark.parametrize("restart, words", RESTARTS, ids=["rank", "targets", "no_lora"])
def test_a_restart_whose_lora_limits_refuse_the_adapter_is_refused_before_the_base_is_sent(restart, words):
    args = dict(LAUNCH)
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        launched(srv, args)
        eng = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        try:
            assert lora_sync.check_engine(eng, config(8), "L", None) is None    # the first sync's
            base_sync(eng, 1.0)
            eng.load_lora_adapter_from_tensors("L", tensors(8), config(8))
            args.update(restart)                     # restarted at the same URL
            before = dict(srv.hits)
            with pytest.raises(SGLangError) as info:
                base_sync(eng, 2.0)
            msg = str(info.value)
            for w in words + [srv.url, "r=8", "nothing was sent"]:
                assert w in msg, (w, msg)
            assert delta(srv, before) == {"/server_info": 1}        # its own answer: nothing sent
            assert torch.equal(srv.engine.weights["w"], torch.full((2, 3), 1.0))
            assert "L" in srv.engine.loras                          # nothing unloaded
            # the checks that follow read the new limits: the next sync is refused up front
            why = lora_sync.check_engine(eng, config(8), "L", None)
            assert why is not None and words[1] in why, why
            with pytest.raises(SGLangError, match="nothing was sent"):
                eng.load_lora_adapter_from_tensors("M", tensors(8), config(8))
            assert "/load_lora_adapter_from_tensors" not in delta(srv, before)
            args.update(LAUNCH)                      # restarted again as it was: syncs go through
            base_sync(eng, 3.0)
            assert torch.equal(srv.engine.weights["w"], torch.full((2, 3), 3.0))
            assert lora_sync.check_engine(eng, config(8), "L", None) is None
        finally:
            eng.shutdown()


def test_limits_that_did_not_change_or_still_take_the_adapter_cost_nothing_more():
    args = dict(LAUNCH)
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        launched(srv, args)
        eng = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        try:
            assert eng.lora_refusal(config(8)) is None
            base_sync(eng, 1.0)
            sync = {"/server_info": 1, "/begin_weight_update": 1, "/update_weights_from_tensor": 1,
                    "/end_weight_update": 1}
            for _ in range(2):                       # one server-info answer per sync, as before
                before = dict(srv.hits)
                base_sync(eng, 2.0)
                assert delta(srv, before) == sync
            before = dict(srv.hits)
            assert eng.lora_refusal(config(16)) is not None and delta(srv, before) == {}
            args["max_lora_rank"] = 16               # restarted with a larger pool: taken, and read
            base_sync(eng, 3.0)
            assert delta(srv, before) == sync
            assert eng.lora_refusal(config(16)) is None
            eng.load_lora_adapter_from_tensors("L", tensors(16), config(16))
            assert srv.engine.loras["L"]["config"]["r"] == 16
        finally:
            eng.shutdown()


def test_the_managers_lora_base_sync_into_a_restarted_server_sends_nothing(one_rank):
    """The whole sync (`lora_stage`: its checks, then the tensor method's base, then the adapter)
    into one SGLang restarted with ``--max-lora-rank 4``: the base sync the manager asks for
    (``base_sync_done=False``) is refused before the base goes, not after it."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.topology import SyncError, make_mesh
    from fsdp_sync.manager import FSDPShardingManager
    from test_lora_sync import _peft_adapters

    torch.set_num_threads(1)
    args = dict(LAUNCH, lora_target_modules=["all"])
    pm = _peft_adapters({"default": (8, 16)}, ["default"])
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        launched(srv, args)
        eng = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        manager = FSDPShardingManager(pm, eng, mesh=make_mesh(1, 1), config=SyncConfig(
            method="tensor", lora="adapter", lora_name="L", dtype=torch.float32, memory_probe="off"))
        try:
            with manager:
                pass
            assert srv.engine.loras["L"]["config"]["r"] == 8
            args["max_lora_rank"] = 4                # restarted: launch weights, launch version
            srv.engine.weight_version = "default"
            manager.base_sync_done = False           # what the adapter-only sync's refusal says
            before = dict(srv.hits)
            with pytest.raises(SyncError) as info:
                with manager:
                    pass
            msg = str(info.value)
            assert "max_lora_rank 8 -> 4" in msg and "--max-lora-rank >= 8" in msg, msg
            assert "nothing was sent" in msg, msg
            for path in ("/update_weights_from_tensor", "/begin_weight_update",
                         "/load_lora_adapter_from_tensors", "/unload_lora_adapter"):
                assert path not in delta(srv, before), (path, delta(srv, before))
            assert srv.engine.loras["L"]["config"]["r"] == 8
            with pytest.raises(SyncError, match=r"would refuse it: its rank r=8 exceeds .*"
                                                r"--max-lora-rank 4.*nothing was sent"):
                with manager:                        # the next one: refused by the first checks
                    pass
        finally:
            manager.close()
            eng.shutdown()
