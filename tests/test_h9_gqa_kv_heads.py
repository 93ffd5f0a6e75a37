"""GQA at every split the layout claims, against SGLang's own rule written out here independently
(``QKVParallelLinear``: TP rank r holds KV head ``r // num_kv_head_replicas`` when there are fewer
KV heads than ranks, else heads ``[r * kv/tp, (r + 1) * kv/tp)``; query heads
``[r * q/tp, (r + 1) * q/tp)``), so a change to the layout map cannot pass by changing the
reference with it (the tests that build their reference with `shard_state_dict` use the map
itself). H9 mutation pass: ``kv_heads_of`` answering ``rank % replicas`` instead of
``rank // replicas`` (TP 4 over 2 KV heads: ranks 1 and 2 hold the wrong head)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import load_config
from fsdp_sync.weights.layout import layout_for, shard_state_dict

D = 16          # head_dim


def _full(cfg) -> dict[str, torch.Tensor]:
    """Every HF tensor of ``cfg`` with distinct values (so a misplaced row shows)."""
    layout = layout_for(cfg, 1)
    out, start = {}, 0
    for name in layout.hf_names():
        shape = layout.full_shape(name)
        n = 1
        for s in shape:
            n *= s
        out[name] = (torch.arange(n, dtype=torch.float64) + start).view(shape)
        start += n
    return out


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 4), (8, 2, 8), (4, 1, 2), (4, 1, 4), (8, 4, 2), (4, 2, 2)])
def test_each_rank_holds_sglangs_query_and_kv_heads(heads, kv, tp):
    cfg = load_config("tiny", num_attention_heads=heads, num_key_value_heads=kv, head_dim=D,
                      hidden_size=64, num_hidden_layers=1, vocab_size=128, attention_bias=True)
    full = _full(cfg)
    layout = layout_for(cfg, tp)
    a = "model.layers.0.self_attn."
    q_local, kv_local = heads // tp, max(1, kv // tp)
    for r in range(tp):
        kv_heads = [r // (tp // kv)] if kv < tp else list(range(r * kv_local, (r + 1) * kv_local))
        rows = lambda hs: [h * D + i for h in hs for i in range(D)]   # noqa: E731
        want_q = full[a + "q_proj.weight"][rows(range(r * q_local, (r + 1) * q_local))]
        want_k = full[a + "k_proj.weight"][rows(kv_heads)]
        want_v = full[a + "v_proj.weight"][rows(kv_heads)]
        want_kb = full[a + "k_proj.bias"][rows(kv_heads)]
        got = shard_state_dict(full, layout, r)
        qkv, bias = got[a + "qkv_proj.weight"], got[a + "qkv_proj.bias"]
        ql, kl = q_local * D, kv_local * D
        assert torch.equal(qkv[:ql], want_q), (r, "q")
        assert torch.equal(qkv[ql:ql + kl], want_k), (r, "k")
        assert torch.equal(qkv[ql + kl:], want_v), (r, "v")
        assert torch.equal(bias[ql:ql + kl], want_kb), (r, "k bias")
