"""`items_memo.ItemsMemo` works the items out again when the state dict gains or loses entries at
its END: every earlier entry still holds, so only the entry count tells (H9 mutation pass: the
length check dropped survived tests/test_items_memo.py, whose added buffer lands first in the
state dict; with it dropped, a module appended to the model was reused from the memo and its
tensors were silently not exported, and one removed failed with an IndexError)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_sync.weights import export


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) + i)
    return m


def _exported(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in export.iter_params(m)}


def test_a_module_appended_at_the_end_is_exported_and_one_removed_is_not():
    m = _model()
    assert sorted(_exported(m)) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    m.append(nn.Linear(2, 5))                 # its tensors come last in the state dict
    with torch.no_grad():
        m[2].weight.fill_(7.0)
    got = _exported(m)
    assert sorted(got) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert torch.equal(got["2.weight"], torch.full((5, 2), 7.0))
    del m[2]                                  # and gone again: the last entries dropped
    got = _exported(m)
    assert sorted(got) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())
