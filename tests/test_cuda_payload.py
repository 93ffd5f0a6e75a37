"""A CUDA IPC payload, shaped on a CPU machine, meets the receiver's allow-list as on a GPU.

On the first GPU run (`shared/FACTS-gpu.md`) every colocated update was refused by our own checker:
a CUDA tensor's payload names ``torch.storage.TypedStorage`` (the storage class, an argument of
``rebuild_cuda_tensor``) and, at pickle protocol 2, ``_codecs.encode`` (protocol 2's way of writing
bytes). No CPU tensor's payload names either, so no CPU test saw it. Here the payload is built with
exactly the globals and argument types torch 2.11 writes for a CUDA tensor (protocols 5 and 2,
device by UUID): it must pass the allow-list and fail only for want of CUDA. And every slot that
could smuggle a callable still refuses one.
"""

from __future__ import annotations

import os
import pickle
import pickletools

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.weights.handles import HandleError, open_payload

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates a CUDA payload where CUDA is absent")

UUID = "GPU-6f1d2a3b-0000-4c5d-8e9f-0123456789ab"


def _fields(**change):
    """The 15 arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor`` for a float32
    [10, 100] tensor at offset 0 of a 4000-byte allocation, the device already a UUID."""
    f = dict(cls=torch.Tensor, size=torch.Size([10, 100]), stride=(100, 1), offset=0,
             storage_cls=torch.storage.TypedStorage, dtype=torch.float32, device=UUID,
             handle=bytes(range(64)), nbytes=4000, storage_offset=0, requires_grad=False,
             ref_handle=b"/torch_4242_1234567890_0", ref_offset=0, event=bytes(64), event_sync=True)
    f.update(change)
    return tuple(f.values())


class _CudaShaped:
    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (red.rebuild_cuda_tensor, self.args)


def _payload(protocol: int, **change) -> bytes:
    obj = {"flattened_tensor": _CudaShaped(*_fields(**change)), "metadata": []}
    return pickle.dumps(obj, protocol=protocol)


