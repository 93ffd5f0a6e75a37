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


@pytest.mark.parametrize("kw, words", [
    (dict(method="distributed", strategy="per_tensor"), ["strategy='per_tensor'", "tensor method's",
                                                         "dist_format='per_tensor'"]),
    (dict(method="disk", disk_dir="/tmp/x", strategy="bucketed"), ["strategy='bucketed'", "method='disk' ignores"]),
    (dict(method="tensor", dist_format="per_tensor"), ["dist_format='per_tensor'", "method='tensor' ignores"]),
    (dict(method="disk", disk_dir="/tmp/x", dist_format="per_tensor"), ["distributed method's"]),
])
def test_another_methods_format_is_refused_not_ignored(kw, words):
    """Before: SyncConfig(method="distributed", strategy="per_tensor") was accepted and synced
    flattened buckets (the strategy is read by the tensor method only); likewise dist_format
    outside the distributed method. The defaults still go with every method."""
    with pytest.raises(ValueError) as info:
        SyncConfig(**kw)
    assert all(w in str(info.value) for w in words), str(info.value)
    for method in ("tensor", "distributed", "disk"):
        SyncConfig(method=method, disk_dir="/tmp/x")
    SyncConfig(method="distributed", dist_format="per_tensor")
    SyncConfig(method="tensor", strategy="per_tensor")


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


# --------------------------------------------------------------------------- CLI audit: library inputs

@pytest.mark.parametrize("value, words", [
    ("inf", "update_weights_bucket_megabytes must be a positive number of MiB, got 'inf'"),   # was OverflowError
    ("abc", "update_weights_bucket_megabytes must be a positive number of MiB, got 'abc'"),   # did not name the key
    (1e-7, "update_weights_bucket_megabytes must be at least 1 byte"),                       # was bucket_bytes 0
    (True, "update_weights_bucket_megabytes must be a positive number of MiB, got True"),
])
def test_from_verl_refuses_a_bucket_size_naming_the_key(value, words):
    with pytest.raises(ValueError) as info:
        SyncConfig.from_verl({"rollout": {"checkpoint_engine": {"update_weights_bucket_megabytes": value}}})
    assert words in str(info.value)
    with pytest.raises(ValueError, match="bucket_mb must be at least 1 byte"):
        SyncConfig.from_dict({"bucket_mb": 1e-7})
    assert SyncConfig.from_verl({"rollout": {"update_weights_bucket_megabytes": "64"}}).bucket_bytes == 64 << 20


