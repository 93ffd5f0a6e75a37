"""What a sync shares by CUDA IPC comes from ordinary CUDA segments, never expandable ones.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (verl's workers, many trainers) torch
shares a block as file descriptors the consumer copies with ``pidfd_getfd``, which needs ptrace
rights over the trainer: Yama's ``ptrace_scope=1`` refuses them to the trainer's child (a reference
engine's worker), container seccomp profiles often deny the call. Nothing of this runs on a CPU:
here torch's allocator settings and its share handle are stood in for (the handle's first two
bytes as torch 2.5 on writes them: version 2, then ``'c'`` for cudaMalloc or ``'e'`` for an
expandable segment), and what is checked is ours: the setting is off while the sync allocates and
shares, back on after (also after a failure), left alone where it was off, and a tensor allocated
before the switch is shared as a copy whose handle is torch's ordinary one. `make test-gpu`
(tests/test_gpu.py) runs the same syncs on a GPU with expandable segments on.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.cli.launch import run_ranks
from fsdp_sync.weights import handles, ipc_memory, unpickle
from fsdp_sync.weights.handles import make_payloads, open_payload


class FakeAllocator:
    """torch's allocator settings as a string, and each change made to them."""

    def __init__(self, settings: str = "expandable_segments:True") -> None:
        self.settings, self.calls = settings, []

    def set(self, value: str) -> None:
        self.calls.append(value)
        self.settings = value

    def install(self, monkeypatch, known: bool = True) -> "FakeAllocator":
        """``known``: torch reads its settings back (2.13); else, as torch 2.11, only what
        fsdp_sync set is known."""
        monkeypatch.setattr(ipc_memory, "cuda_in_use", lambda: True)
        monkeypatch.setattr(ipc_memory, "set_allocator_settings", self.set)
        monkeypatch.setattr(ipc_memory, "expandable_segments_state",
                            lambda: self.on if known or self.calls else None)
        return self

    @property
    def on(self) -> bool:
        return self.settings == "expandable_segments:True"


def test_shareable_turns_expandable_segments_off_inside_and_back_on(monkeypatch):
    alloc = FakeAllocator().install(monkeypatch)
    with ipc_memory.shareable() as switched:
        assert switched and not alloc.on
        with ipc_memory.shareable("cuda:0") as inner:       # nested: the outer one switched
            assert not inner and not alloc.on
        assert not alloc.on
    assert alloc.on and alloc.calls == ["expandable_segments:False", "expandable_segments:True"]

    with pytest.raises(ValueError, match="boom"):           # restored after a failure too
        with ipc_memory.shareable():
            assert not alloc.on
            raise ValueError("boom")
    assert alloc.on and len(alloc.calls) == 4

    with ipc_memory.shareable("cpu") as switched:           # a CPU sync shares no CUDA memory
        assert not switched and alloc.on
    assert len(alloc.calls) == 4


def test_shareable_leaves_a_setting_that_was_off_and_a_process_without_cuda(monkeypatch):
    alloc = FakeAllocator("expandable_segments:False,max_split_size_mb:512").install(monkeypatch)
    with ipc_memory.shareable() as switched:
        assert not switched
    assert alloc.calls == []
    alloc = FakeAllocator().install(monkeypatch)
    monkeypatch.setattr(ipc_memory, "cuda_in_use", lambda: False)   # nothing allocated on CUDA yet
    with ipc_memory.shareable() as switched:
        assert not switched
    assert alloc.calls == []


def test_shareable_in_two_threads_restores_when_the_last_one_leaves(monkeypatch):
    """verl's checkpoint engine packs on a thread of its own: the first context out must not turn
    expandable segments back on under a thread still allocating what it shares."""
    alloc = FakeAllocator().install(monkeypatch)
    entered, leave = threading.Event(), threading.Event()
    seen = []

    def other():
        with ipc_memory.shareable():
            entered.set()
            leave.wait(10)
            seen.append(alloc.on)

    t = threading.Thread(target=other)
    with ipc_memory.shareable():
        t.start()
        assert entered.wait(10)
    assert not alloc.on                   # the first one left; the other thread is still inside
    leave.set()
    t.join(10)
    assert seen == [False] and alloc.on
    assert alloc.calls == ["expandable_segments:False", "expandable_segments:True"]


