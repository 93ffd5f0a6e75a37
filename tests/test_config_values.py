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


# --------------------------------------------------------------------------- issue 21 item 10

def test_yaml_off_and_wrong_types_are_named():
    import yaml

    assert SyncConfig.from_dict(yaml.safe_load("memory_probe: off")).memory_probe == "off"
    assert SyncConfig.from_dict(yaml.safe_load("verify: off")).verify == "off"
    for kwargs, words in (
            ({"dist_backend": "ncl"}, "dist_backend must be one of ('gloo', 'nccl') or None"),
            ({"dist_timeout_s": True}, "dist_timeout_s must be a positive number of seconds, got True"),
            ({"dist_timeout_s": float("inf")}, "dist_timeout_s must be a positive number"),
            ({"dist_master_port": True}, "dist_master_port must be a port number (1-65535) or None, got True"),
            ({"dist_group_name": 5}, "dist_group_name must be a non-empty string, got 5"),
            ({"dist_master_address": ""}, "dist_master_address must be a host name"),
            ({"memory_probe": "maybe"}, "memory_probe must be 'full', 'rss' or 'off'")):
        with pytest.raises(ValueError) as info:
            SyncConfig(**kwargs)
        assert words in str(info.value), (kwargs, str(info.value))
    assert SyncConfig(dist_backend="gloo").dist_backend == "gloo"
    for d, words in (({"bucket_mb": "abc"}, "bucket_mb must be a positive number of MiB, got 'abc'"),
                     ({"bucket_mb": None}, "bucket_mb must be a positive number of MiB, got None"),
                     ({"bucket_mb": 0}, "bucket_mb must be a positive number of MiB, got 0"),
                     ({"bucket_bytes": None}, "bucket_bytes must be a positive int, got None"),
                     ({"strategy": None}, "strategy must be one of"),
                     ({"seed": None}, "seed must be an int, got None")):
        with pytest.raises(ValueError) as info:
            SyncConfig.from_dict(d)
        assert words in str(info.value), (d, str(info.value))
    with pytest.raises(ValueError, match="takes a mapping of SyncConfig keys, got list"):
        SyncConfig.from_dict(["bucket_mb", 8])


def test_reference_engine_takes_the_dtype_names_syncconfig_takes():
    from fsdp_sync.engines.reference import ReferenceEngine

    with ReferenceEngine("tiny", dtype="bf16") as eng:
        assert eng.dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype must be one of .*bf16.*got 'int8'"):
        ReferenceEngine("tiny", dtype="int8")


def test_manager_arguments_are_checked_by_name(tmp_path):
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    engine = object()
    with pytest.raises(TypeError, match="module must be the torch.nn.Module being trained.*got str 'x'"):
        FSDPShardingManager("x", engine, config=SyncConfig(method="disk", disk_dir=str(tmp_path)))
    m = FSDPShardingManager(module, engine, config={"method": "disk", "disk_dir": str(tmp_path),
                                                    "bucket_mb": 4})
    assert m.config == SyncConfig(method="disk", disk_dir=str(tmp_path), bucket_bytes=4 << 20)
    with pytest.raises(ValueError, match="unknown SyncConfig keys \\['buckt_mb'\\]"):
        FSDPShardingManager(module, engine, config={"method": "disk", "disk_dir": str(tmp_path),
                                                    "buckt_mb": 4})
    with pytest.raises(TypeError, match="config must be a SyncConfig or a mapping.*got int 5"):
        FSDPShardingManager(module, engine, config=5)
    m.close()
    with pytest.raises(RuntimeError, match="was closed .* make a new one"):
        with m:
            pass
