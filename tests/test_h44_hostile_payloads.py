"""The payload allow-list against hostile pickles, and what a failed `make_payloads` gives back.

A receiver (`handles.open_payload`) admits exact names only and checks every argument of torch's
rebuild functions. Here, opcode by opcode, what a crafted payload could try: INST/OBJ/NEWOBJ on
the stand-ins, an extension code, STACK_GLOBAL with names computed by allowed calls, BUILD on
every allowed object and on a rebuilt tensor (``Tensor.__setstate__``'s ``set_``), a count
smuggled into ``bytes`` as a one-element tensor, a typed storage's element count passed as bytes.
Each is refused and nothing changed; genuine payloads written at protocols 0-2 (which name
builtins as Python 2's ``__builtin__``) open. And a `make_payloads` whose pickling fails for one
rank gives back every shared-memory reference and CUDA IPC counter it had taken: nothing stays in
/dev/shm until the producer exits.
"""

from __future__ import annotations

import collections
import copyreg
import os
import pickle
import threading
import types

import pytest
import torch
from torch.multiprocessing import reductions as red

from fsdp_sync.weights import handles, shm, state_words, unpickle
from fsdp_sync.weights.handles import HandleError, make_payloads, open_payload

from _util import own_segments, own_segments_left

P5 = b"\x80\x05"


def _s(text: str) -> bytes:                   # SHORT_BINUNICODE
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _g(module: str, name: str) -> bytes:       # STACK_GLOBAL
    return _s(module) + _s(name) + b"\x93"


