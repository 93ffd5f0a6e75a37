"""SyncConfig's values: booleans that mean what they say, fields refused with their name, and
`from_verl` following verl 0.9.x (issue 9 item 3, issue 12 item 2)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.config import SyncConfig


@pytest.mark.parametrize("field", ["multi_stage_wake_up", "free_cache_engine", "offload_params",
                                   "share_host_memory"])
def test_string_booleans_are_parsed_not_coerced(field):
    for text, want in (("no", False), ("off", False), ("False", False), ("0", False),
                       ("yes", True), ("On", True), ("true", True), (False, False), (True, True)):
        assert getattr(SyncConfig(**{field: text}), field) is want, (field, text)
    for bad in ("maybe", 2, None, 0.5, "nein"):
        with pytest.raises(ValueError, match=f"{field} must be a bool"):
            SyncConfig(**{field: bad})


def test_other_fields_are_refused_with_their_name():
    with pytest.raises(ValueError, match="seed must be an int, got '7'"):
        SyncConfig(seed="7")
    with pytest.raises(ValueError, match="seed must be an int, got True"):
        SyncConfig(seed=True)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got True"):
        SyncConfig(bucket_bytes=True)
    for dt in ("int8", "float64", torch.int8, torch.float64):
        with pytest.raises(ValueError, match="dtype: (unknown|unsupported) rollout dtype"):
            SyncConfig(dtype=dt)
    assert SyncConfig(dtype="bf16").dtype is torch.bfloat16
    with pytest.raises(ValueError, match="bucket_mb or bucket_bytes, not both"):
        SyncConfig.from_dict({"bucket_mb": 8, "bucket_bytes": 1 << 20})
    assert SyncConfig.from_dict({"bucket_mb": 8, "multi_stage_wake_up": "off"}) == \
        SyncConfig(bucket_bytes=8 << 20, multi_stage_wake_up=False)


def test_from_verl_follows_verl_0_9():
    # booleans as verl's CLI overrides / YAML strings give them
    cfg = SyncConfig.from_verl({"actor_rollout_ref": {
        "rollout": {"free_cache_engine": "False", "multi_stage_wake_up": False, "dtype": "bfloat16"},
        "actor": {"fsdp_config": {"param_offload": "true"}}}})
    assert cfg.free_cache_engine is False and cfg.offload_params is True
    assert cfg.multi_stage_wake_up is True          # verl >= 0.9 always wakes up in stages
    assert cfg.bucket_bytes == 2048 << 20           # verl 0.9's default bucket when the key is absent
    assert cfg.dtype is torch.bfloat16
    # the rollout node alone, the bucket key under checkpoint_engine, an override
    cfg = SyncConfig.from_verl({"checkpoint_engine": {"update_weights_bucket_megabytes": 512}},
                               offload_params=True)
    assert (cfg.bucket_bytes, cfg.offload_params, cfg.free_cache_engine) == (512 << 20, True, True)
    with pytest.raises(ValueError, match="rollout.free_cache_engine must be a bool"):
        SyncConfig.from_verl({"rollout": {"free_cache_engine": "perhaps"}})
    with pytest.raises(ValueError, match="rollout.dtype: unknown rollout dtype 'int8'"):
        SyncConfig.from_verl({"rollout": {"dtype": "int8"}})
    # an OmegaConf node (what verl hands over) reads the same
    from omegaconf import OmegaConf

    node = OmegaConf.create({"actor_rollout_ref": {"rollout": {"free_cache_engine": False,
                                                              "checkpoint_engine": {}}}})
    cfg = SyncConfig.from_verl(node)
    assert (cfg.free_cache_engine, cfg.bucket_bytes) == (False, 2048 << 20)
