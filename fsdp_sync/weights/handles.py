"""Handle payloads: tensors travel between processes as handle tuples, never as data.

The only module that knows torch's handle tuples. A payload is one pickle with ForkingPickler's
reductions (bytes, or base64 text for HTTP) of a tensor or of a dict of tensors (a flattened
bucket), made for exactly one consuming rank:

- CPU tensors go through POSIX shared memory by file name (torch's ``file_system`` sharing), which a
  process the producer did not start can open. The global sharing strategy is not touched: the
  choice is made by this module's own pickler. `open_payload` maps such a segment by its file in
  /dev/shm, keeping torch's reference count in the segment's header, rather than through the
  producer's ``torch_shm_manager`` (which would stay connected, and alive, as long as the
  consumer: `shm.map_segment`).
- CUDA tensors go through CUDA IPC, with the device written as its UUID so sender and receiver with
  different ``CUDA_VISIBLE_DEVICES`` agree. Only our pickler and our unpickler translate; torch's
  reductions are not patched, so pickling CPU tensors elsewhere in the process keeps working.
  Where SGLang's ``monkey_patch_torch_reductions`` did patch them in this process (verl's and
  SGLang's serializers apply it), our pickler still uses torch's own reducer and writes torch's
  ``rebuild_cuda_tensor`` by name: a payload is the same whether or not the patch ran.

On the wire there are only builtins, ``types.SimpleNamespace``, torch dtypes/sizes/storages and
torch's rebuild functions: what SGLang's safe deserializer accepts. `open_payload` admits exact
``(module, name)`` pairs only (no prefix, no ``getattr``, no dotted names), hands mutable classes
over as inert stand-ins, checks the rebuild functions' arguments and refuses torch's by-value
storage loader (``torch.storage._load_from_bytes``): a crafted payload cannot run code. A
shared-memory handle must name an existing torch segment (``/torch_<pid>_<n>_<n>``, no paths) of
this user, no smaller than it claims, through a torch shm-manager socket; every tensor view must lie
inside its storage. A segment of another process of the same user is admitted: relays re-share
segments other processes made, and such a process can read ``/dev/shm`` anyway.

A tagged payload (the default) carries an ``"fsdp_sync"`` entry: the rank it is for and a 4-byte
shared state word (0 fresh, 1 opened, 2 acknowledged, 3 revoked; inside a sync a slot of a page the
sync's payloads share, a generation beside it: `state_words`). Opening by the wrong rank or twice
raises; the producer's `PayloadSet` keeps every buffer alive until `release`, which reports ranks
that never acknowledged and gives back what a payload nobody opened still holds: its shared-memory
references and its CUDA IPC reference counters (torch starts each at 1 and parks the producer's
block until a consumer releases it), so no segment, file descriptor, IPC handle or GPU block is left
behind. "Nobody opened" is decided under a lock on the state word's segment, which `open_payload`
takes too: fresh becomes revoked (that consumer's open is refused) or opened (nothing is given back),
never both.

Not here: which tensors go in a bucket (`bucket`), and who carries payloads where (`transport`).
"""

from __future__ import annotations

import base64
import contextlib
import copyreg
import io
import logging
import pickle
import types
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, Sequence

import torch
from torch.multiprocessing import reductions as _red

from . import cuda_later, ipc_memory, state_words
from .wire_names import WireClass, wire_class
from .bucket import SUPPORTED_DTYPES, dtype_name
from .unpickle import RED, Unpickler, device_uuid, torch_rebuild_cuda_tensor, torch_reduce_tensor
from .shm import (HandleError, add_torch_reference, keep_sockets_from_shm_manager, new_shared_storage,
                  map_segment, mapped_handle, refcount_lock, take_back)

__all__ = ["HandleError", "UnreleasedPayloadWarning", "PayloadSet", "Received", "make_payloads",
           "open_payload", "ack_all", "empty_shared", "adopt", "wire_class", "WireClass", "TAG", "FRESH",
           "OPENED", "ACKED", "REVOKED"]

