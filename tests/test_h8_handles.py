"""Handle payloads, mutation pass H8: what no earlier test pinned.

- A tagged payload's CUDA tensors are among those its unpickling records (`Received._tensors`),
  so the acknowledgement synchronizes their device before it says acknowledged: with
  ``rebuild_cuda_tensor`` left out of the record, `ack_all` saw no CUDA device, synchronized
  nothing and set the word at once; the producer could then rewrite its bucket while the
  consumer's asynchronous copy out of it still ran (a wrong result on a GPU, silent).
- A CUDA handle with more fields than torch's 15 is refused by our check, naming the count.

No CUDA here: the producer's ``reduce_tensor`` answers for one marked tensor as torch's does for a
CUDA tensor, and the consumer's rebuild hands back a CPU tensor that says it lives on ``cuda:0``.
"""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.weights import handles, unpickle
from fsdp_sync.weights.handles import HandleError, make_payloads, open_payload

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(torch.cuda.is_available(), reason="emulates CUDA where it is absent")]

UUID = "GPU-6f1d2a3b-0000-4c5d-8e9f-0123456789ab"


def _on_cuda0() -> torch.Tensor:
    device = property(lambda self: torch.device("cuda", 0))
    return torch.zeros(1000).as_subclass(type("OnCuda0", (torch.Tensor,), {"device": device}))


def _cuda_shaped(monkeypatch, marked: torch.Tensor) -> list:
    """``marked`` shares as a CUDA tensor would; opening it gives a tensor on ``cuda:0``; every
    stream synchronization `ack_all` asks for is recorded (with the state words' values then)."""
    real, ptr = handles.torch_reduce_tensor(), marked.data_ptr()

    def reduce(t):
        if t.data_ptr() != ptr:
            return real(t)
        return (red.rebuild_cuda_tensor,
                (torch.Tensor, t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0,
                 bytes(range(64)), 4000, 0, False, b"/torch_4242_1234567890", 7, bytes(64), True))

    monkeypatch.setattr(handles, "torch_reduce_tensor", lambda: reduce)
    monkeypatch.setattr(handles, "device_uuid", lambda index: UUID)
    monkeypatch.setattr(unpickle, "rebuild_cuda_tensor_by_uuid", lambda *args: _on_cuda0())
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: None))
    synced: list = []
    monkeypatch.setattr(handles, "_sync_stream", lambda device: synced.append(str(device)))
    return synced


def test_the_ack_of_a_cuda_payload_synchronizes_its_device_before_it_says_acknowledged(monkeypatch):
    marked = handles.empty_shared(4000).view(torch.float32)
    synced = _cuda_shaped(monkeypatch, marked)
    with make_payloads({"flattened_tensor": marked, "metadata": []}, 1) as ps:
        rec = open_payload(ps.payloads[0], 0)
        assert rec.value["flattened_tensor"].device == torch.device("cuda", 0)
        states = []
        monkeypatch.setattr(handles, "_sync_stream",
                            lambda device: (synced.append(str(device)), states.append(ps.state(0))))
        rec.ack()
        assert synced == ["cuda:0"] and states == [handles.OPENED]
        assert ps.state(0) == handles.ACKED


@pytest.mark.parametrize("protocol", [5, 2])
def test_a_cuda_handle_with_more_fields_than_torchs_is_refused_by_count(protocol):
    class Shaped:
        def __reduce__(self):
            return (red.rebuild_cuda_tensor,
                    (torch.Tensor, torch.Size([10]), (1,), 0, torch.storage.TypedStorage,
                     torch.float32, UUID, bytes(64), 40, 0, False, b"/torch_1_2_3", 0, bytes(64),
                     True, 0))

    with pytest.raises(HandleError, match="CUDA tensor handle has 16 fields, expected 15"):
        open_payload(pickle.dumps({"x": Shaped()}, protocol=protocol))


def _segment_of(t: torch.Tensor) -> str:
    return "/dev/shm/" + t.untyped_storage()._share_filename_cpu_()[1].decode()[1:]


def test_a_consumer_that_maps_a_segment_last_unlinks_it():
    """The producer let go of everything (its tensor dropped, its payloads released, counted as
    opened: SGLang's untagged ones) before the consumer opened its payload: the consumer's mapping
    takes the last reference, so it unlinks the segment (as torch's last close would); with the
    mapping's give-back not unlinking at zero the segment stayed in /dev/shm for good."""
    import os

    t = handles.empty_shared(64).view(torch.float32)
    t.copy_(torch.arange(16.0))
    path = _segment_of(t)
    ps = make_payloads(t, 1, tagged=False)
    payload = ps.payloads[0]
    del t
    ps.release(require_ack=False)          # nothing given back: the consumer's reference stays
    assert os.path.exists(path)
    fds = len(os.listdir("/proc/self/fd"))
    got = open_payload(payload).value
    assert torch.equal(got, torch.arange(16.0)) and not os.path.exists(path)
    del got
    assert len(os.listdir("/proc/self/fd")) == fds        # the mapping's descriptor went with it