_GOOD = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
BAD_MODELS = [     # (the change to a sound config.json, the words of the refusal)
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),   # ZeroDivisionError
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),               # RuntimeError
    ({"intermediate_size": -5}, "intermediate_size must be a positive integer, got -5"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),             # strict-dataclass error
    ({"hidden_size": 64.5}, "hidden_size must be a positive integer, got 64.5"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),       # was accepted
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({"num_key_value_heads": 3}, "num_attention_heads must be a multiple of num_key_value_heads"),
    ({"hidden_size": 2}, "head_dim is hidden_size // num_attention_heads = 2 // 4 = 0"),
    ({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok must be at most num_experts (4), got 5"),
    ({"model_type": "qwen2_moe", "decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": -1},
     "shared_expert_intermediate_size must be an integer >= 0"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps"),            # a field transformers checks: one line, named
]


@pytest.mark.parametrize("change, words", BAD_MODELS, ids=[str(c) for c, _ in BAD_MODELS])
def test_load_config_refuses_sizes_no_model_can_be_built_from(change, words, tmp_path):
    """Every loader (the demo, bench, plan, serve, the reference engine) goes through load_config:
    a config.json, a mapping, overrides and a transformers config are all refused with the key and
    the value (they were ZeroDivisionError, RuntimeError or strict-dataclass tracebacks, or a
    0-layer model that synced nothing)."""
    import json

    from fsdp_sync.models import check_config, load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_GOOD, **change}))
    with pytest.raises(ValueError) as info:
        load_config(str(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match="^model config: "):
        load_config({**_GOOD, **change})
    if "rms_norm_eps" not in change:
        with pytest.raises(ValueError):
            check_config({**_GOOD, **change})


def test_load_config_still_loads_every_shipped_recipe_and_unusual_sound_shapes():
    from fsdp_sync.models import load_config, model_recipes

    for name in model_recipes():
        load_config(name)
    cfg = load_config({**_GOOD, "hidden_size": 66})          # head_dim 16 from 66 // 4: HF builds it
    assert cfg.hidden_size == 66
    assert load_config(cfg).num_key_value_heads == 2           # a transformers config goes through too
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer, got 0"):
        load_config("tiny", num_hidden_layers=0)


def test_load_cluster_refuses_a_bad_file_naming_the_field(tmp_path):
    """A cluster JSON with missing fields, no JSON, an unknown key, a number as text or a list was
    a TypeError, JSONDecodeError or AttributeError traceback."""
    import json

    from fsdp_sync.cluster import CLUSTERS, Cluster, load_cluster

    good = CLUSTERS["h100-node"].to_dict()
    path = tmp_path / "c.json"
    for body, words in ((json.dumps({"name": "x", "device": "cuda"}), "cluster fields missing: ['gpus_per_node'"),
                        ("not json", "not a cluster JSON file"),
                        (json.dumps({**good, "bogus": 1}), "unknown cluster fields ['bogus']"),
                        (json.dumps({**good, "memory_per_gpu": "80e9"}),
                         "cluster memory_per_gpu must be a finite number, got '80e9'"),
                        (json.dumps({**good, "gpus_per_node": 8.5}), "cluster gpus_per_node must be a whole number"),
                        (json.dumps({**good, "d2d_gbps": float("inf")}), "cluster d2d_gbps must be a finite number"),
                        (json.dumps({**good, "gpus_per_node": True}), "cluster gpus_per_node must be a finite number"),
                        (json.dumps({**good, "name": 3}), "cluster name must be a string, got 3"),
                        (json.dumps([1, 2]), "expected a mapping of the fields of Cluster, got a list")):
        path.write_text(body)
        with pytest.raises(ValueError) as info:
            load_cluster(path)
        assert words in str(info.value), (body, str(info.value))
    path.write_text(json.dumps({**good, "memory_per_gpu": float(good["memory_per_gpu"])}))  # a whole float
    assert load_cluster(path) == CLUSTERS["h100-node"] and isinstance(load_cluster(path).memory_per_gpu, int)
    path.write_text(json.dumps({"cluster": good, "rows": []}))          # a plan's --json holds one
    assert load_cluster(str(path)) == CLUSTERS["h100-node"]
    with pytest.raises(ValueError, match="cluster cores must be a finite number"):
        Cluster(**{**good, "cores": None})


@pytest.mark.parametrize("left_out", ["model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                      "num_attention_heads"])
def test_a_config_file_that_leaves_out_the_model_is_refused(left_out, tmp_path, capsys):
    """A config file without its sizes was built at transformers' defaults: ``{"x": 1}`` planned
    as a 7B qwen2 and `bench` built it on the CPU until the kernel killed the rank (-9, a
    traceback). Refused by `load_config`, and by `plan` / `bench` in one line that names the path
    once; a family's own names (GPT-2's ``n_embd``) count as stated."""
    import json

    from fsdp_sync.cli import app as cli
    from fsdp_sync.models import load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in _GOOD.items() if k != left_out}))
    with pytest.raises(ValueError, match=rf"^{path} gives no {left_out}: a model config file must state"):
        load_config(str(path))
    for command in ("plan", "bench"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli.main([command, "--models", str(path)])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1, err
        assert err.count(str(path)) == 1 and f"gives no {left_out}" in err, err
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512, "n_layer": 2, "n_embd": 64, "n_head": 4}))
    assert load_config(str(gpt2)).hidden_size == 64


def test_a_missing_model_file_is_named_once(capsys):
    from fsdp_sync.cli import app as cli

    with pytest.raises(SystemExit):
        cli.main(["plan", "--models", "/nonexistent/config.json"])
    err = capsys.readouterr().err
    assert err.count("/nonexistent/config.json") == 1 and "no model recipe" in err, err
