"""A CPU payload's tensor view must lie inside its shared-memory storage, to the byte.

The receiver's allow-list (`weights.unpickle`) checks every ``rebuild_tensor`` view against the
bytes its storage holds, in the storage's element size (a typed storage of float32: 4 bytes an
element), before torch sees it. A genuine payload is made here by `make_payloads` with its view
forged on the way out (torch's reducer wrapped): the storage is a real shared-memory segment of 4
float32 (16 bytes). A view that reaches one element past it, starts one element in, or has a size
and stride of different ranks is refused by our check, naming the view and the storage, not by
whatever torch says (or does not say) further in. The exact view still opens, with its values.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.weights import handles
from fsdp_sync.weights.handles import HandleError, make_payloads, open_payload


def _open_forged(monkeypatch, meta):
    """Open a payload of ``{"w": arange(4) float32}`` whose tensor view was forged to ``meta``
    ((offset, size, stride, requires_grad) in elements); returns the tensor or the HandleError."""
    orig = handles.torch_reduce_tensor

    def reduce(t):
        fn, args = orig()(t)
        if t.dtype == torch.float32:             # the weight (the payload's state word is int32)
            assert fn.__name__ == "rebuild_tensor" and isinstance(args[1], torch.TypedStorage)
            return fn, (args[0], args[1], meta)
        return fn, args

    monkeypatch.setattr(handles, "torch_reduce_tensor", lambda: reduce)
    # untagged (as SGLang's payloads are): a refusal while unpickling leaves the reference count
    # as the opening left it, and release() is told this consumer opened it
    ps = make_payloads({"w": torch.arange(4, dtype=torch.float32)}, 1, tagged=False)
    monkeypatch.setattr(handles, "torch_reduce_tensor", orig)
    try:
        return open_payload(ps.payloads[0]).value["w"].clone()
    except HandleError as exc:
        return exc
    finally:
        ps.release(require_ack=False)


def test_the_exact_view_opens_with_its_values(monkeypatch):
    got = _open_forged(monkeypatch, (0, (4,), (1,), False))
    assert isinstance(got, torch.Tensor) and got.tolist() == [0.0, 1.0, 2.0, 3.0]
    got = _open_forged(monkeypatch, (1, (3,), (1,), False))      # the last 3 elements: inside
    assert isinstance(got, torch.Tensor) and got.tolist() == [1.0, 2.0, 3.0]
    got = _open_forged(monkeypatch, (0, (2, 2), (2, 1), False))
    assert isinstance(got, torch.Tensor) and got.tolist() == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("meta, words", [
    # one element (4 bytes) past the storage: counted in float32 elements, not in bytes
    ((0, (5,), (1,), False), "(offset 0, size (5,), stride (1,)) reaches byte 20 of a 16-byte storage"),
    ((1, (4,), (1,), False), "(offset 1, size (4,), stride (1,)) reaches byte 20 of a 16-byte storage"),
    ((0, (2, 3), (2, 1), False), "(offset 0, size (2, 3), stride (2, 1)) reaches byte 20 of a 16-byte storage"),
    # inside the storage counted in bytes (8 <= 16), past it in elements (32 bytes)
    ((0, (8,), (1,), False), "(offset 0, size (8,), stride (1,)) reaches byte 32 of a 16-byte storage"),
])
def test_a_view_one_element_past_its_storage_is_refused_naming_view_and_storage(monkeypatch, meta, words):
    got = _open_forged(monkeypatch, meta)
    assert isinstance(got, HandleError), got
    assert words in str(got) and "points outside its buffer; refused" in str(got), str(got)


@pytest.mark.parametrize("meta, shown", [
    ((0, (2, 2), (2,), False), "size (2, 2), stride (2,)"),      # ranks differ: zip would drop a dim
    ((0, (2,), (-1,), False), "size (2,), stride (-1,)"),        # a negative stride walks backwards
    ((0, (-1,), (1,), False), "size (-1,), stride (1,)"),
])
def test_a_view_of_mismatched_ranks_or_negative_ints_is_refused_by_the_check(monkeypatch, meta, shown):
    got = _open_forged(monkeypatch, meta)
    assert isinstance(got, HandleError), got
    assert f"payload's tensor view (offset 0, {shown}) is not non-negative ints of one rank; refused" \
        in str(got), str(got)
