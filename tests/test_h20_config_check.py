"""`config_check.config_mismatches` on the spellings the same model's config comes in (H20's
mutation pass: cases no test pinned). A value transformers assumes when a key is absent, a default
rope written out, rope theta under transformers 5's ``rope_parameters``, a derived head_dim and
FP8's ignored layers with or without ``model.``: equal math, no refusal; a real difference: named."""

from __future__ import annotations

import types

from fsdp_sync.config_check import config_mismatches

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


def cfg(drop=(), **kw):
    d = {k: v for k, v in {**BASE, **kw}.items() if k not in drop}
    return types.SimpleNamespace(**d)


def keys(a, b):
    return [k for k, _, _ in config_mismatches(a, b)]


def test_an_absent_key_counts_as_the_value_transformers_assumes():
    # tie_word_embeddings absent: transformers ties (True)
    assert config_mismatches(cfg(drop=("tie_word_embeddings",)), cfg(tie_word_embeddings=False)) == [
        ("tie_word_embeddings", True, False)]
    assert keys(cfg(drop=("tie_word_embeddings",)), cfg(tie_word_embeddings=True)) == []
    assert keys(cfg(), cfg(attention_bias=False, mlp_bias=False)) == []
    assert keys(cfg(), cfg(attention_bias=True)) == ["attention_bias"]


def test_head_dim_written_or_derived_compares_by_value():
    assert keys(cfg(head_dim=8), cfg()) == []                  # 64 // 8 == 8
    assert config_mismatches(cfg(head_dim=16), cfg()) == [("head_dim", 16, 8)]


def test_rope_spellings_of_the_same_math_are_equal():
    t5 = dict(drop=("rope_theta",), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert keys(cfg(**t5), cfg(rope_scaling=None)) == []      # transformers 5 against 4
    assert keys(cfg(rope_scaling={"type": "default"}), cfg()) == []
    t5_other = dict(drop=("rope_theta",), rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert config_mismatches(cfg(**t5_other), cfg()) == [("rope_theta", 1e6, 10000.0)]
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert config_mismatches(cfg(rope_scaling=yarn), cfg()) == [("rope_scaling", yarn, None)]


def test_fp8_ignored_layers_compare_without_the_model_prefix():
    def fp8(ignored):
        return cfg(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                        "ignored_layers": ignored})

    assert keys(fp8(["model.layers.0.mlp.down_proj"]), fp8(["layers.0.mlp.down_proj"])) == []
    assert keys(fp8(["layers.0.mlp.down_proj"]), fp8(["layers.1.mlp.down_proj"])) == [
        "quantization_config.ignored"]


def test_a_bucket_size_past_floats_range_is_refused_naming_the_key():
    """Before: ``SyncConfig.from_dict({"bucket_mb": 10**400})`` raised a bare OverflowError (int too
    large to convert to float), naming no key; verl's key the same through `from_verl`."""
    import pytest

    from fsdp_sync.config import SyncConfig

    with pytest.raises(ValueError, match=r"bucket_mb must be a positive number of MiB, got 1000"):
        SyncConfig.from_dict({"bucket_mb": 10**400})
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes must be a positive number"):
        SyncConfig.from_verl({"rollout": {"update_weights_bucket_megabytes": 10**400}})


def test_per_rank_layout_combinations_that_cannot_run_are_refused_naming_both_values():
    import pytest

    from fsdp_sync.config import SyncConfig

    with pytest.raises(ValueError) as info:
        SyncConfig(method="distributed", layout="engine", dist_format="per_tensor")
    assert "dist_format='per_tensor'" in str(info.value) and "layout='full' or 'auto'" in str(info.value)
    with pytest.raises(ValueError) as info:
        SyncConfig(method="tensor", layout="engine", strategy="bucketed")
    assert "strategy='bucketed'" in str(info.value) and "layout='full' or 'auto'" in str(info.value)
    SyncConfig(method="distributed", layout="engine")
    SyncConfig(method="tensor", layout="auto", strategy="bucketed")      # auto picks full there


def test_the_last_port_number_is_taken_and_the_next_refused():
    import pytest

    from fsdp_sync.config import SyncConfig

    assert SyncConfig(dist_master_port=65535).dist_master_port == 65535
    assert SyncConfig(dist_master_port=1).dist_master_port == 1
    with pytest.raises(ValueError, match=r"dist_master_port must be a port number \(1-65535\) or None, got 65536"):
        SyncConfig(dist_master_port=65536)