class _Call:
    """Pickles as ``fn(*args)`` (with ``state``: then BUILD): allowed globals only."""

    def __init__(self, fn, *args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _dump(obj) -> bytes:
    """``obj`` as our pickler writes it (CPU storages by shared-memory file)."""
    keep, shared, counters = [], [], []
    return handles._dump(obj, keep, shared, counters)


def _refusal(data: bytes, **kw) -> str:
    """The refusal's text (the exception itself is not kept: its frames would hold storages)."""
    try:
        got = open_payload(data, **kw)
    except HandleError as exc:
        return str(exc)
    raise AssertionError(f"opened: {got.value!r:.80}")


def _segment() -> torch.Tensor:
    """A 64-byte shared-memory buffer of this process: int64 words 10**6, then 100 (not a
    fixture: pytest holds a fixture's value through the teardown's leak check)."""
    buf = handles.empty_shared(64)
    buf.view(torch.int64)[:2] = torch.tensor([10**6, 100])
    return buf


@pytest.mark.parametrize("fn", [bytes, bytearray])
def test_a_count_smuggled_as_a_one_element_tensor_is_refused(fn):
    """``bytes(10**12)`` is refused as a count; a rebuilt int64 scalar tensor holding 10**6 is a
    count too (``__index__``): before, ``bytes(t)`` allocated what the segment's bytes said."""
    segment = _segment()
    scalar = _Call(red.rebuild_tensor, torch.Tensor,
                   _Call(red.rebuild_typed_storage, segment.untyped_storage(), torch.int64),
                   (0, (), (), False))
    assert open_payload(_dump([scalar])).value[0].item() == 10**6     # the tensor itself opens
    assert "builds " + fn.__name__ + " from a count; refused" in _refusal(_dump(_Call(fn, scalar)))
    assert open_payload(_dump(_Call(fn, [1, 2]))).value == fn(b"\x01\x02")   # from a list: fine


@pytest.mark.parametrize("share_again", [False, True])
def test_a_typed_storage_handle_is_checked_in_bytes_not_elements(share_again):
    """torch's ``rebuild_storage_filename`` with a dtype counts elements and maps size * itemsize
    bytes. Checked as bytes before: a 64-byte segment named as 64 complex128 elements passed the
    size check, and torch's mapping (``share_again``) grew the producer's segment to 1024 bytes
    (ftruncate), handing over a storage of zeros past its data."""
    segment = _segment()
    manager, handle, size = segment.untyped_storage()._share_filename_cpu_()
    path = shm.segment_path(handle)
    before = os.stat(path).st_size
    data = _dump(_Call(red.rebuild_storage_filename, torch.UntypedStorage, manager, handle, size,
                       torch.complex128))
    assert (f"asks for {size * 16} bytes of segment {handle.decode()}, which holds {size}: a forged "
            f"size; refused") in _refusal(data, share_again=share_again)
    assert os.stat(path).st_size == before
    for bad in (-8, -1):        # a negative count, by itself or times an itemsize, names itself
        for dtype in (None, torch.int64):
            args = (torch.UntypedStorage, manager, handle, bad) + ((dtype,) if dtype else ())
            assert f"has size {bad * (dtype.itemsize if dtype else 1)}; refused" in _refusal(
                _dump(_Call(red.rebuild_storage_filename, *args)), share_again=share_again)
    # the element count a genuine typed handle carries opens
    ok = _dump(_Call(red.rebuild_storage_filename, torch.UntypedStorage, manager, handle, size // 8,
                     torch.int64))
    assert bytes(open_payload(ok).value._untyped_storage.tolist()) == bytes(segment.tolist())


_OLD = [{1, 2}, frozenset([3]), bytearray(b"ab"), bytearray(), b"", slice(1, None, 2), complex(1, 2),
        collections.OrderedDict(a=1), types.SimpleNamespace(x=[b""]), torch.Size([2, 3]), torch.bfloat16]


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_genuine_payloads_at_protocols_0_to_2_open(protocol):
    """Protocols 0-2 name builtins as ``__builtin__`` (a set, an empty bytes, a bytearray): the
    same objects, accepted as Python's own unpickler maps them; other Python 2 names stay refused."""
    got = open_payload(pickle.dumps(_OLD, protocol=protocol)).value
    assert got == _OLD and [type(v) for v in got] == [type(v) for v in _OLD]
    for name in ("eval", "getattr", "reduce", "intern", "xrange", "__import__"):
        data = f"c__builtin__\n{name}\n(tR.".encode()
        assert f"payload holds __builtin__.{name}, which is not on the allow-list" in _refusal(data)


@pytest.mark.parametrize("protocol", [0, 1])
def test_a_cuda_ipc_payload_at_protocols_0_and_1_fails_only_for_want_of_cuda(protocol):
    """(test_cuda_payload checks protocols 2 and 5.)"""
    if torch.cuda.is_available():
        pytest.skip("emulates a CUDA payload where CUDA is absent")
    from test_cuda_payload import UUID, _payload

    assert f"payload names CUDA device '{UUID}', which this process cannot see" in _refusal(
        _payload(protocol))


def _opcodes() -> dict[str, bytes]:
    return {
        # INST and OBJ instantiate what find_class (or the stack) gives: refused names, stand-ins
        "inst_system": b"(S'true'\nios\nsystem\n.",
        "inst_getattr": b"(cbuiltins\ndict\nS'keys'\nibuiltins\ngetattr\n.",
        "obj_tensor_standin": P5 + b"(" + _g("torch", "Tensor") + _s("x") + b"o.",
        "newobj_standin": P5 + _g("torch", "Tensor") + b")\x81.",
        "newobj_ex_standin": P5 + _g("torch.nn.parameter", "Parameter") + b")}\x92.",
        # an extension code resolves through find_class too
        "ext1_system": P5 + b"\x82\xf0" + _s("true") + b"\x85R.",
        # names computed by allowed calls: str("builtins"), str("eval"), then STACK_GLOBAL
        "computed_names": (P5 + _g("builtins", "str") + b"\x94" + _s("builtins") + b"\x85R"
                           + b"h\x00" + _s("eval") + b"\x85R\x93" + _s("1") + b"\x85R."),
        "stack_global_not_str": P5 + b"K\x01K\x02\x93.",
        # a stand-in fetched back from the memo into the storage-class slot of a tensor rebuild
        "memo_standin_as_storage": (P5 + _g("torch", "Tensor") + b"\x94" + _g(unpickle.RED, "rebuild_tensor")
                                    + b"h\x00h\x00(K\x00)))\x89t\x87R."),
        "memo_missing": P5 + b"h\x07.",
        "persistent_id": P5 + _s("x") + b"Q.",
        "nested_global": b"cbuiltins\n__builtins__\n.",
        "reductions_module_global": b"ctorch.multiprocessing.reductions\nstorage_from_cache\n.",
        "protocol0_codecs_other": b"c_codecs\nencode\n(Vx\nVrot13\ntR.",
    }


def test_opcode_tricks_are_refused_and_run_nothing(tmp_path, monkeypatch):
    copyreg.add_extension("os", "system", 240)
    try:
        for kind, data in _opcodes().items():
            with pytest.raises(HandleError):
                open_payload(data)
    finally:
        copyreg.remove_extension("os", "system", 240)


@pytest.mark.parametrize("state", ["dict", "slots", "call"])
def test_build_on_every_allowed_object_is_refused_and_changes_nothing(state):
    """BUILD on what find_class hands out (classes, stand-ins, wrappers, dtypes): no attribute of
    anything shared with the rest of the process can be set."""
    build = {"dict": b"}" + _s("zz_h44") + b"K\x01sb.",
             "slots": b"N}" + _s("zz_h44") + b"K\x01s\x86b.",
             "call": b"N}" + _s("__call__") + _g("builtins", "dict") + b"s\x86b."}[state]
    names = [k for k, v in unpickle._ALLOWED.items() if not isinstance(v, torch.dtype)] + [("torch", "float32")]
    for module, name in names:
        with pytest.raises(HandleError):
            open_payload(P5 + _g(module, name) + build)
    for obj in list(unpickle._ALLOWED.values()) + [torch.Tensor, torch.UntypedStorage, torch.TypedStorage]:
        assert not hasattr(obj, "zz_h44"), obj


@pytest.mark.parametrize("view", [(0, (10**9,), (1,)), (60, (8,), (1,)), (0, (4,), (10**12,)),
                                  (-1, (4,), (1,)), (0, (4,), (-1,))])
def test_build_cannot_move_a_rebuilt_tensor_outside_its_storage(view):
    """``Tensor.__setstate__`` with four items is ``set_(storage, offset, size, stride)``: the view
    checks of the rebuild do not see it, and the storage (a shared segment: not resizable) must
    refuse anything past its 64 bytes rather than grow."""
    segment = _segment()
    typed = _Call(red.rebuild_typed_storage, segment.untyped_storage(), torch.uint8)
    data = _dump(_Call(red.rebuild_tensor, torch.Tensor, typed, (0, (8,), (1,), False),
                       state=(typed, *view)))
    assert "cannot open payload" in _refusal(data)
    assert segment.untyped_storage().nbytes() == 64


# --------------------------------------------------------------------------- failed make_payloads

@pytest.mark.parametrize("tagged", [True, False])
@pytest.mark.parametrize("pooled", [False, True], ids=["own-words", "sync-pool"])
def test_a_make_payloads_that_fails_leaves_no_segment(tagged, pooled):
    """A value pickling cannot write (a lock, a lambda) fails after the tensors before it were
    shared: each share raised a segment's count (and the copy of a tensor not in shared memory
    is a segment of its own), never given back: the segment stayed until the producer exited."""
    before = own_segments()
    with state_words.pooled() if pooled else _nothing():
        for obj in ({"a": torch.ones(4), "b": threading.Lock()}, [torch.ones(4), lambda: 0],
                    {"a": handles.empty_shared(16), "b": threading.Lock()}):
            with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
                make_payloads(obj, 2, tagged=tagged)
        del obj
    assert own_segments_left(before) == 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_make_payloads_that_fails_for_one_rank_gives_back_every_ranks_cuda_counters(monkeypatch):
    """Rank 0's payload was made (a CUDA share's counter, a state word), rank 1's pickling fails
    after its CUDA share: both counters are released (torch parks the producer's block until
    each is), every state word's segment goes."""
    marked = handles.empty_shared(4000).view(torch.float32)
    offsets = iter(range(100, 200))
    real, ptr = red.reduce_tensor, marked.data_ptr()

    def reduce(t):
        if t.data_ptr() != ptr:
            return real(t)
        return (red.rebuild_cuda_tensor,
                (type(t), t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0, bytes(range(64)),
                 4000, 0, False, b"/torch_4242_1234567890", next(offsets), bytes(64), True))

    released: list = []
    monkeypatch.setattr(red, "reduce_tensor", reduce)
    monkeypatch.setattr(handles, "device_uuid", lambda index: "GPU-0")
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: released.append(offset)))
    real_dump, calls = handles._dump, []

    def dump(wire, *args, **kw):
        calls.append(1)
        return real_dump(dict(wire, zz=threading.Lock()) if len(calls) == 2 else wire, *args, **kw)

    monkeypatch.setattr(handles, "_dump", dump)
    before = own_segments()
    with pytest.raises(TypeError, match="lock"):
        make_payloads({"flattened_tensor": marked, "metadata": []}, 2)
    assert len(calls) == 2 and released == [100, 101]
    assert own_segments_left(before) == 0


