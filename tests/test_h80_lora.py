"""H80: LoRA sync in production (`fsdp_sync.lora_sync`), in process, no engine process.

- An adapter whose rank or target modules differ from the one the engine serves under that name
  (a reference engine) is refused, the engine keeping its adapter: the refusal now says what to do
  (unload the engine's adapter, or another ``SyncConfig.lora_name``); before, it named the
  difference only. Unloading, then syncing, serves the new rank (checked by hand: logits 1.8e-7
  from the trainer's, r 8 after r 4, verified).
"""

from __future__ import annotations

from types import SimpleNamespace

from fsdp_sync import lora_sync


def test_an_adapter_of_another_rank_or_targets_is_refused_saying_what_to_do():
    load = lambda *a, **k: None   # noqa: E731
    held = SimpleNamespace(load_lora_adapter_from_tensors=load, weight_version="3",
                           lora_adapters={"a": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    todo = ("to serve this one under 'a', unload the engine's first (engine.unload_lora_adapter('a')), "
            "or sync it under another SyncConfig.lora_name")
    for bad, what in ((cfg, "r=8 but the engine serves it with r=4"),
                      (dict(cfg, r=4, target_modules=["q_proj"]),
                       "target_modules ['q_proj'] but the engine serves it on ['q_proj', 'v_proj']")):
        why = lora_sync.check_engine(held, bad, "a", "3")
        assert why is not None and what in why and why.endswith(todo), why
    assert lora_sync.check_engine(held, dict(cfg, r=4), "a", "3") is None
