"""`SyncConfig`, field by field (H61's audit): a bad value is refused at construction naming the
field, the value and what is allowed; combinations that cannot work are refused there too, never
at the first sync. In process, no engine.

Found here: a seed past 64 bits was accepted and failed building the manager with torch's
"Overflow when unpacking long long" (dp rank r seeds a generator with ``seed + r``); a
``dist_timeout_s`` past ~9.2e9 s (a "forever" 1e10) was accepted and failed the first
distributed sync with "OverflowError: timestamp out of range for platform time_t" from a socket
timeout, naming no setting.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.config import SyncConfig, mib_to_bytes, parse_bool


BAD = [
    ({"strategy": "flat"}, "strategy must be one of ('per_tensor', 'bucketed', 'flattened'), got 'flat'"),
    ({"method": "nccl"}, "method must be one of ('tensor', 'distributed', 'disk'), got 'nccl'"),
    ({"layout": "rank"}, "layout must be one of ('auto', 'full', 'engine'), got 'rank'"),
    ({"fsdp1_state_dict": "FULL"}, "fsdp1_state_dict must be one of ('full', 'sharded', 'local'), got 'FULL'"),
    ({"verify": "all"}, "verify must be one of ('off', 'sample', 'full'), got 'all'"),
    ({"lora": "on"}, "lora must be one of ('off', 'adapter'), got 'on'"),
    ({"lora_name": ""}, "lora_name must be a non-empty string, got ''"),
    ({"pause_mode": "stop"}, "pause_mode must be one of (None, 'abort', 'retract', 'in_place')"),
    ({"on_replica_failure": "skip"}, "on_replica_failure must be one of ('abort', 'quarantine'), got 'skip'"),
    ({"quantization": "int8"}, "quantization must be one of [None, 'fp8']"),
    ({"disk_hash": "md5"}, "disk_hash must be one of ['xxh3_128', 'sha256']"),
    ({"disk_keep": 0}, "disk_keep must be an int >= 1 (versions kept on disk), got 0"),
    ({"disk_keep": True}, "disk_keep must be an int >= 1"),
    ({"disk_dir": ""}, "disk_dir must be a directory path, got ''"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive int, got 0"),
    ({"bucket_bytes": 1.5}, "bucket_bytes must be a positive int, got 1.5"),
    ({"dist_master_port": 0}, "dist_master_port must be a port number (1-65535) or None, got 0"),
    ({"dist_master_port": 65536}, "dist_master_port must be a port number (1-65535) or None, got 65536"),
    ({"dist_master_address": 127}, "dist_master_address must be a host name or IP address"),
    ({"dist_timeout_s": 0}, "dist_timeout_s must be a positive number of seconds, got 0"),
    ({"dist_timeout_s": float("nan")}, "dist_timeout_s must be a positive number of seconds, got nan"),
    ({"dist_timeout_s": 1e10}, "dist_timeout_s must be at most 1e+09 seconds (31 years), got 10000000000.0"),
    ({"seed": 1 << 63}, "seed must be an int in [-2**63, 2**63)"),
    ({"seed": -(1 << 63) - 1}, "seed must be an int in [-2**63, 2**63)"),
    ({"memory_probe": "uss"}, "memory_probe must be 'full', 'rss' or 'off'"),
    ({"pipelined": 2}, "pipelined must be a bool"),
    ({"dtype": "fp8"}, "dtype: unknown rollout dtype 'fp8'"),
]


def test_a_bad_value_is_refused_naming_field_value_and_what_is_allowed():
    for kw, words in BAD:          # one test: each case costs microseconds, a test item far more
        with pytest.raises(ValueError) as info:
            SyncConfig(**kw)
        assert words in str(info.value), (kw, str(info.value))


def test_the_edges_of_what_is_allowed_are_taken():
    from fsdp_sync.manager_rng import fresh_states

    for seed in (-(1 << 63), (1 << 63) - 1):
        cfg = SyncConfig(seed=seed)
        fresh_states(cfg.seed + 7)       # dp rank 7's generator: what the manager builds
    assert SyncConfig(dist_timeout_s=1e9).dist_timeout_s == 1e9
    c = SyncConfig(bucket_bytes=1, disk_keep=1, dist_master_port=65535)
    assert (c.bucket_bytes, c.disk_keep, c.dist_master_port) == (1, 1, 65535)
    assert SyncConfig(dist_master_port=1).dist_master_port == 1
    # YAML's bare off for the string fields that take "off"
    assert (SyncConfig(lora=False).lora, SyncConfig(verify=False).verify,
            SyncConfig(memory_probe=False).memory_probe) == ("off", "off", "off")


CANNOT = [
    (dict(layout="engine", strategy="bucketed"),
     ["layout='engine' (per-rank buckets) runs with method='tensor', strategy='flattened'",
      "strategy='bucketed'", "use layout='full' or 'auto'"]),
    (dict(layout="engine", method="distributed", dist_format="per_tensor"),
     ["layout='engine' (per-rank buckets) with method='distributed' runs with dist_format='flattened_bucket'",
      "got dist_format='per_tensor'"]),
    (dict(method="disk"), ["method='disk' needs disk_dir"]),
    (dict(method="distributed", strategy="bucketed"), ["strategy='bucketed' is the tensor method's"]),
]


def test_combinations_that_cannot_work_are_refused_at_construction():
    for kw, words in CANNOT:
        with pytest.raises(ValueError) as info:
            SyncConfig(**kw)
        assert all(w in str(info.value) for w in words), (kw, str(info.value))


def test_from_dict_and_from_verl_name_what_they_refuse():
    with pytest.raises(ValueError, match=r"unknown SyncConfig keys \['bucket_size'\]"):
        SyncConfig.from_dict({"bucket_size": 1})
    with pytest.raises(ValueError, match="lora_name must be a non-empty string, got None"):
        SyncConfig.from_dict({"lora_name": None})
    with pytest.raises(ValueError, match=r"rollout.quantization: fsdp_sync syncs block FP8 \('fp8'\) or "
                                         r"nothing \(null\), got 'awq'"):
        SyncConfig.from_verl({"rollout": {"quantization": "awq"}})
    # an override of dtype wins, and verl's own value is then not even read (nor refused)
    cfg = SyncConfig.from_verl({"rollout": {"dtype": "auto"}}, dtype=torch.float16)
    assert cfg.dtype is torch.float16
    with pytest.raises(ValueError, match="bucket_mb must be at least 1 byte"):
        mib_to_bytes(1e-7, "bucket_mb")
    assert mib_to_bytes("0.5", "bucket_mb") == 1 << 19
    for bad in (2, -1, "nein"):
        with pytest.raises(ValueError, match=f"flag must be a bool .*got {bad!r}"):
            parse_bool(bad, "flag")