# --------------------------------------------------------------------------- mutation pass (H44)

@pytest.mark.parametrize("dtype, fits", [(torch.uint8, 64), (torch.int16, 32), (torch.float64, 8)])
def test_a_view_one_element_past_its_storage_is_refused_by_the_view_check(dtype, fits):
    """The bound is exact: the last byte of the storage is in, the next is out (a view reaching one
    byte past a 64-byte segment was accepted by a mutant ``end > nbytes + 1``, refused only by
    torch's resize, naming nothing). A CUDA handle's view is checked the same way."""
    segment = _segment()
    typed = _Call(red.rebuild_typed_storage, segment.untyped_storage(), dtype)
    ok = open_payload(_dump(_Call(red.rebuild_tensor, torch.Tensor, typed, (0, (fits,), (1,), False))))
    assert ok.value.numel() == fits
    for meta in ((0, (fits + 1,), (1,), False), (1, (fits,), (1,), False)):
        assert (f"reaches byte {64 + dtype.itemsize} of a 64-byte storage: it points outside its buffer"
                in _refusal(_dump(_Call(red.rebuild_tensor, torch.Tensor, typed, meta))))
    if torch.cuda.is_available():
        return
    from test_cuda_payload import _payload

    n = 4000 // dtype.itemsize
    for size, offset in (((n + 1,), 0), ((n,), 1)):
        assert f"reaches byte {4000 + dtype.itemsize} of a 4000-byte storage" in _refusal(
            _payload(5, size=torch.Size(size), stride=(1,), offset=offset, dtype=dtype))
    assert "which this process cannot see" in _refusal(_payload(5, size=torch.Size((n,)), stride=(1,),
                                                                dtype=dtype))


