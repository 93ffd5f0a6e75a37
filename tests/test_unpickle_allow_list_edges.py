"""Allowed rebuild functions handed arguments of the wrong kind are refused by our own checks.

`weights.unpickle` admits torch's rebuild functions only through wrappers that check every
argument before torch sees it: the storage of ``rebuild_tensor`` is a storage (not a list, not a
namespace dressed as one), its metadata is ``(offset, size, stride, requires_grad)``, and
``rebuild_typed_storage`` takes an UntypedStorage and a torch dtype. Each payload below names only
allowed globals; what is wrong is an argument, and the refusal names it (torch's own error, were
the check gone, says nothing of the payload). A genuine empty tensor built the same way still opens.
"""

from __future__ import annotations

import pickle
import types

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.weights.handles import HandleError, open_payload


class _Call:
    """Pickles as ``fn(*args)``: a payload made of allowed globals only."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


_EMPTY = _Call(red.rebuild_storage_empty, torch.UntypedStorage)          # a 0-byte storage


@pytest.mark.parametrize("obj, words", [
    (_Call(red.rebuild_tensor, torch.Tensor, [1, 2], (0, (1,), (1,), False)),
     "payload passes list where a storage belongs"),
    (_Call(red.rebuild_tensor, torch.Tensor,
           types.SimpleNamespace(dtype=torch.float32, nbytes=64), (0, (0,), (1,), False)),
     "payload passes SimpleNamespace where a storage belongs"),
    (_Call(red.rebuild_tensor, torch.Tensor, _EMPTY, (0, (0,), (1,))),
     "payload's tensor metadata is not (offset, size, stride, requires_grad)"),
    (_Call(red.rebuild_tensor, torch.Tensor, _EMPTY, [0, (0,), (1,), False]),
     "payload's tensor metadata is not (offset, size, stride, requires_grad)"),
    (_Call(red.rebuild_typed_storage, _EMPTY, "float32"),
     "payload's typed storage is not (UntypedStorage, dtype)"),
    (_Call(red.rebuild_typed_storage, [0, 0, 0, 0], torch.float32),
     "payload's typed storage is not (UntypedStorage, dtype)"),
])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_an_allowed_rebuild_given_the_wrong_argument_is_refused_by_name(obj, words, protocol):
    with pytest.raises(HandleError) as info:
        open_payload(pickle.dumps({"x": obj}, protocol=protocol))
    assert str(info.value) == words


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_genuine_empty_tensor_built_of_the_same_calls_opens(protocol):
    typed = _Call(red.rebuild_typed_storage, _EMPTY, torch.bfloat16)
    got = open_payload(pickle.dumps({"x": _Call(red.rebuild_tensor, torch.Tensor, typed,
                                                (0, (0, 3), (3, 1), False))}, protocol=protocol)).value
    assert type(got["x"]) is torch.Tensor and got["x"].dtype == torch.bfloat16
    assert tuple(got["x"].shape) == (0, 3)


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_build_cannot_grow_an_empty_storage(protocol):
    """A payload's BUILD on a tensor rebuilt from an empty storage reaches Tensor.__setstate__,
    whose set_(storage, offset, size, stride) grew torch's (resizable) empty storage to any size:
    a payload of a few hundred bytes made the receiver allocate 1.2 GB (300M float32) and fill it.
    The empty storage a payload gets now cannot grow: refused, nothing allocated."""
    class _WithState(_Call):
        def __init__(self, fn, args, state):
            super().__init__(fn, *args)
            self.state = state

        def __reduce__(self):
            return self.fn, self.args, self.state

    typed = _Call(red.rebuild_typed_storage, _EMPTY, torch.float32)
    grow = _WithState(red.rebuild_tensor, (torch.Tensor, typed, (0, (0,), (1,), False)),
                      (typed, 0, (300_000_000,), (1,)))
    data = pickle.dumps({"x": grow}, protocol=protocol)
    assert len(data) < 1000
    with pytest.raises(HandleError, match="not resizable"):
        open_payload(data)
