"""An FP8 sync by the per_tensor and bucketed strategies of a model whose hidden size (200) is no
multiple of the 128 block: each weight's quantized copy has partial edge blocks. Before,
`fp8.quantize_block` returned a slice of its padded copy (not contiguous) and the handle check
refused it ('expected a contiguous tensor for 'tensor', got strides (256, 1) for shape (256, 200)'):
every such sync failed on every rank, and `bench --quantization fp8` with its default strategies
crashed. Now both pass verify="full" (the engine holds the trainer's FP8 bytes and scales)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

ODD = {"model_type": "qwen2", "vocab_size": 333, "hidden_size": 200, "intermediate_size": 512,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
       "tie_word_embeddings": True}


def _job(rank, world):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config(ODD)
    module = build_model(cfg, seed=0).to(torch.bfloat16)
    out = {}
    with ReferenceEngine(model_config=cfg, tp_size=1, quantization="fp8", kv_cache_tokens=64,
                         dtype=torch.bfloat16) as engine:
        for strategy in ("per_tensor", "bucketed"):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.01)
            m = FSDPShardingManager(module, engine, mesh=make_mesh(1, 1), config=SyncConfig(
                strategy=strategy, quantization="fp8", dtype=torch.bfloat16, verify="full",
                free_cache_engine=False))
            try:
                with m:
                    out[strategy] = {"quantized": m.stats.extra.get("quantized_tensors"),
                                     "version": engine.weight_version}
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[strategy] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                m.close()
    return out


@pytest.mark.timeout(180)
def test_per_tensor_and_bucketed_fp8_sync_a_model_with_partial_blocks():
    (res,) = run_ranks(_job, 1, timeout_s=160, env=spawn_env())
    for strategy in ("per_tensor", "bucketed"):
        assert "error" not in res[strategy], res
        assert res[strategy]["quantized"] and res[strategy]["quantized"] > 0, res
