"""``custom.fsdp_sync.dtype`` against verl's ``rollout.dtype`` (`make test-verl`).

verl 0.9.1 starts its SGLang server with ``--dtype`` = ``actor_rollout_ref.rollout.dtype``
(``async_sglang_server.py``: ``"dtype": self.config.dtype``; ``RolloutConfig.dtype`` defaults to
``bfloat16``), and its own adapter sends the actor's tensors uncast (SGLang's loader casts them).
fsdp_sync's adapter casts every tensor to ``SyncConfig.dtype`` before flattening. Before: a
``custom.fsdp_sync.dtype`` that differed from ``rollout.dtype`` silently won (from_verl does not
read an overridden key), so float16 went into a bfloat16 server (SGLang casts again: values past
65504 become inf), bfloat16 into a float32 one (low bits lost), or ``fsdp-sync serve`` refused the
first bucket at the first sync. Now the two must agree: unset, ours is verl's; a contradiction is
refused when the adapter is built, naming both keys and values; only a ``base_url`` of the user's
own (no verl server actor there) takes another value.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


def _rollout(verls="bfloat16", **fs) -> dict:
    out = {"name": "sglang", "free_cache_engine": True,
           "checkpoint_engine": {"update_weights_bucket_megabytes": 2048},
           "custom": {"fsdp_sync": dict(enable=True, **fs)}}
    if verls is not None:       # rollout.dtype; fs["dtype"] is custom.fsdp_sync.dtype
        out["dtype"] = verls
    return out


@pytest.mark.parametrize("verls, ours, served, sent", [
    ("bfloat16", "float16", "bfloat16", "float16"),
    ("float32", "bfloat16", "float32", "bfloat16"),
    ("half", "bf16", "float16", "bfloat16"),
    ("auto", "bfloat16", "float16", "bfloat16"),     # tiny is float32: SGLang serves it in float16
    ("bfloat16", None, "bfloat16", "null"),           # no cast: the trainer's float32
])
def test_a_dtype_contradicting_rollout_dtype_is_refused_naming_both(verls, ours, served, sent):
    from fsdp_sync.integrations.verl import sync_config
    from fsdp_sync.models import load_config

    with pytest.raises(ValueError) as err:
        sync_config(_rollout(verls, dtype=ours), load_config("tiny"))
    msg = str(err.value)
    assert f"rollout.custom.fsdp_sync.dtype={sent} contradicts " \
           f"actor_rollout_ref.rollout.dtype={verls} ({served})" in msg, msg
    assert "drop rollout.custom.fsdp_sync.dtype" in msg, msg
    if ours is not None:
        assert f"set actor_rollout_ref.rollout.dtype={sent}" in msg, msg


@pytest.mark.parametrize("verls, ours, want", [
    ("bfloat16", "bf16", torch.bfloat16),
    ("half", "float16", torch.float16),
    ("float", "float32", torch.float32),
    ("auto", "auto", torch.float16),
    ("auto", "float16", torch.float16),
])
def test_the_same_dtype_under_another_spelling_is_taken(verls, ours, want):
    from fsdp_sync.integrations.verl import sync_config
    from fsdp_sync.models import load_config

    assert sync_config(_rollout(verls, dtype=ours), load_config("tiny")).dtype == want


def test_unset_ours_is_verls_and_verls_default_is_bfloat16():
    """What the adapter gets from verl is a ``RolloutConfig``: no ``dtype`` written is its
    default, bfloat16, the dtype verl's server runs, and the adapter casts to it."""
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from fsdp_sync.integrations.verl import sync_config

    assert sync_config(_rollout("float16")).dtype == torch.float16
    cfg = omega_conf_to_dataclass(OmegaConf.create(_rollout(None)), RolloutConfig)
    assert cfg.dtype == "bfloat16" and sync_config(cfg).dtype == torch.bfloat16
    bad = omega_conf_to_dataclass(OmegaConf.create(_rollout(None, dtype="float32")), RolloutConfig)
    with pytest.raises(ValueError, match=r"fsdp_sync\.dtype=float32 contradicts "
                                         r"actor_rollout_ref\.rollout\.dtype=bfloat16"):
        sync_config(bad)


def test_the_adapter_refuses_it_when_built_and_into_verls_own_server(monkeypatch):
    """Up front: building verl's ``("sglang", "async")`` rollout raises before any sync. With a
    ``base_url``: where no server actor of verl's runs (a server of the user's own) the value is
    taken; where base_url is verl's own server (started with rollout.dtype) it is refused at the
    first sync, before verl's stream is walked."""
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.integrations.verl import adapter

    def build(**fs):
        cfg = dict(_rollout("bfloat16", dtype="float16", **fs), tensor_model_parallel_size=1)
        return get_rollout_class("sglang", "async")(
            config=omega_conf_to_dataclass(OmegaConf.create(cfg), RolloutConfig),
            model_config=types.SimpleNamespace(hf_config=None), device_mesh=None)

    with pytest.raises(ValueError, match=r"fsdp_sync\.dtype=float16 contradicts "
                                         r"actor_rollout_ref\.rollout\.dtype=bfloat16"):
        build()

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self, *args):
            async def answer():
                return self.value
            return answer()

    actor = types.SimpleNamespace(get_server_address=Remote(("127.0.0.1", 30123)))
    monkeypatch.setattr(adapter, "named_actor", lambda name: actor)
    rollout = build(base_url="http://localhost:30123")
    assert rollout.sync.dtype == torch.float16
    with pytest.raises(ValueError, match="is verl's own server") as err:
        asyncio.run(rollout._check_base_url())
    assert "fsdp_sync.dtype=float16 contradicts actor_rollout_ref.rollout.dtype=bfloat16" \
        in str(err.value), err.value

    walked = []

    def stream():
        for i in range(3):
            walked.append(i)
            yield f"w{i}", torch.zeros(2)

    rollout = build(base_url="http://localhost:30123")
    with pytest.raises(ValueError, match="contradicts actor_rollout_ref.rollout.dtype"):
        asyncio.run(rollout.update_weights(stream(), global_steps=1))
    assert walked == []      # refused before verl's stream was pulled (every rank refuses alike)
    monkeypatch.setattr(adapter, "named_actor", lambda name: None)
    rollout = build(base_url="http://localhost:30123")
    asyncio.run(rollout._check_base_url())
    assert rollout.sync.dtype == torch.float16