class _TwoRanks:
    """``torch.distributed`` as group rank 0 of two sees it, the other rank answering as told:
    the host key, the scatter (its payload recorded), the open-failure flag and texts."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, error: str | None):
        self.error, self.sent = error, None

    def get_world_size(self, group):
        return 2

    def get_rank(self, group):
        return 0

    def get_global_rank(self, group, rank):
        return rank

    def all_gather_object(self, out, obj, group=None):   # the host keys, then the open errors
        out[:] = [obj, obj if self.sent is None else self.error]

    def scatter_object_list(self, out, inputs, src=0, group=None):
        self.sent, out[0] = inputs[1], inputs[0]

    def all_reduce(self, flag, op=None, group=None):
        both = (int(flag.item()), int(self.error is not None))
        flag.fill_(max(both) if op == self.ReduceOp.MAX else min(both) if op == self.ReduceOp.MIN else sum(both))

    def barrier(self, group=None):
        pass


@pytest.mark.parametrize("error", ["OSError: rank 1 cannot reach the shm manager", None])
def test_host_buffers_a_rank_could_not_open_leave_no_segment(monkeypatch, error):
    """Group rank 0 made the buffers and a payload for rank 1, which could not open it: every
    rank gathers instead, and rank 0 gives back the reference that payload held (the caller
    names it unopened: an untagged payload cannot tell), so the segments go with rank 0's
    buffers rather than stay in /dev/shm until rank 0 exits. Where rank 1 opened them, rank 0
    keeps the buffers and gives nothing back twice."""
    from fsdp_sync.weights import hostbuf

    fake = _TwoRanks(error)
    monkeypatch.setattr(hostbuf, "dist", fake)
    monkeypatch.setattr(hostbuf, "cpu_group", lambda group: group)
    before = own_segments()
    if error is None:       # rank 1 opens (here, as torch's cache hands this process its own)
        real = fake.scatter_object_list

        def scatter_and_open(out, inputs, src=0, group=None):
            real(out, inputs, src, group)
            fake.opened = open_payload(fake.sent, share_again=True).value

        fake.scatter_object_list = scatter_and_open
    host = hostbuf.HostShared.create("group", 2, 4096)
    if error is not None:
        assert host is None
    else:
        assert [b.numel() for b in host.bufs] == [4096, 4096]
        assert [b.data_ptr() for b in fake.opened] == [b.data_ptr() for b in host.bufs]
        del fake.opened
        assert own_segments() - before == 2          # both buffers, while rank 0 holds them
        del host
    assert own_segments_left(before) == 0


def test_empty_tensors_of_any_strides_open():
    """A view with no elements reads nothing, whatever its strides say: ``torch.empty(5, 0).t()``
    (strides (1, 1) over a 0-byte storage) is as genuine as ``torch.empty(0)``. Only views with
    elements are bounded (a mutant bounding every view refused these)."""
    empties = {"t": torch.empty(5, 0).t(), "p": torch.empty(2, 0, 4).permute(2, 0, 1),
               "row": torch.arange(8.0).view(2, 4)[:, 4:], "tail": torch.arange(8.0)[8:]}
    with make_payloads(empties, 1) as ps:
        got = open_payload(ps.payloads[0], 0)
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.value.items()} == \
            {k: (tuple(v.shape), v.dtype) for k, v in empties.items()}
        got.ack()


@pytest.mark.parametrize("where", ["tuple key", "tuple in a set", "list in a slice", "nested key",
                                   "value then key"])
def test_a_cuda_tensor_inside_a_key_a_set_or_a_slice_is_refused_however_deep(monkeypatch, where):
    """`cuda_later.where` refused a CUDA tensor as a dict key, a set member or a slice part, but
    walked a tuple found there as if it were a slot: a tensor in ``{(t,): 1}`` was opened, and the
    value handed over kept the inert stand-in in its place (`put` does not rebuild keys), as did a
    tuple met first as a value, then as a key. Refused before anything opens now."""
    if torch.cuda.is_available():
        pytest.skip("emulates a CUDA payload where CUDA is absent")
    from test_h23_cuda_refused_unopened import _recorded

    calls: list = []
    monkeypatch.setattr(unpickle, "rebuild_cuda_tensor_by_uuid", lambda *a: calls.append(a) or torch.zeros(3))
    cuda = _recorded()
    both = (cuda,)
    obj = {"tuple key": {"x": {(cuda,): 1}}, "tuple in a set": {"x": {(1, cuda)}},
           "list in a slice": {"x": slice([cuda])}, "nested key": {"x": {((1, (cuda,)),): 1}},
           "value then key": {"a": both, "b": {both: 1}}}[where]
    with make_payloads(obj, 1) as ps:
        assert "a CUDA tensor where no tensor belongs" in _refusal(ps.payloads[0], rank=0)
        assert calls == []
        ps.release(require_ack=False)
    # the same tuple twice as a value still opens, one tensor in both places
    with make_payloads({"a": both, "b": [both]}, 1) as ps:
        got = open_payload(ps.payloads[0], 0)
        assert len(calls) == 1 and got.value["a"] is got.value["b"][0] and type(got.value["a"][0]) is torch.Tensor
        got.ack()


@pytest.mark.parametrize("share_again", [False, True])
def test_a_segment_mapped_as_zero_bytes_cannot_be_grown_by_build(share_again):
    """A handle naming a genuine segment with size 0 was mapped (by file) as torch's resizable
    empty storage: a BUILD on an empty tensor over it (``set_``) then grew it to 300 MB from a
    payload of a few hundred bytes, the bomb `rebuild_storage_empty` was closed against. Refused as
    torch refuses growing any mapped storage."""
    segment = _segment()
    manager, handle, _ = segment.untyped_storage()._share_filename_cpu_()
    typed = _Call(red.rebuild_typed_storage,
                  _Call(red.rebuild_storage_filename, torch.UntypedStorage, manager, handle, 0), torch.uint8)
    grow = _dump(_Call(red.rebuild_tensor, torch.Tensor, typed, (0, (0,), (1,), False),
                       state=(typed, 0, (300 << 20,), (1,))))
    shm.add_reference(handle, +1)        # the reference a payload's pickling takes, opening gives back
    assert "Trying to resize storage that is not resizable" in _refusal(grow, share_again=share_again)
    empty = _dump(_Call(red.rebuild_tensor, torch.Tensor, typed, (0, (0,), (1,), False)))
    shm.add_reference(handle, +1)
    assert open_payload(empty, share_again=share_again).value.numel() == 0
    assert os.path.exists(shm.segment_path(handle))


def test_empty_tensors_cost_no_segment_and_no_cuda_counter(monkeypatch):
    """An empty tensor shares nothing: no shared-memory segment is made for it (neither a copy nor
    its own storage moved into shared memory: mutants doing either survived), and an empty CUDA
    storage, which torch shares with no IPC handle and no reference counter (None), leaves no
    counter for the release to give back (torch's release of a None handle would raise)."""
    before = own_segments()
    empties = {"e": torch.empty(0), "f": torch.empty(0, 3, dtype=torch.bfloat16)}
    with make_payloads(empties, 1, tagged=False) as ps:
        assert own_segments() == before
        got = open_payload(ps.payloads[0])
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.value.items()} == \
            {k: (tuple(v.shape), v.dtype) for k, v in empties.items()}
        del got
        ps.release(require_ack=False, unopened=[0])
    empty_cuda = torch.empty(0)
    real = red.reduce_tensor

    def reduce(t):              # torch's reduction of an empty CUDA tensor, on a CPU machine
        if t.numel():            # (the state words)
            return real(t)
        return (red.rebuild_cuda_tensor, (type(t), t.size(), t.stride(), 0, torch.storage.TypedStorage,
                                          t.dtype, 0, None, 0, 0, False, None, None, None, False))

    released: list = []
    monkeypatch.setattr(red, "reduce_tensor", reduce)
    monkeypatch.setattr(handles, "device_uuid", lambda index: "GPU-0")
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: released.append((handle, offset))))
    ps = make_payloads({"w": empty_cuda}, 2)
    assert all(b"rebuild_cuda_tensor" in p for p in ps.payloads) and ps._counters == [[], []]
    ps.release(require_ack=False)
    assert released == []