def test_a_wrong_rank_mapping_by_file_gives_its_reference_back_and_the_right_rank_opens():
    """A consumer in another process maps the segment by file (`shm.map_segment`, stood in for
    here by dropping this process's torch cache entry). Refused as the wrong rank, it gives back
    the references its mapping took (+1), the data's and the state word's: given back the wrong
    way (-1), the segment was unlinked under the rightful consumer, whose open then failed; not
    given back (the state word's), its count stayed one short."""
    from fsdp_sync.weights.shm import mapped_handle

    t = handles.empty_shared(64).view(torch.float32)
    t.copy_(torch.arange(16.0))
    handle = t.untyped_storage()._share_filename_cpu_()[1]
    ps = make_payloads(t, 2)
    state = ps.states[0].untyped_storage()._share_filename_cpu_()[1]
    for h in (handle, state):
        red.shared_cache.pop(h, None)             # as in another process: mapped by its file

    def counts():       # torch's reference counts, in the segments' headers
        return [int.from_bytes(open(f"/dev/shm/{h.decode()[1:]}", "rb").read(4), sys.byteorder)
                for h in (handle, state)]

    before = counts()
    with pytest.raises(HandleError, match="payload for infer-TP rank 0 .* opened by rank 1"):
        open_payload(ps.payloads[0], 1)
    assert counts() == before                     # the data's and the state word's given back
    rec = open_payload(ps.payloads[0], 0)
    assert mapped_handle(rec.value.untyped_storage()) == handle
    assert torch.equal(rec.value, torch.arange(16.0))
    rec.ack()
    open_payload(ps.payloads[1], 1).ack()
    ps.release()


def test_a_payload_cannot_set_attributes_of_the_functions_it_may_call():
    """``BUILD`` on an allowed function: before, a payload could set ``_codecs.encode``'s wrapper's
    ``__defaults__`` (for good, in the receiving process) or reset the partial that maps shared
    memory (its ``__setstate__``: another function, other arguments). Now both are refused and
    nothing changed."""
    before = unpickle._latin1_bytes.__defaults__
    set_defaults = (b"\x80\x02c_codecs\nencode\nN}X\x0c\x00\x00\x00__defaults__X\x06\x00\x00\x00"
                    b"latin1\x85s\x86b.")
    reset_partial = (b"\x80\x02ctorch.multiprocessing.reductions\nrebuild_storage_filename\n"
                     b"(cbuiltins\ndict\n)}Ntb.")
    with pytest.raises(HandleError, match="payload tried to set an attribute on a function"):
        open_payload(set_defaults)
    with pytest.raises(HandleError, match="state is not a dictionary"):
        open_payload(reset_partial)
    assert unpickle._latin1_bytes.__defaults__ == before
    assert open_payload(b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00abX\x06\x00\x00\x00latin1\x86R.").value == b"ab"


def test_a_raw_ipc_handle_whose_second_byte_is_e_is_not_an_expandable_one():
    """torch before 2.5 writes the raw 64-byte ``cudaIpcMemHandle``: any byte may be ``e``. Only a
    version-2 handle says what follows; read without its version byte, such a raw handle was taken
    for an expandable segment's (shared as a copy, or refused when the copy's said the same)."""
    from fsdp_sync.weights import ipc_memory

    assert not ipc_memory.is_expandable_handle(b"\x00e" + bytes(62))
    assert not ipc_memory.is_expandable_handle(b"\x07e" + bytes(62))
    assert ipc_memory.is_expandable_handle(b"\x02e" + bytes(62))


def test_a_release_that_finds_the_payload_opened_under_the_lock_does_not_revoke_it(monkeypatch):
    """`_revoke` reads the word fresh, then takes the lock: a consumer that took it first and
    opened the payload meanwhile keeps it (its reference is its own). Without the second look
    under the lock the word was overwritten as revoked and the pickling's reference given back
    under a consumer that holds the mapping."""
    import contextlib

    state = handles.empty_shared(4).view(torch.int32)
    state.zero_()
    real = handles.refcount_lock

    @contextlib.contextmanager
    def opened_first(handle):
        state[0] = handles.OPENED          # the consumer won the lock
        with real(handle):
            yield

    monkeypatch.setattr(handles, "refcount_lock", opened_first)
    assert handles._revoke(state) is False and int(state[0]) == handles.OPENED


def test_a_flattened_bucket_one_byte_short_is_refused():
    from fsdp_sync.weights.bucket import TensorMeta, plan_buckets
    from fsdp_sync.wire import flattened_bucket

    (b,) = plan_buckets([TensorMeta.of("w", torch.ones(3, 5))], 1 << 20)
    assert flattened_bucket(torch.zeros(b.nbytes, dtype=torch.uint8), b)["flattened_tensor"].numel() == b.nbytes
    with pytest.raises(ValueError, match=f"a flattened bucket of {b.nbytes} bytes cannot be read from "
                                         f"a buffer of {b.nbytes - 1} bytes"):
        flattened_bucket(torch.zeros(b.nbytes - 1, dtype=torch.uint8), b)


@pytest.mark.parametrize("manager", [b"/tmp/elsewhere/manager.sock", b"/tmp/torch-shm-dir-x/other.sock",
                                     b"/tmp/torch-shm-dir-x/../../run/manager.sock"])
def test_a_shm_manager_outside_a_torch_shm_dir_is_refused(manager):
    """torch's rebuild (``share_again``) connects to the manager a payload names: only a torch
    shm-manager socket is accepted."""
    from fsdp_sync.weights.shm import check_segment

    with pytest.raises(HandleError, match="is not a torch shm-manager socket"):
        check_segment(manager, b"/torch_1_2_3", 4)