def _globals(data: bytes) -> list[str]:
    """The (module, name) pairs a pickle names, as FACTS-gpu.md lists them (protocol 4+ pushes
    them as strings, memoized and fetched again; older protocols write GLOBAL)."""
    out, pushed, memo = [], [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "GLOBAL":
            out.append(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            out.append(f"{pushed[-2]}.{pushed[-1]}")
        if op.name not in ("MEMOIZE", "SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINGET",
                           "LONG_BINGET", "GET"):
            pushed.append(None)
    return out


@pytest.mark.parametrize("protocol", [5, 2])
def test_cuda_ipc_payload_passes_the_allow_list_and_fails_only_for_want_of_cuda(protocol):
    data = _payload(protocol)
    names = _globals(data)
    # what a real CUDA payload names under torch 2.11 (FACTS-gpu.md), in order
    expected = ["torch.multiprocessing.reductions.rebuild_cuda_tensor", "torch.Tensor",
                "torch.Size", "torch.storage.TypedStorage", "torch.float32"]
    assert [n for n in names if n != "_codecs.encode"] == expected
    assert ("_codecs.encode" in names) == (protocol == 2)
    with pytest.raises(HandleError, match=rf"payload names CUDA device '{UUID}', which this process "
                                          r"cannot see \(CUDA_VISIBLE_DEVICES exposes 0 devices\)"):
        open_payload(data)


def test_a_real_forking_pickler_cuda_reduction_is_what_we_emulate():
    """The shape above is torch's own: `reduce_tensor` of a CUDA tensor returns
    `rebuild_cuda_tensor` with 15 arguments, the 5th its storage's class (read from torch, not
    run: there is no CUDA here)."""
    import inspect

    params = list(inspect.signature(red.rebuild_cuda_tensor).parameters)
    assert len(params) == len(_fields()) == 15
    assert params[4] == "storage_cls" and params[6] == "storage_device"
    src = inspect.getsource(red.reduce_tensor)
    assert "type(storage)" in src and "rebuild_cuda_tensor" in src
    # a tensor's shared storage is a TypedStorage: its type is what the payload names
    assert type(torch.ones(1)._typed_storage()) is torch.storage.TypedStorage


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fsdp_sync_cuda_payload_ran",))


@pytest.mark.parametrize("slot", ["cls", "size", "stride", "offset", "storage_cls", "dtype", "device",
                                  "handle", "nbytes", "storage_offset", "requires_grad", "ref_handle",
                                  "ref_offset", "event", "event_sync"])
def test_a_callable_in_any_slot_is_refused(slot):
    marker = "/tmp/fsdp_sync_cuda_payload_ran"
    if os.path.exists(marker):
        os.unlink(marker)
    for protocol in (5, 2):
        with pytest.raises(HandleError, match="posix.system, which is not on the allow-list"):
            open_payload(_payload(protocol, **{slot: _Boom()}))
    assert not os.path.exists(marker)


@pytest.mark.parametrize("slot, value, words", [
    ("storage_cls", torch.Size, "as the storage class of a rebuild call"),
    ("storage_cls", torch.Tensor, "as the storage class of a rebuild call"),
    ("cls", torch.storage.TypedStorage, "as the tensor class of a rebuild call"),
    ("dtype", "float32", "dtype is not a torch dtype"),
    ("handle", "abc", "IPC handle is 'abc'"),
    ("nbytes", -1, "storage size is -1"),
    ("requires_grad", 1, "requires_grad is 1"),
    ("ref_handle", 7, "ref-counter handle is 7"),
    ("device", 1.5, "device is 1.5"),
    ("nbytes", 40, "reaches byte 4000 of a 40-byte storage"),
])
def test_allowed_names_in_the_wrong_slot_are_refused(slot, value, words):
    for protocol in (5, 2):
        with pytest.raises(HandleError, match=words.replace("(", r"\(")):
            open_payload(_payload(protocol, **{slot: value}))


def test_codecs_encode_is_only_protocol_2_bytes():
    G = b"c_codecs\nencode\n"
    ok = G + b"(X\x03\x00\x00\x00abcX\x06\x00\x00\x00latin1tR."
    assert open_payload(ok).value == b"abc"
    for bad in (G + b"(X\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13tR.",     # another codec
                G + b"(K\x05X\x06\x00\x00\x00latin1tR.",                  # not a str
                G + b"(X\x03\x00\x00\x00abctR."):                         # default codec
        with pytest.raises(HandleError, match=r"only encode\(str, 'latin1'\)"):
            open_payload(bad)


@pytest.mark.parametrize("protocol, fails_with", [
    (5, r"payload names CUDA device '[0-9a-f-]+', which this process cannot see"),
    # torch's own CUDA open: "Torch not compiled with CUDA enabled" (a CPU build), "Found no
    # NVIDIA driver" (a CUDA build without a GPU), the IPC open's error (another GPU)
    (2, r"cannot open payload: (AssertionError|RuntimeError): "),
])
def test_recorded_h100_payloads_pass_the_allow_list(protocol, fails_with):
    """Payloads recorded on an H100 (torch 2.11.0+cu130, scripts/gpu_check.sh's payload step): our
    pickler's (protocol 5, device by UUID) and torch's own ForkingPickler's at protocol 2 (device
    by index, bytes through _codecs.encode). Both get past every name check and fail only where
    the CUDA handle is opened: protocol 2's failure comes from inside torch's
    ``rebuild_cuda_tensor``, whatever the build says there."""
    import traceback
    from pathlib import Path

    data = (Path(__file__).parent / "data" / f"cuda_ipc_payload_torch211_p{protocol}.bin").read_bytes()
    assert "torch.storage.TypedStorage" in _globals(data)
    assert ("_codecs.encode" in _globals(data)) == (protocol == 2)
    with pytest.raises(HandleError, match=fails_with) as failed:
        open_payload(data)
    if protocol == 2:
        frames = [f.name for f in traceback.extract_tb(failed.value.__cause__.__traceback__)]
        assert "rebuild_cuda_tensor" in frames, frames


def test_a_cuda_storage_this_process_still_holds_waits_for_the_producer_as_a_first_open_does(monkeypatch):
    """An engine worker keeps a per-rank bucket's CUDA buffer open for the whole update
    (`UpdateStager._keep_mapped`), so the next bucket's payload names a storage torch finds in
    its shared-storage cache. torch's own ``rebuild_cuda_tensor`` (run here as it is) then hands
    the mapping back without waiting on the event the producer recorded for that payload: only its
    first open (C++, stood in for below) waits. A copy out of the bucket could read the buffer
    before the producer's writes of it landed. Every payload's event is waited on exactly once:
    by torch where it opens the handle, by us where it does not."""
    from fsdp_sync.weights import unpickle

    opened, waited = [], []

    def new_shared_cuda(device, handle, nbytes, offset, ref_handle, ref_offset, event, sync):
        # what THPStorage_newSharedCuda does: open the IPC handle, wait on the producer's event
        opened.append(handle)
        if sync:
            waited.append(("torch", event))
        return torch.UntypedStorage(nbytes)

    class Event:
        def __init__(self, device, handle):
            self.device, self.handle = device, handle

        def wait(self, stream):
            waited.append(("ours", self.handle, self.device, stream))

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared_cuda))
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",      # torch's cache hit
                        staticmethod(lambda handle, offset, *a, **k: waited.append(("released", handle))))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", classmethod(lambda cls, d, h: Event(d, h)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(unpickle, "device_index", lambda device: 0)
    handle = bytes([7]) * 64
    ev = [bytes([i]) * 64 for i in range(4)]

    def value(i, **change):
        return open_payload(_payload(5, handle=handle, event=ev[i], **change)).value["flattened_tensor"]

    first = value(0)                     # opened: torch waits
    second = value(1)                    # still held: torch's cache, so we wait
    assert second.data_ptr() == first.data_ptr() and opened == [handle]
    # the wait is queued before torch's hit gives this payload's reference counter back
    ref = _fields()[11]
    assert waited == [("torch", ev[0]), ("ours", ev[1], 0, "stream of 0"), ("released", ref)]
    third = value(2, event_sync=False)   # the producer synchronized its stream itself: no event
    assert waited[3:] == [("released", ref)]
    del first, second, third
    value(3)                             # nothing held: opened again, torch waits, we do not
    assert opened == [handle, handle]
    assert waited[4:] == [("torch", ev[3])]