def test_a_tensor_not_in_shared_memory_is_copied_once_for_every_rank():
    """A CPU tensor outside shared memory is copied into a segment to be shared (never moved). The
    copy was made once per consuming rank: SGLang's per-tensor update over HTTP (one payload of
    the whole list per TP rank) held TP copies of every tensor in /dev/shm. One copy per source
    view now, as for CUDA; each rank opens it bit for bit, and the release frees it."""
    weight = torch.randn(64, 33)
    named = [("w", weight), ("b", torch.arange(7, dtype=torch.int32)), ("w_again", weight),
             ("row", weight[3])]
    before = own_segments()
    ps = make_payloads(named, 4, tagged=False)
    assert own_segments() - before == 3                  # w (twice named), b, and the row view
    for payload in ps.payloads:
        got = open_payload(payload).value
        assert [n for n, _ in got] == [n for n, _ in named]
        assert all(torch.equal(g, t) for (_, g), (_, t) in zip(got, named))
        assert got[0][1].data_ptr() == got[2][1].data_ptr()
        del got
    ps.release(require_ack=False)
    assert own_segments_left(before) == 0


def test_a_refused_payload_with_an_empty_tensor_gives_back_its_references():
    """A payload for another rank is refused and gives back what its unpickling took, storage by
    storage. An empty tensor's storage (one byte that no view reads, so that it cannot grow) holds
    no segment: giving back for it called torch's ``_share_filename_cpu_``, which moved it into a
    new segment of its own, counted once more and never freed (one leaked segment per empty
    tensor of each refused payload, in the consumer, until it exited)."""
    before = own_segments()
    obj = {"w": torch.arange(6.0), "e": torch.empty(0), "t": torch.empty(5, 0).t()}
    ps = make_payloads(obj, 2)
    assert "payload for infer-TP rank 0 (of 2) opened by rank 1" in _refusal(ps.payloads[0], rank=1)
    for rank in (0, 1):
        got = open_payload(ps.payloads[rank], rank)
        assert torch.equal(got.value["w"], obj["w"]) and got.value["e"].numel() == 0
        got.ack()
    ps.release()
    del got
    assert own_segments_left(before) == 0


