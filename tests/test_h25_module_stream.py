"""`module_stream.refusal` (in process, no ranks): refusals the adapter's own call does not reach.

- a config that quantizes the rollout refuses even where the caller did not say ``quantized``
  (``SyncConfig.quantization``: verl's stream is quantized tensor by tensor after the cast; the
  module's export is not);
- verl's MoE unfusing (``ModuleStream.unfuse``) is part of the comparison: a stream whose unfuse
  cuts a tensor in two refuses, naming the first tensor that differs;
- a tensor whose dtype buckets cannot hold (complex64) refuses by name even where verl's stream
  sends the same (dropping that check survived every test).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fsdp_sync.integrations.module_stream import ModuleStream, refusal


def _module():
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))


def _cfg(**kw):
    return SimpleNamespace(**{"strategy": "flattened", "quantization": None, "dtype": None,
                              "bucket_bytes": 1 << 20, **kw})


def _same(name, t):
    return t.detach().contiguous()


def test_the_control_is_exact():
    reason, metas = refusal(ModuleStream(iter(()), _module()), _cfg(), _same)
    assert reason is None and [m.name for m in metas] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_a_quantizing_config_refuses_without_the_quantized_flag():
    reason, metas = refusal(ModuleStream(iter(()), _module()), _cfg(quantization="fp8"), _same)
    assert metas is None and reason is not None and "the rollout quantizes" in reason, reason


def test_verls_moe_unfuse_is_compared():
    def unfuse(pairs):     # verl's unfuse_moe_params cuts a fused tensor into per-expert ones
        for name, t in pairs:
            if name == "0.weight":
                yield "0.experts.0.weight", t[:3]
                yield "0.experts.1.weight", t[3:]
            else:
                yield name, t

    reason, metas = refusal(ModuleStream(iter(()), _module(), unfuse=unfuse), _cfg(), _same)
    assert metas is None and reason is not None
    assert ("verl's stream sends 5 tensors, fsdp_sync's export 4; tensor #0: verl "
            "'0.experts.0.weight' float32 (3, 4), fsdp_sync '0.weight' float32 (6, 4)") in reason, reason


def test_a_dtype_buckets_cannot_hold_refuses_naming_the_tensor():
    module = _module()
    module[1].bias = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    reason, metas = refusal(ModuleStream(iter(()), module), _cfg(), _same)
    assert metas is None and reason == "'1.bias' has dtype complex64, which buckets cannot hold", reason