def test_empty_shared_allocates_cuda_buffers_with_expandable_segments_off(monkeypatch):
    alloc = FakeAllocator().install(monkeypatch)
    at_alloc = []
    real_empty = torch.empty

    def empty(*args, **kw):                      # no CUDA here: a CPU tensor where it would be
        if str(kw.get("device")) == "cuda:0":
            at_alloc.append(alloc.settings)
            kw["device"] = "cpu"
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    buf = handles.empty_shared(256, "cuda:0")
    assert buf.numel() == 256 and at_alloc == ["expandable_segments:False"] and alloc.on


def test_without_torchs_getter_only_what_fsdp_sync_set_is_known(monkeypatch):
    """torch 2.11 (the GPU machine's) sets the allocator's settings but cannot read them back.
    The environment saying on is not taken for on: verl switches them off through torch around
    its updates, and turning them back on after a sync would undo that."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda value: None, raising=False)
    monkeypatch.setattr(ipc_memory, "_last_set", None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    assert ipc_memory.expandable_segments_state() is None
    # the environment's word, which SGLang's own switch reads
    assert ipc_memory.says_on(ipc_memory.allocator_settings())
    ipc_memory.set_allocator_settings("expandable_segments:False")
    assert ipc_memory.expandable_segments_state() is False
    assert ipc_memory.allocator_settings() == "max_split_size_mb:512,expandable_segments:False"
    ipc_memory.set_allocator_settings("expandable_segments:True")
    assert ipc_memory.expandable_segments_state() is True


def test_unknown_state_switches_nothing_and_a_forced_copy_leaves_them_off(monkeypatch, caplog):
    alloc = FakeAllocator().install(monkeypatch, known=False)
    with ipc_memory.shareable() as switched:               # on, per the environment: not trusted
        assert not switched
    assert alloc.calls == []
    monkeypatch.setattr(ipc_memory, "_left_off", False)
    with ipc_memory.forced_off():                          # a tensor was found in one
        assert not alloc.on
    assert alloc.calls == ["expandable_segments:False"]    # left off: torch's default
    assert "expandable segments turned off for this process" in caplog.text

    alloc = FakeAllocator().install(monkeypatch)           # known on: back on after
    with ipc_memory.forced_off():
        assert not alloc.on
    assert alloc.on and alloc.calls == ["expandable_segments:False", "expandable_segments:True"]
    alloc = FakeAllocator().install(monkeypatch)
    with ipc_memory.shareable():                           # inside a switch: the switch restores
        with ipc_memory.forced_off():
            pass
        assert not alloc.on
    assert alloc.on and alloc.calls[-1] == "expandable_segments:True"


def test_handle_kinds_as_torch_writes_them():
    assert ipc_memory.is_expandable_handle(b"\x02e" + bytes(40))
    assert not ipc_memory.is_expandable_handle(b"\x02c" + bytes(64))
    assert not ipc_memory.is_expandable_handle(bytes(range(64)))        # torch before 2.5: raw
    assert not ipc_memory.is_expandable_handle(None)


# --------------------------------------------------------------------------- a tensor allocated before

_UUID = "GPU-6f1d2a3b-0000-4c5d-8e9f-0123456789ab"


def _expandable(monkeypatch, marked: torch.Tensor, *, refuse: bool = False) -> list:
    """torch's ``reduce_tensor`` answers for ``marked`` as for a CUDA tensor in an expandable
    segment (``refuse``: as a torch built to refuse sharing one does); returns the IPC counters
    torch is asked to give back."""
    real = red.reduce_tensor
    ptr = marked.data_ptr()

    def reduce(t):
        if t.data_ptr() != ptr:
            return real(t)
        if refuse:
            raise RuntimeError("Tensors allocated with expandable_segments:True cannot be shared "
                               "between processes. Consider using expandable_segments:False in "
                               "data loading workers via torch.cuda.memory._set_allocator_settings"
                               "('expandable_segments:False')")
        return (red.rebuild_cuda_tensor,
                (type(t), t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0,
                 b"\x02e" + bytes(30), 4000, 0, False, b"/torch_4242_1234567890", 7, bytes(64), True))

    released: list = []
    FakeAllocator().install(monkeypatch)          # (the copy is made with them switched off)
    monkeypatch.setattr(red, "reduce_tensor", reduce)
    monkeypatch.setattr(handles, "device_uuid", lambda index: _UUID)
    monkeypatch.setattr(unpickle, "rebuild_cuda_tensor_by_uuid", lambda *args: pytest.fail("opened"))
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: released.append((handle, offset))))
    return released


@pytest.mark.parametrize("refuse", [False, True], ids=["shared-as-e", "torch-refuses"])
def test_a_tensor_of_an_expandable_segment_is_shared_as_a_copy(monkeypatch, refuse):
    """A tensor the trainer allocated before the switch (a parameter a one-rank per-tensor sync
    hands over as it is, a caller's own tensor): its share is given back and a copy in shareable
    memory goes instead, the same values, held until the payloads are released."""
    marked = handles.empty_shared(4000).view(torch.float32)     # shared as it is, not copied...
    marked.copy_(torch.arange(1000, dtype=torch.float32))
    released = _expandable(monkeypatch, marked, refuse=refuse)
    with make_payloads({"w": marked, "b": torch.ones(3)}, 2) as ps:
        assert not any(b"\x02e" in p for p in ps.payloads)
        # ...but for this: one copy for both ranks (beside the CPU tensor's, one per rank)
        assert sum(k.data_ptr() != marked.data_ptr() and k.numel() == 1000 for k in ps._keep) == 1
        for rank, p in enumerate(ps.payloads):
            got = open_payload(p, rank)
            assert torch.equal(got.value["w"], marked) and got.value["w"].data_ptr() != marked.data_ptr()
            got.ack()
    # the shares that were made and not sent (one per rank) were given back
    assert released == ([] if refuse else [(b"/torch_4242_1234567890", 7)] * 2)


def test_a_reused_buffer_shared_as_a_copy_is_allocated_again_not_copied_every_bucket(monkeypatch):
    """A sync's reused buffer that came from an expandable segment (allocated where the switch
    could not tell they were on: torch 2.11 with them on in the environment) was copied to be
    shared for every bucket, and an engine keeps each bucket's buffer open for the update: the
    copies would pile up. The buffer is let go and allocated again after its first copy."""
    from fsdp_sync.transport.buffers import BufferPool, ReusedBuffer

    cpu = torch.device("cpu")
    for make in (lambda: ReusedBuffer(4000, cpu), lambda: BufferPool(4000, cpu)):
        buffers = make()
        take = buffers.take
        give = (lambda v: buffers.give_back()) if isinstance(buffers, ReusedBuffer) else \
            (lambda v: buffers.give_back([v]))
        first = take(4000)
        _expandable(monkeypatch, first)
        with make_payloads(first.view(torch.float32), 1) as ps:
            got = open_payload(ps.payloads[0], 0)
            assert got.value.data_ptr() != first.data_ptr()          # shared as a copy
            got.ack()
        give(first)
        second = take(4000)
        assert second.data_ptr() != first.data_ptr()                  # allocated again
        with make_payloads(second.view(torch.float32), 1) as ps:     # shared as it is
            got = open_payload(ps.payloads[0], 0)
            assert got.value.data_ptr() == second.data_ptr()
            got.ack()
        give(second)
        assert take(4000).data_ptr() == second.data_ptr()             # and reused from then on
        monkeypatch.undo()


def test_a_copy_that_is_still_expandable_is_refused_by_name(monkeypatch):
    """Should torch hand out an expandable block with the setting off, the payload is refused
    with what to do, not sent for a consumer that cannot open it."""
    def reduce(t):
        return (red.rebuild_cuda_tensor,
                (type(t), t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0,
                 b"\x02e" + bytes(30), 4000, 0, False, b"/torch_4242_1234567890", 7, bytes(64), True))

    FakeAllocator().install(monkeypatch)
    monkeypatch.setattr(red, "reduce_tensor", reduce)
    monkeypatch.setattr(handles, "device_uuid", lambda index: _UUID)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: None))
    with pytest.raises(handles.HandleError, match="expandable_segments:False"):
        make_payloads(torch.ones(4), 1)


# --------------------------------------------------------------------------- the manager and send

def _switch_seen(rank, world, disk_dir):
    """One trainer rank syncs into a reference engine with torch's allocator settings stood in
    for (CUDA "in use", expandable segments on): which setting each payload was made under, and
    the setting after each sync, per method; and `TensorTransport.send`'s loop (verl's)."""
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology
    from fsdp_sync.transport import tensor as tensor_transport

    torch.set_num_threads(1)
    state = {"settings": "expandable_segments:True"}
    ipc_memory.cuda_in_use = lambda: True
    ipc_memory.expandable_segments_state = lambda: state["settings"] == "expandable_segments:True"
    ipc_memory.set_allocator_settings = lambda v: state.update(settings=v)
    made = []
    real_make = handles.make_payloads

    def recording(*args, **kw):
        made.append(state["settings"])
        return real_make(*args, **kw)

    handles.make_payloads = recording
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    mesh = make_mesh(1, 1)
    out = {}
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as engine:
        # disk first: a disaggregated method leaves the engine's memory to it (the colocated
        # ones release it on exit)
        for name, kw in {"disk": dict(method="disk", disk_dir=disk_dir),
                         "flattened": dict(strategy="flattened", layout="full"),
                         "engine": dict(layout="engine"), "per_tensor": dict(strategy="per_tensor")}.items():
            made.clear()
            m = FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(
                dtype=torch.float32, bucket_bytes=64 << 10, verify="full", **kw))
            with m:       # verify="full": every tensor the engine serves equals the trainer's
                pass
            m.close()
            out[name] = {"made": sorted(set(made)), "after": state["settings"],
                         "extra": m.stats.extra.get("expandable_segments"),
                         "verified": m.stats.extra.get("verify_tensors", 0)}

        def calls():
            out["send_during"] = state["settings"]
            yield from ()

        stats = tensor_transport.TensorTransport().send(calls(), topo=SyncTopology.from_mesh(mesh),
                                                        engine=engine)
        out["send"] = {"after": state["settings"], "extra": stats.extra.get("expandable_segments")}
    return out


@pytest.mark.timeout(240)
def test_every_sync_that_shares_by_cuda_ipc_allocates_with_expandable_segments_off(tmp_path):
    (r,) = run_ranks(_switch_seen, 1, str(tmp_path), timeout_s=220)
    off, on = "expandable_segments:False", "expandable_segments:True"
    for name in ("flattened", "engine", "per_tensor"):
        assert r[name]["made"] == [off], (name, r[name])      # every payload made while off
        assert r[name]["after"] == on and r[name]["extra"], (name, r[name])
        assert r[name]["verified"] > 0, (name, r[name])
    assert r["disk"]["made"] == [] and r["disk"]["after"] == on and r["disk"]["extra"] is None
    assert r["send_during"] == off and r["send"] == {"after": on, "extra": r["send"]["extra"]}
    assert r["send"]["extra"]
