"""What docs/methods.md's *Mixed precision* paragraph says, checked: under FSDP mixed precision
(FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``, FSDP1 ``MixedPrecision(param_dtype=bf16)``) the
export with ``dtype=None`` yields the float32 master weights, and with ``dtype=torch.bfloat16``
(the policy's ``param_dtype``) exactly, bit for bit, the bfloat16 weights FSDP computes with (what
a forward pre-hook sees on each Linear and Embedding while FSDP has the unit unsharded).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


def _compute_vs_export(rank: int, world: int, fsdp: str) -> dict:
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    model = build_model(load_config("tiny"), seed=0)
    with torch.no_grad():       # values bfloat16 cannot hold: the cast matters
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    if fsdp == "2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                     device_id=torch.device("cpu"), use_orig_params=True,
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def pre(mod, args):
            for pn, p in mod.named_parameters(recurse=False):
                seen[export.hf_name(f"{name}.{pn}")] = p.detach().clone()
        return pre

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    for h in hooks:
        h.remove()
    out = {"seen": len(seen), "seen_dtypes": sorted({str(t.dtype) for t in seen.values()})}
    for key, dtype in (("none", None), ("bf16", torch.bfloat16)):
        got = {n: t for n, t in export.iter_params(model, dtype=dtype) if n in seen}
        out[key] = {"dtypes": sorted({str(t.dtype) for t in got.values()}),
                    "bit_equal": sum(t.dtype == seen[n].dtype and torch.equal(t.view(torch.int16), seen[n].view(torch.int16))
                                     for n, t in got.items() if t.dtype == torch.bfloat16)}
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fsdp", ["2", "1"])
def test_dtype_param_dtype_exports_the_compute_weights_and_none_the_master_weights(fsdp):
    for out in run_ranks(_compute_vs_export, 2, fsdp, timeout_s=80, pg_timeout_s=30, env=spawn_env()):
        n = out["seen"]
        assert n == 22 and out["seen_dtypes"] == ["torch.bfloat16"], out
        assert out["none"] == {"dtypes": ["torch.float32"], "bit_equal": 0}, out
        assert out["bf16"] == {"dtypes": ["torch.bfloat16"], "bit_equal": n}, out


def test_the_methods_page_says_which_weights_dtype_none_serves_under_mixed_precision():
    """Before: docs/methods.md did not say that dtype=None sends the float32 master weights."""
    text = " ".join(DOCS.read_text().split())
    assert "**Mixed precision.**" in text
    assert "`SyncConfig.dtype=None` (keep the trainer's dtype) sends the float32 master weights" in text
    assert "set `SyncConfig.dtype` to the policy's `param_dtype`" in text
