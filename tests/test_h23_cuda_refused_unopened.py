"""A tagged CUDA payload refused for its tag opens no CUDA IPC handle.

torch's ``rebuild_cuda_tensor`` takes the payload's IPC reference counter (given back when the
rebuilt storage dies), and a refused payload's state word stays fresh, so its producer gives the
counter back again at release: one decrement too many (the CPU path takes back its shared-memory
reference; CUDA had nothing to take back). `open_payload` rebuilt every tensor before it read the
tag. Now a tagged payload's CUDA tensors are recorded while it loads and rebuilt only once the tag
admitted it (`weights.cuda_later`): a payload for another rank, opened twice, or released is
refused without calling the rebuild at all. Shown on CPU with the CUDA tensor recorded on an H100
(tests/data, `test_cuda_payload`), put inside our tagged payloads, the rebuild patched to record.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.weights import handles, unpickle
from fsdp_sync.weights.handles import HandleError, make_payloads, open_payload

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates a CUDA payload where CUDA is absent")


class _CudaShaped:
    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (red.rebuild_cuda_tensor, self.args)


class _ReadArgs(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _CudaShaped
        return super().find_class(module, name)


def _recorded() -> _CudaShaped:
    """The float32 [10, 100] CUDA tensor our pickler wrote on an H100 (its 15 arguments)."""
    import io

    data = (Path(__file__).parent / "data" / "cuda_ipc_payload_torch211_p5.bin").read_bytes()
    return _ReadArgs(io.BytesIO(data)).load()


@pytest.fixture
def rebuilds(monkeypatch):
    calls = []

    def rebuild(*args):
        calls.append(args)
        return torch.full((10, 100), float(len(calls)))

    monkeypatch.setattr(unpickle, "rebuild_cuda_tensor_by_uuid", rebuild)
    return calls


def test_a_refused_tagged_cuda_payload_never_calls_the_rebuild(rebuilds):
    cuda = _recorded()
    assert len(cuda.args) == 15 and cuda.args[4] is torch.storage.TypedStorage
    ps = make_payloads({"flattened_tensor": cuda, "metadata": []}, 2)
    other = ps.payloads[1]
    try:
        with pytest.raises(HandleError, match=r"payload for infer-TP rank 0 \(of 2\) opened by rank 1"):
            open_payload(ps.payloads[0], 1)
        assert rebuilds == []                                  # wrong rank: nothing opened
        rec = open_payload(ps.payloads[0], 0)                  # admitted: opened once
        assert len(rebuilds) == 1 and rebuilds[0][7] == cuda.args[7]
        assert torch.equal(rec.value["flattened_tensor"], torch.full((10, 100), 1.0))
        assert rec.value["metadata"] == [] and rec._tensors[0] is rec.value["flattened_tensor"]
        with pytest.raises(HandleError, match=r"opened twice \(state opened\)"):
            open_payload(ps.payloads[0], 0)                    # while the first holds it
        rec.ack()
        with pytest.raises(HandleError, match=r"opened twice \(state acknowledged\)"):
            open_payload(ps.payloads[0], 0)
        assert len(rebuilds) == 1                              # opened twice: nothing opened
        assert ps.unacknowledged() == [1]
    finally:
        ps.release(require_ack=False)                          # rank 1's payload: revoked
    with pytest.raises(HandleError, match="released by its producer"):
        open_payload(other, 1)
    assert len(rebuilds) == 1                                  # released: nothing opened


def test_a_released_tagged_cuda_payload_never_calls_the_rebuild(rebuilds):
    ps = make_payloads({"tensor": _recorded()}, 1)
    data = ps.payloads[0]
    ps.release(require_ack=False)
    with pytest.raises(HandleError, match="released by its producer"):
        open_payload(data, 0)
    assert rebuilds == []


@pytest.mark.parametrize("where", ["set", "key", "slice"])
def test_a_cuda_tensor_where_no_tensor_belongs_is_refused_before_any_rebuild(rebuilds, where):
    cuda = _recorded()
    obj = {"set": {"x": {cuda}}, "key": {"x": {cuda: 1}}, "slice": {"x": slice(cuda)}}[where]
    ps = make_payloads(obj, 1)
    try:
        with pytest.raises(HandleError, match="a CUDA tensor where no tensor belongs"):
            open_payload(ps.payloads[0], 0)
        assert rebuilds == []
    finally:
        ps.release(require_ack=False)


def test_cuda_tensors_in_lists_tuples_and_namespaces_are_put_back_each_once(rebuilds):
    """Every place a payload's tensor may be (a list of (name, tensor) pairs, a namespace, the same
    tuple twice): each CUDA tensor is opened once and is the same object wherever it is."""
    from types import SimpleNamespace

    a, b = _recorded(), _recorded()
    pair = ("w", a)
    ps = make_payloads({"named": [pair, ("v", b)], "again": pair, "ns": SimpleNamespace(t=b, n=3)}, 1)
    try:
        rec = open_payload(ps.payloads[0], 0)
        assert len(rebuilds) == 2
        v = rec.value
        assert v["named"][0] is v["again"] and v["named"][0][0] == "w"
        ta, tb = v["named"][0][1], v["named"][1][1]
        assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor) and ta is not tb
        assert v["ns"].t is tb and v["ns"].n == 3
        assert {id(t) for t in rec._tensors} >= {id(ta), id(tb)}
        rec.ack()
    finally:
        ps.release()


def test_an_untagged_cuda_payload_is_rebuilt_as_it_loads(rebuilds):
    """SGLang's payloads carry no tag: nothing to check, rebuilt as before (the recorded bytes)."""
    data = (Path(__file__).parent / "data" / "cuda_ipc_payload_torch211_p5.bin").read_bytes()
    rec = open_payload(data)
    assert len(rebuilds) == 1 and rec.value.shape == (10, 100)
    assert handles.TAG.encode() not in data