TAG = "fsdp_sync"
_TAG_KEY = b"\x8c\x09" + TAG.encode()      # the tag's key as pickle writes it (SHORT_BINUNICODE)
FRESH, OPENED, ACKED, REVOKED = 0, 1, 2, 3


class UnreleasedPayloadWarning(RuntimeWarning):
    """A `PayloadSet` was garbage-collected without `PayloadSet.release`."""


# --------------------------------------------------------------------------- shared CPU memory

# Storages this module allocated in shared memory (keyed by data pointer); their handles can be
# made without a copy. Anything else is copied into a fresh segment (an empty view: a new empty
# tensor) before it is shared, so that sharing never moves a caller's tensor (a parameter, say)
# into shared memory behind its back, nor hands a consumer bytes outside the tensor.
_OWNED: dict[int, "_red.StorageWeakRef"] = {}
_log = logging.getLogger(__name__)
_copied_expandable = False     # said once per process (`_Pickler._shareable_copy`)
# storages `_shareable_copy` had to copy to share, by data_ptr, held weakly: an entry whose storage
# died is no match for a new allocation at its address (a pool's fresh buffer was dropped for it)
_SHARED_AS_COPY: dict[int, "_red.StorageWeakRef"] = {}


def empty_shared(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D uint8 buffer whose handle can be made without a copy: shared memory on CPU, an
    ordinary segment on CUDA (never an expandable one: `ipc_memory`)."""
    device = torch.device(device)
    if device.type != "cpu":
        with ipc_memory.shareable(device):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
    keep_sockets_from_shm_manager()
    storage = new_shared_storage(max(int(nbytes), 1))
    _OWNED[storage.data_ptr()] = _red.StorageWeakRef(storage)
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, 0, (int(nbytes),), (1,))
    return out


def adopt(tensor: torch.Tensor) -> torch.Tensor:
    """Mark a CPU tensor that already lives in shared memory by file name (one this process
    opened from a payload, say) as sharable without a copy."""
    storage = tensor.untyped_storage()
    if tensor.device.type == "cpu" and mapped_handle(storage) is not None:
        raise HandleError("cannot adopt a tensor opened from a payload by file: open it with "
                          "open_payload(..., share_again=True) to share it again without a copy")
    if tensor.device.type == "cpu":
        _OWNED[storage.data_ptr()] = _red.StorageWeakRef(storage)
    return tensor


def _is_owned(storage: torch.UntypedStorage) -> bool:
    ref = _OWNED.get(storage.data_ptr())
    if ref is not None and ref.expired():
        del _OWNED[storage.data_ptr()]
    return ref is not None and not ref.expired()


def _prune_owned() -> None:
    for k in [k for k, r in _OWNED.items() if r.expired()]:
        del _OWNED[k]


# --------------------------------------------------------------------------- pickling

def _is_cuda_rebuild(fn: Any) -> bool:
    return fn is _red.rebuild_cuda_tensor or fn is torch_rebuild_cuda_tensor()


class _Reductions:
    """multiprocessing's ForkingPickler reductions, sharing CPU storages by file name and naming
    CUDA devices by UUID: what both picklers below do with tensors and storages."""

    def _setup(self, keep: list, shared: list, counters: list, copies: dict | None) -> None:
        self._keep = keep          # tensors copied into shared memory for this payload
        self._copies = {} if copies is None else copies   # shareable copies, one per source tensor
        self._shared = shared      # CPU storages whose ref count this payload raised
        self._counters = counters  # (handle, offset) of each CUDA IPC reference counter it holds
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        table[torch.Tensor] = self._reduce_tensor
        table[torch.nn.Parameter] = self._reduce_tensor
        table[torch.UntypedStorage] = self._reduce_storage
        self.dispatch_table = table

    def _reduce_tensor(self, t: torch.Tensor):
        if t.numel() == 0 and t.untyped_storage().nbytes() and not _is_owned(t.untyped_storage()):
            t = t.new_empty(t.shape)    # (see _OWNED: shared as it is, ``w[5:5]`` moved w into shm)
        elif t.device.type == "cpu" and t.numel() > 0 and not _is_owned(t.untyped_storage()):
            t = self._copy(t)
        try:
            fn, args = torch_reduce_tensor()(t.detach())
        except RuntimeError as exc:      # a torch built to refuse sharing expandable segments
            if "expandable_segments" not in str(exc):
                raise
            fn, args = self._shareable_copy(t, None)
        if _is_cuda_rebuild(fn) and ipc_memory.is_expandable_handle(args[7]):
            fn, args = self._shareable_copy(t, args)
        if _is_cuda_rebuild(fn):
            # torch's reducer returns what the module's name holds: SGLang's wrapper where it is
            # patched. Send torch's function, by torch's name, with the device as its UUID.
            fn = torch_rebuild_cuda_tensor()
            args = (*args[:6], device_uuid(args[6]) if isinstance(args[6], int) else args[6], *args[7:])
            if args[11] is not None:       # (an empty storage shares no memory and no counter)
                self._counters.append((args[11], args[12]))
        return fn, args

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` shareable as it is (CUDA: allocated with expandable segments off), one
        for every rank's payload (per source view), kept with them until their release."""
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
        copy = self._copies.get(key)
        if copy is None:
            with ipc_memory.forced_off() if t.device.type == "cuda" else contextlib.nullcontext():
                copy = empty_shared(t.numel() * t.element_size(), t.device).view(t.dtype).view(t.shape)
            copy.copy_(t)
            self._keep.append(copy)
            self._copies[key] = copy
        return copy

    def _shareable_copy(self, t: torch.Tensor, args: tuple | None):
        """``t`` lies in an expandable segment (allocated before `ipc_memory.shareable`), whose
        share a consumer may not open: give back the reference its share took (``args``; None:
        torch refused to share it) and share a copy in an ordinary segment instead, kept with the
        payload until it is released."""
        if args is not None and args[11] is not None:
            _release_ipc_counter(args[11], args[12])
        storage = t.untyped_storage()
        _SHARED_AS_COPY[storage.data_ptr()] = _red.StorageWeakRef(storage)
        global _copied_expandable
        if not _copied_expandable:
            _copied_expandable = True
            _log.warning("fsdp_sync: a CUDA tensor of %s in an expandable segment was copied to be "
                         "shared (a consumer opens such a block only with ptrace rights over this "
                         "process); what is allocated with them off is shared without a copy "
                         "(fsdp_sync.weights.ipc_memory)",
                         f"{t.numel() * t.element_size() / 2**20:.1f} MiB")
        copy = self._copy(t)
        fn, args = torch_reduce_tensor()(copy)
        if _is_cuda_rebuild(fn) and ipc_memory.is_expandable_handle(args[7]):
            raise HandleError(f"cannot share {tuple(t.shape)} {t.dtype} on {t.device} by a CUDA IPC "
                              f"handle: a copy allocated with expandable segments off still came "
                              f"from an expandable segment; set PYTORCH_CUDA_ALLOC_CONF="
                              f"expandable_segments:False for the trainer")
        return fn, args

    def _reduce_storage(self, storage: torch.UntypedStorage):
        if storage.device.type != "cpu":
            raise HandleError(f"cannot share a {storage.device} storage on its own; send its tensor")
        if storage.nbytes() == 0:
            return (_red.rebuild_storage_empty, (type(storage),))
        if mapped_handle(storage) is not None:
            raise HandleError("cannot share again a storage opened from a payload by file; open it "
                              "with open_payload(..., share_again=True)")
        keep_sockets_from_shm_manager()
        manager, handle, size = storage._share_filename_cpu_()
        add_torch_reference(storage, +1)
        self._shared.append(storage)
        _red.shared_cache[handle] = _red.StorageWeakRef(storage)
        return (_red.rebuild_storage_filename, (type(storage), manager, handle, size))


class _Pickler(_Reductions, pickle._Pickler):
    """Python's pickler, for what the C one cannot write: under SGLang's patch the module name
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` is bound to SGLang's wrapper, and the
    C pickler refuses to write a function under a name that holds another object (torch's own
    reducer returns whatever the module's name holds at call time). This one writes torch's
    function under torch's name (`_save_function`), what every receiver resolves; and a wire
    class's instances under a module this process may not import (`wire_class`)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file: io.BytesIO, keep: list, shared: list, counters: list, copies: dict | None = None):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._setup(keep, shared, counters, copies)

    def _save_function(self, obj: Any, name: Any = None) -> None:
        if obj is torch_rebuild_cuda_tensor() and name is None and self.proto >= 4:
            self.save(RED)
            self.save("rebuild_cuda_tensor")
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
        else:
            super().save_global(obj, name)

    dispatch[types.FunctionType] = _save_function

    def _save_wire_class(self, obj: Any, name: Any = None) -> None:
        self.save(obj.wire_module)
        self.save(obj.wire_name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch[WireClass] = _save_wire_class


class _FastPickler(_Reductions, pickle.Pickler):
    """The C pickler, with the same reductions: for every payload that needs neither of
    `_Pickler`'s two tricks (`_dump`). A bucket's metadata is a dozen objects per tensor, which
    Python's pickler takes ~20 us each to write: 8 ms of a 338-tensor sync on this host."""

    def __init__(self, file: io.BytesIO, keep: list, shared: list, counters: list, copies: dict | None = None):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._setup(keep, shared, counters, copies)


def _check_value(obj: Any, path: str, device: str | None) -> bool:
    """Refuse a tensor the payload cannot carry, naming where it is; True where the value holds an
    instance of a wire class (which only `_Pickler` writes)."""
    wired = False
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in SUPPORTED_DTYPES:
            raise HandleError(f"unsupported dtype {dtype_name(obj.dtype)} for {path!r}")
        if not obj.is_contiguous():
            raise HandleError(f"expected a contiguous tensor for {path!r}, got strides "
                              f"{obj.stride()} for shape {tuple(obj.shape)}")
        if obj.device.type not in ("cpu", "cuda"):
            raise HandleError(f"expected {path!r} on cpu or cuda, got {obj.device}")
        if device is not None and obj.device.type != device:
            raise HandleError(f"expected {path!r} on {device}, got {obj.device}")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if type(v) in _LEAVES:       # (a bucket's metadata is mostly these)
                continue
            if isinstance(v, _NESTED):   # leaves are not checked: no path made for them
                wired |= _check_value(v, f"{path}.{k}" if path else str(k), device)
            elif isinstance(type(v), WireClass):
                wired = True
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            if type(v) in _LEAVES:
                continue
            # a bucket's metadata entry holds leaves only: passed here, not a call and a dict
            # walk each (a 60-entry bucket checked in 33-59 us instead of 69-138 on this host)
            if type(v) is types.SimpleNamespace and all(type(x) in _LEAVES for x in v.__dict__.values()):
                continue
            if isinstance(v, _NESTED):
                wired |= _check_value(v, f"{path}[{i}]", device)
            elif isinstance(type(v), WireClass):
                wired = True
    elif isinstance(obj, types.SimpleNamespace):
        wired = _check_value(vars(obj), path, device)
    return wired or isinstance(type(obj), WireClass)


_NESTED = (torch.Tensor, dict, list, tuple, types.SimpleNamespace)

_LEAVES = frozenset({int, str, float, bool, type(None), bytes, torch.dtype, torch.Size})
"""Types that hold no tensor and no wire class: `_tensors` and `_check_value` pass them at the
first look (a bucket's metadata is mostly these: 0.44 ms a walk of 338 entries, 1.2 ms asking
each what it is)."""


def _dump(obj: Any, keep: list, shared: list, counters: list, copies: dict | None = None, *,
          wired: bool = True) -> bytes:
    """``obj`` pickled with the C pickler where it can write it: ``wired`` False (no wire class in
    it, `_check_value`) and torch's ``rebuild_cuda_tensor`` under its own name (no SGLang patch in
    this process); else with Python's (`_Pickler`). Either writes the same objects."""
    buf = io.BytesIO()
    fast = not wired and _red.rebuild_cuda_tensor is torch_rebuild_cuda_tensor()
    pickler = (_FastPickler if fast else _Pickler)(buf, keep, shared, counters, copies)
    try:
        pickler.dump(obj)
    finally:
        # the dispatch table's bound methods make a cycle that would keep every pickled tensor
        # (and its shared segment) alive until the next garbage collection
        pickler.clear_memo()
        pickler.dispatch_table = {}
    return buf.getvalue()


# --------------------------------------------------------------------------- producer side

@dataclass
class PayloadSet:
    """Payloads of one object, element i for consumer rank i, and the buffers they point at.

    Keep it until the consumers have answered, then `release` (or use it as a context manager).
    """

    payloads: list
    obj: Any
    states: list[torch.Tensor | None]
    _keep: list = field(default_factory=list, repr=False)
    _shared: list[list] = field(default_factory=list, repr=False)
    ranks: list[int] = field(default_factory=list)
    released: bool = False
    _counters: list[list] = field(default_factory=list, repr=False)
    _slots: list = field(default_factory=list, repr=False)     # `state_words.Slot`s, pooled ones

    def state(self, rank: int) -> int:
        s = self.states[rank]
        return ACKED if s is None else int(s[0])

    def unacknowledged(self) -> list[int]:
        """Indices into ``payloads`` whose consumer has not acknowledged."""
        return [r for r in range(len(self.payloads)) if self.state(r) != ACKED]

    def release(self, *, require_ack: bool = True, unopened: Sequence[int] = ()) -> None:
        """Free every buffer. Raises `HandleError` naming ranks that never acknowledged.

        A consumer that opened its payload gave the reference back as it opened it (a consumer that
        died later leaves nothing counted). ``unopened``: consumer ranks the caller knows never
        opened their payload, for untagged payloads (SGLang's): a tagged one tells by its state
        word, revoked here if still fresh, so that it can no longer be opened.
        """
        if self.released:
            return
        missing = [r for r in range(len(self.payloads)) if self.states[r] is not None
                   and self.state(r) != ACKED]
        # A payload nobody opened still holds the reference its pickling took and, for a CUDA
        # tensor, torch's IPC counter (1 until a consumer's storage dies): give them back, or the
        # segment outlives every process that maps it and the GPU block stays in torch's limbo.
        for i in range(len(self.payloads)):
            rank = self.ranks[i] if self.ranks else i
            state = self.states[i]
            if _revoke(state) if state is not None else rank in unopened:
                for storage in self._shared[i]:
                    add_torch_reference(storage, -1)
                for handle, offset in (self._counters[i] if self._counters else ()):
                    _release_ipc_counter(handle, offset)
        for slot in self._slots:        # a final state frees the slot for the sync's next payload
            state_words.give_back(slot)
        ranks = self.ranks
        self.payloads, self.obj, self._keep, self._shared, self.states = [], None, [], [], []
        self._counters, self._slots = [], []
        self.released = True
        _prune_owned()
        collect_ipc()
        if require_ack and missing:
            raise HandleError(f"consumer ranks {[ranks[i] for i in missing]} never "
                              f"acknowledged their payloads")

    def __enter__(self) -> "PayloadSet":
        return self

    def __del__(self) -> None:
        # Dropped without release(): its shared-memory segments would otherwise stay until the
        # process exits. Give them back now and say so (the caller's lifetime rule was broken).
        if getattr(self, "released", True) or not getattr(self, "payloads", None):
            return
        try:
            warnings.warn(f"a PayloadSet of {len(self.payloads)} payloads (consumer ranks "
                          f"{self.ranks}) was garbage-collected without release(); releasing its "
                          f"buffers now. Call release() (or use it as a context manager) once the "
                          f"consumers have answered.", UnreleasedPayloadWarning, stacklevel=2)
            self.release(require_ack=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(require_ack=exc_type is None)


def shared_as_copy(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was shared as a copy, being in an expandable segment: a sync's
    reused buffer that was is let go and allocated again (now shareable as it is) rather than
    copied, and the copy kept by the engine for the update, bucket after bucket. Forgotten once
    asked: its address may be another allocation's next."""
    storage = t.untyped_storage()
    ref = _SHARED_AS_COPY.pop(storage.data_ptr(), None)
    return ref is not None and not ref.expired() and ref.cdata == storage._cdata


def collect_ipc() -> None:
    """Free the CUDA blocks this process shared that its consumers have since let go (torch keeps
    a shared block it dropped in limbo until then: `torch.cuda.ipc_collect`); nothing without
    CUDA in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def make_payloads(obj: Any, num_consumers: int, *, output_str: bool = False,
                  tagged: bool = True, ranks: Sequence[int] | None = None) -> PayloadSet:
    """Serialize ``obj`` (a tensor, or a dict/list of tensors) once per consuming rank.

    Element i of ``.payloads`` is for consumer rank ``ranks[i]`` (default: rank i of
    ``num_consumers``) and is to be opened exactly once. A colocated trainer rank passes
    ``ranks=[its infer-TP rank]``: its own copy goes to its own engine worker. Tagged payloads wrap
    a bare tensor as ``{"tensor": t, "fsdp_sync": ...}``; dicts get the ``"fsdp_sync"`` key added.
    """
    if num_consumers < 1:
        raise ValueError(f"num_consumers must be >= 1, got {num_consumers}")
    ranks = list(range(num_consumers)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not 0 <= r < num_consumers]
    if bad:
        raise ValueError(f"consumer ranks {bad} outside [0, {num_consumers})")
    wired = _check_value(obj, "tensor" if isinstance(obj, torch.Tensor) else "", None)
    if tagged and isinstance(obj, dict) and TAG in obj:
        raise HandleError(f"payload dict already has a {TAG!r} key")
    keep: list = []
    copies: dict = {}
    states: list[torch.Tensor | None] = []
    shared_per_rank: list[list] = []
    counters_per_rank: list[list] = []
    payloads: list = []
    slots: list = []
    for rank in ranks:
        shared: list = []
        counters: list = []
        try:
            if tagged:
                # inside a sync (`state_words.pooled`) a slot of a page the sync's payloads share;
                # else a 4-byte segment of its own
                slot = state_words.take(empty_shared)
                if slot is not None:
                    slots.append(slot)
                    state = slot.state
                    tag = {"rank": rank, "of": num_consumers, "state": state, "gen": slot.gen}
                else:
                    state = empty_shared(4).view(torch.int32)
                    state.zero_()
                    tag = {"rank": rank, "of": num_consumers, "state": state}
                wire = dict(obj, **{TAG: tag}) if isinstance(obj, dict) else {"tensor": obj, TAG: tag}
            else:
                state, wire = None, obj
            states.append(state)
            shared_per_rank.append(shared)
            counters_per_rank.append(counters)
            data = _dump(wire, keep, shared, counters, copies, wired=wired)
        except BaseException:
            # no consumer has any: give back what pickling took for every rank so far (shared
            # memory's references, CUDA IPC counters), or segments stay until this process exits
            PayloadSet([b""] * len(states), obj, states, keep, shared_per_rank, ranks, _counters=
                       counters_per_rank, _slots=slots).release(require_ack=False, unopened=ranks)
            raise
        payloads.append(base64.b64encode(data).decode("ascii") if output_str else data)
    return PayloadSet(payloads, obj, states, keep, shared_per_rank, ranks, _counters=counters_per_rank,
                      _slots=slots)


def _segment_handle(state: torch.Tensor) -> bytes:
    """The shared-memory handle of a state word's segment (mapped by `map_segment` or by torch)."""
    storage = state.untyped_storage()
    return mapped_handle(storage) or storage._share_filename_cpu_()[1]


def _revoke(state: torch.Tensor) -> bool:
    """Fresh becomes revoked, under the lock `open_payload` takes to turn fresh into opened: True
    when nobody opened the payload and nobody can from now on."""
    if int(state[0]) != FRESH:          # the word never goes back to fresh: no lock needed
        return False
    with refcount_lock(_segment_handle(state)):
        if int(state[0]) != FRESH:
            return False
        state[0] = REVOKED
        return True


def _release_ipc_counter(handle: bytes, offset: int) -> None:
    """What a consumer's storage does when it dies (and torch's ``rebuild_cuda_tensor`` on a
    cache hit): decrement one CUDA IPC reference counter, so the producer's block is freed once
    the producer drops it (or by ``torch.cuda.ipc_collect`` if it already has)."""
    torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)


# --------------------------------------------------------------------------- consumer side

@dataclass
class Received:
    """What a consumer got from its payload. Call `ack` (or `ack_all` for several) once it no
    longer needs the memory."""

    value: Any
    rank: int | None
    _state: torch.Tensor | None = field(default=None, repr=False)
    # a tagged payload's tensors as its unpickling rebuilt them (the state word aside): what the
    # consumer's storage and device walks take instead of walking the value (a 56-entry bucket's
    # metadata: 42 us a walk here); dropped with the value at the acknowledgement
    _tensors: list | None = field(default=None, repr=False)

    def ack(self) -> None:
        ack_all([self])

    def each_storage(self, fn, devices: tuple[str, ...] = ("cpu",)) -> None:
        """``fn(storage)`` once for each storage with bytes that a tensor of the value on a device
        of one of the ``devices`` types views."""
        _for_each_storage(self.value, fn, devices, self._tensors)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a payload's value (dicts, lists, tuples, SimpleNamespaces, nested), in
    order. A walk with its own stack, not a generator per object, that does not enter a
    ``torch.Size``: a bucket's metadata is ~20 objects per tensor, walked at each open and ack."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) in _LEAVES:
            continue
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, dict):
            stack.extend(reversed(o.values()))
        elif isinstance(o, types.SimpleNamespace):
            stack.extend(reversed(vars(o).values()))
        elif isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            stack.extend(reversed(o))


def _cuda_devices(rec: Received) -> set[torch.device]:
    """The CUDA devices the tensors of a received value live on."""
    return {t.device for t in (rec._tensors if rec._tensors is not None else _tensors(rec.value))
            if t.device.type == "cuda"}


def _sync_stream(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def ack_all(received: Sequence[Received]) -> None:
    """Acknowledge received payloads: after it their producers may free or rewrite the buffers.

    In this order: wait for this process's work on the buffers (a copy out of a CUDA bucket is
    asynchronous: the current stream of each device a value lives on is synchronized, once per
    device for the whole batch, not per tensor; torch's IPC deleter would synchronize only when the
    last reference goes, and only if none survives), then drop the values, then set each shared
    state word to acknowledged. If the synchronization fails nothing is acknowledged: the producer
    reports these ranks rather than rewriting a buffer still being read."""
    received = list(received)
    devices: set[torch.device] = set()
    for rec in received:
        devices |= _cuda_devices(rec)
    for device in sorted(devices, key=lambda d: d.index if d.index is not None else -1):
        _sync_stream(device)
    states = []
    for rec in received:
        states.append(rec._state)
        rec.value, rec._state, rec._tensors = None, None, None
    for state in states:
        if state is not None:
            state[0] = ACKED


def _for_each_storage(obj: Any, fn, devices: tuple[str, ...] = ("cpu",),
                      tensors: list | None = None) -> None:
    """``fn(storage)`` once for each storage with bytes that a tensor of ``obj`` (or of
    ``tensors``, when given: the ones it holds) on a device of one of the ``devices`` types views."""
    seen: set[int] = set()
    for t in tensors if tensors is not None else _tensors(obj):
        st = t.untyped_storage()
        if t.device.type in devices and st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            fn(st)


def open_payload(payload: bytes | str, rank: int | None = None, *, share_again: bool = False) -> Received:
    """Rebuild a payload in this process. ``rank`` is the consuming rank, checked against the tag.

    CPU shared memory is mapped by file, without the producer's ``torch_shm_manager``
    (`map_segment`). ``share_again``: the caller will share the tensors again without a copy
    (`adopt`, a relay such as `hostbuf`): map them through torch's rebuild, which connects this
    process to the producer's manager for its lifetime (harmless between ranks of one job). A
    refused tagged payload opens no CUDA IPC handle (rebuilt once the tag admits it: `cuda_later`)."""
    data = base64.b64decode(payload) if isinstance(payload, str) else payload
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandleError(f"a payload is bytes or base64 text, got {type(payload).__name__}")
    tagged = _TAG_KEY in data
    unpickler = (cuda_later.LaterUnpickler if tagged else Unpickler)(io.BytesIO(data), share_again)
    later: list = []
    try:
        obj = unpickler.load()
        if tagged and unpickler.later:
            later = cuda_later.where(obj)            # (refuses before anything is opened)
            if not (isinstance(obj, dict) and TAG in obj):
                obj, later = cuda_later.put(obj, cuda_later.rebuild(later)), []   # nothing to check
    except BaseException as exc:
        raise _load_error(exc, data, unpickler, rank)
    if not (isinstance(obj, dict) and TAG in obj):
        return Received(obj, rank)
    tag = obj.pop(TAG)
    state = tag.get("state") if isinstance(tag, dict) else None
    gen = tag.get("gen") if isinstance(tag, dict) else None
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.int32 and state.numel() == 1
            and isinstance(tag.get("rank"), int) and (gen is None or type(gen) is int)):
        raise HandleError(f"payload's {TAG!r} tag is malformed: {tag!r:.80}")
    error, failed, tensors = None, [], {}
    if rank is not None and rank != tag["rank"]:
        error = f"payload for infer-TP rank {tag['rank']} (of {tag['of']}) opened by rank {rank}"
    else:
        try:
            words = state_words.words_of(state) if gen is not None else None
        except HandleError as exc:
            error = str(exc)
        else:
            # under the lock `_revoke` and a pooled slot's reuse take: a slot that went to a later
            # payload (another generation) reads as revoked, this payload having been released.
            # The CUDA tensors are opened under it too: opened means opened whole, or fresh
            with refcount_lock(_segment_handle(state)):
                was = (int(state[0]) if words is None or state_words.generation_matches(words, gen)
                       else REVOKED)
                if was == FRESH:
                    try:
                        tensors = cuda_later.rebuild(later)
                    except BaseException as exc:  # noqa: BLE001 - raised below, as a load's
                        failed.append(exc)   # (popped there: no cycle through this frame)
                    else:
                        state[0] = OPENED
            if was == REVOKED:
                error = (f"payload for rank {tag['rank']} was released by its producer before it was "
                         f"opened (PayloadSet.release: the producer stopped waiting for this consumer)")
            elif was != FRESH:
                error = (f"payload for rank {tag['rank']} opened twice (state "
                         f"{'opened' if was == OPENED else 'acknowledged'})")
    if failed:
        raise _load_error(failed.pop(), data, unpickler, rank)
    if error is not None:
        # unpickling took the reference meant for the rightful consumer: hand it back
        _for_each_storage(obj, take_back)
        _for_each_storage(tag, take_back)
        raise HandleError(error)
    obj = cuda_later.put(obj, tensors)
    value = obj["tensor"] if set(obj) == {"tensor"} else obj
    return Received(value, tag["rank"], state, [t for t in unpickler.rebuilt if t is not state])


def _load_error(exc: BaseException, data: Any, unpickler: Unpickler, rank: int | None) -> BaseException:
    """What `open_payload` raises for a failed load or CUDA rebuild (raised there: not a cycle here)."""
    if _TAG_KEY in data:
        # refused after mapping: the state word reads fresh, and the producer's release gives
        # back mapping's reference (an untagged payload is counted as opened: ours to keep)
        for storage in unpickler.mapped:
            take_back(storage)
    if isinstance(exc, HandleError) or not isinstance(exc, Exception):
        return exc
    error = HandleError(f"cannot open payload{'' if rank is None else f' on rank {rank}'}: "
                        f"{type(exc).__name__}: {exc}. Was it released by its producer already "
                        f"(PayloadSet.release), or made in another host's memory?")
    error.__cause__ = exc
    return error