def test_host_buffers_are_written_between_the_groups_barriers(monkeypatch):
    """`HostShared.fill`: a rank writes only once every rank is done reading the previous bytes
    (a barrier first, unless the caller just synchronized), and nobody reads before every rank's
    bytes are in (a barrier after). Dropping the first barrier survived every test (a race no
    bit-exactness test on two ranks catches reliably); the order is checked here."""
    from fsdp_sync.weights import hostbuf

    calls: list = []
    # the one after the write is the all-reduce of a failure flag that replaced its barrier
    # (a rank whose write raised tells its peers there: test_h71_hostbuf.py)
    monkeypatch.setattr(hostbuf, "dist", types.SimpleNamespace(
        barrier=lambda group=None: calls.append(("barrier", group)),
        all_reduce=lambda t, op=None, group=None: calls.append(("all_reduce", group)),
        get_world_size=lambda group=None: 2, ReduceOp=types.SimpleNamespace(MAX="max")))
    host = hostbuf.HostShared("g", 0, [torch.zeros(4)])
    host.fill(lambda: (calls.append("write"), host.bufs[0].add_(1)))
    assert calls == [("barrier", "g"), "write", ("all_reduce", "g")] and host.bufs[0].tolist() == [1.0] * 4
    calls.clear()
    host.fill(lambda: calls.append("write"), wait_readers=False)
    assert calls == ["write", ("all_reduce", "g")]