def test_a_tagged_cuda_payload_that_cannot_be_opened_stays_fresh_and_gives_its_cpu_memory_back():
    """The rebuild itself fails (here: the device's UUID is not visible, as on another GPU):
    raised as before, the state word left fresh (not opened: the producer's release gives the
    references back) and this consumer's CPU mappings handed back, so a retry meets the same
    error, not 'opened twice', and nothing is left in /dev/shm (the conftest's check)."""
    ps = make_payloads({"cpu": torch.arange(8, dtype=torch.int32), "cuda": _recorded()}, 1)
    try:
        for _ in range(2):
            with pytest.raises(HandleError, match="names CUDA device '3658aa8b-627d-8a80-7842-ad220fe3bf09', "
                                                  "which this process cannot see"):
                open_payload(ps.payloads[0], 0)
            assert ps.state(0) == handles.FRESH
    finally:
        ps.release(require_ack=False)


def test_an_untagged_payload_naming_the_tag_in_its_data_has_its_cuda_tensors_rebuilt(rebuilds):
    """The tag's key in a payload's bytes (a value "fsdp_sync") without a tag: loaded by the
    recording unpickler, then rebuilt as an untagged payload is."""
    ps = make_payloads({"name": "fsdp_sync", "t": _recorded()}, 1, tagged=False)
    data = ps.payloads[0]
    assert handles.TAG.encode() in data
    rec = open_payload(data)
    assert len(rebuilds) == 1 and isinstance(rec.value["t"], torch.Tensor) and rec.value["name"] == "fsdp_sync"
    ps.release(require_ack=False)


def test_a_cuda_tensor_in_a_tuple_inside_itself_is_refused_before_any_rebuild(rebuilds):
    inner: list = []
    t = (inner, _recorded())
    inner.append(t)
    data = pickle.dumps({"name": "fsdp_sync", "x": t}, protocol=5)
    with pytest.raises(HandleError, match="tuple inside itself"):
        open_payload(data)
    assert rebuilds == []


class _WithState(_CudaShaped):
    def __reduce__(self):
        return (red.rebuild_cuda_tensor, self.args, {"data": 1})


def test_a_cuda_tensor_given_state_by_the_payload_is_refused_before_any_rebuild(rebuilds):
    ps = make_payloads({"tensor": _WithState(*_recorded().args)}, 1)
    try:
        with pytest.raises(HandleError, match="set the state of a CUDA tensor"):
            open_payload(ps.payloads[0], 0)
        assert rebuilds == []
    finally:
        ps.release(require_ack=False)


def test_what_an_open_mapped_goes_with_its_value_not_at_the_next_gc(rebuilds, monkeypatch):
    """Nothing of an open (admitted, refused, or failed in the rebuild) is kept in a reference
    cycle: with the garbage collector off, the producer's segments leave /dev/shm at its release
    (the consumer's mappings already gone) and a rebuilt tensor dies with the value holding it."""
    import gc
    import os
    import weakref

    mine = f"torch_{os.getpid()}_"

    def segments() -> set:
        return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}

    gc.collect()
    before = segments()
    gc.disable()
    try:
        for case in ("admitted", "wrong rank", "refused slot", "rebuild fails"):
            obj = {"cpu": torch.arange(8, dtype=torch.int32), "t": _recorded()}
            if case == "refused slot":
                obj["t"] = {_recorded()}
            ps = make_payloads(obj, 2)
            if case == "admitted":
                rec = open_payload(ps.payloads[0], 0)
                dead = weakref.ref(rec.value["t"])
                rec.ack()
                del rec
                assert dead() is None, case
            else:
                if case == "rebuild fails":
                    monkeypatch.setattr(unpickle, "rebuild_cuda_tensor_by_uuid", _refuse_device)
                with pytest.raises(HandleError):
                    open_payload(ps.payloads[0], 1 if case == "wrong rank" else 0)
            ps.release(require_ack=False)
            del ps, obj
            assert segments() == before, case
    finally:
        gc.enable()


def _refuse_device(*args):
    raise HandleError("payload names CUDA device 'x', which this process cannot see")
