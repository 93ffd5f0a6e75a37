"""Parameters SGLang keeps in float32 whatever its ``--dtype``: a sync sends them as the trainer holds
them (float32), never cast to the rollout dtype first.

SGLang 0.5.23 creates these parameters with an explicit ``dtype=torch.float32`` (``srt/models``), so
its loader (``param.data.copy_``) keeps every bit of a float32 tensor it is sent; cast to bfloat16 on
the trainer first, the value SGLang serves is rounded. GLM-5's correction bias sits at an offset
where its spread is a few bfloat16 steps wide (SGLang's comment in ``deepseek_v2.py``): rounded, 8
distinct values became 2 and the top-k routing order changed (verl3 audit). verl's own adapter
sends them as the trainer holds them.

`FLOAT32_PARAMS`, by the last part of the name (the checkpoint's name is the parameter's):

- ``e_score_correction_bias``: ``deepseek_v2.py`` (DeepSeek-V2/V3, Kimi-K2, GLM-5: ``topk_method``
  ``noaux_tc``; bfloat16 only with aiter and some quantizations), ``glm4_moe.py``,
  ``glm4_moe_lite.py``, ``minimax_m2.py``, ``minimax_m3.py``, ``nemotron_h.py``, ``laguna.py``,
  ``ernie45_moe_vl.py``, ``exaone_moe.py``, ``sarvam_moe.py``, ``dots3_common``, ``beam.py``;
- ``A_log``: ``qwen3_next.py``, ``qwen3_5.py``, ``kimi_linear.py``, ``glm5_next.py``, ``kimi_k3.py``,
  ``jet_nemotron.py``, ``nemotron_h.py`` and the Mamba mixer (``layers/attention/mamba/mamba1.py``);
- ``expert_bias``: ``bailing_moe.py``, ``llada2.py``, ``hunyuan_v3.py``;
- ``router_bias``: ``step3p5.py``.

A few models make one of these names in the default dtype (``kimi_linear.py``'s and ``ernie4.py``'s
correction bias): SGLang's loader casts the float32 tensor on its copy, the same bits as the
trainer's cast, so the rule costs them a few bytes a layer, nothing else. A tensor the trainer holds
in another dtype is cast as any other.

Not covered (cast to the rollout dtype as before): float32 parameters SGLang makes under other names
or for one model only, such as the router ``gate.weight`` of ``glm4_moe.py`` / ``glm4_moe_lite.py``
/ ``laguna.py`` (and of ``deepseek_v2.py`` with ``router_fp32``), the ``ReplicatedLinear`` routers
made with ``params_dtype=torch.float32`` (``minimax_m2.py``, ``hunyuan_v3.py``, ``ernie45_moe_vl.py``,
``kimi_linear.py``), ``kimi_k3.py``'s ``dt_bias`` and ``hunyuan_v4.py``'s ``hc_*``: the same name is
bfloat16 in the models fsdp_sync's reference engine serves (``mlp.gate.weight``), whose loaders
refuse a float32 tensor.

Not here: casting (`export`, the verl adapter), what SGLang loads (`engines.sglang`).
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT32_PARAMS", "keeps_float32", "out_dtype"]

FLOAT32_PARAMS = frozenset({"e_score_correction_bias", "A_log", "expert_bias", "router_bias"})
"""The last parts of the names of parameters SGLang keeps in float32 (see the module docstring)."""


def keeps_float32(name: str, dtype: torch.dtype) -> bool:
    """Whether a tensor ``name`` the trainer holds in ``dtype`` is sent in float32 as it is."""
    return dtype == torch.float32 and name.rsplit(".", 1)[-1] in FLOAT32_PARAMS


def out_dtype(name: str, src: torch.dtype, rollout: torch.dtype | None) -> torch.dtype:
    """The dtype a floating-point tensor ``name`` of dtype ``src`` is sent in under the rollout
    dtype ``rollout`` (None: its own): ``rollout``, except for `keeps_float32`."""
    if rollout is None or keeps_float32(name, src):
        return src
    return rollout
