"""Handle payloads: tensors travel between processes as handle tuples, never as data.

The only module that knows torch's handle tuples. A payload is one ForkingPickler dump (bytes, or
base64 text for HTTP) of a tensor or of a dict of tensors (a flattened bucket), made for exactly one
consuming rank:

- CPU tensors go through POSIX shared memory by file name (torch's ``file_system`` sharing), which a
  process the producer did not start can open. The global sharing strategy is not touched: the
  choice is made by this module's own pickler. `open_payload` maps such a segment by its file in
  /dev/shm, keeping torch's reference count in the segment's header, rather than through the
  producer's ``torch_shm_manager`` (which would stay connected, and alive, as long as the
  consumer: `shm.map_segment`).
- CUDA tensors go through CUDA IPC, with the device written as its UUID so sender and receiver with
  different ``CUDA_VISIBLE_DEVICES`` agree. Only our pickler and our unpickler translate; torch's
  reductions are not patched, so pickling CPU tensors elsewhere in the process keeps working.

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
shared state word (0 fresh, 1 opened, 2 acknowledged). Opening by the wrong rank or twice raises;
the producer's `PayloadSet` keeps every buffer alive until `release`, which reports ranks that never
acknowledged and balances the shared-memory references of payloads nobody opened, so no segment,
file descriptor or IPC handle is left behind.

Not here: which tensors go in a bucket (`bucket`), and who carries payloads where (`transport`).
"""

from __future__ import annotations

import base64
import functools
import io
import pickle
import types
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Sequence

import torch
from torch.multiprocessing import reductions as _red

from .bucket import SUPPORTED_DTYPES, dtype_name
from .shm import (HandleError, add_torch_reference, check_segment,
                  keep_sockets_from_shm_manager, new_shared_storage, map_segment, mapped_handle, refcount_lock,
                  take_back)

__all__ = [
    "HandleError", "UnreleasedPayloadWarning", "PayloadSet", "Received", "make_payloads", "open_payload",
    "empty_shared", "adopt", "TAG", "FRESH", "OPENED", "ACKED",
]

TAG = "fsdp_sync"
FRESH, OPENED, ACKED = 0, 1, 2



class UnreleasedPayloadWarning(RuntimeWarning):
    """A `PayloadSet` was garbage-collected without `PayloadSet.release`."""


# --------------------------------------------------------------------------- shared CPU memory

# Storages this module allocated in shared memory (keyed by data pointer); their handles can be
# made without a copy. Anything else is copied into a fresh segment before it is shared, so that
# sharing never moves a caller's tensor (a parameter, say) into shared memory behind its back.
_OWNED: dict[int, "_red.StorageWeakRef"] = {}




def empty_shared(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D uint8 buffer whose handle can be made without a copy: shared memory on CPU."""
    device = torch.device(device)
    if device.type != "cpu":
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
    if ref is None:
        return False
    if ref.expired():
        del _OWNED[storage.data_ptr()]
        return False
    return True


def _prune_owned() -> None:
    for k in [k for k, r in _OWNED.items() if r.expired()]:
        del _OWNED[k]


# --------------------------------------------------------------------------- CUDA device UUIDs

@functools.lru_cache(maxsize=None)
def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == device:
            return i
    raise HandleError(f"payload names CUDA device {device!r}, which this process cannot see "
                      f"(CUDA_VISIBLE_DEVICES exposes {torch.cuda.device_count()} devices)")


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    args = list(args)
    args[6] = _device_index(args[6])
    return _red.rebuild_cuda_tensor(*args)


# --------------------------------------------------------------------------- pickling

class _Pickler(ForkingPickler):
    """ForkingPickler that shares CPU storages by file name and names CUDA devices by UUID."""

    def __init__(self, file: io.BytesIO, keep: list, shared: list) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._keep = keep          # tensors copied into shared memory for this payload
        self._shared = shared      # CPU storages whose ref count this payload raised
        table = dict(self.dispatch_table)
        table[torch.Tensor] = self._reduce_tensor
        table[torch.nn.Parameter] = self._reduce_tensor
        table[torch.UntypedStorage] = self._reduce_storage
        self.dispatch_table = table

    def _reduce_tensor(self, t: torch.Tensor):
        if t.device.type == "cpu" and t.numel() > 0 and not _is_owned(t.untyped_storage()):
            copy = empty_shared(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
            copy.copy_(t)
            self._keep.append(copy)
            t = copy
        fn, args = _red.reduce_tensor(t.detach())
        if fn is _red.rebuild_cuda_tensor and isinstance(args[6], int):
            # (a process that applied SGLang's global patch already wrote the UUID: keep it)
            args = list(args)
            args[6] = _device_uuid(args[6])
            args = tuple(args)
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


class _Cls:
    """Stands in for a mutable class (``torch.Tensor``, ``torch.nn.Parameter``,
    ``torch.UntypedStorage``) while a payload is unpickled: a payload's ``BUILD`` opcode could
    otherwise set attributes on the class itself. Only our rebuild wrappers turn it back into the
    class; it has no attributes or state of its own to set."""

    __slots__ = ("_cls",)

    def __init__(self, cls: type) -> None:
        object.__setattr__(self, "_cls", cls)

    def __setattr__(self, key: str, value: Any) -> None:
        raise HandleError("payload tried to set an attribute on a class")

    def __reduce__(self):
        raise HandleError("a class stand-in is not picklable")


_TENSOR, _PARAM, _USTORAGE = _Cls(torch.Tensor), _Cls(torch.nn.Parameter), _Cls(torch.UntypedStorage)
# A CUDA IPC handle names its storage's class as an argument of ``rebuild_cuda_tensor``: torch
# shares a CUDA tensor's typed storage, so the class is ``torch.storage.TypedStorage`` (torch 2.11,
# 2.13). It is accepted there only, as a stand-in like the others.
_TSTORAGE = _Cls(torch.TypedStorage)


def _cls(value: Any, allowed: tuple, what: str) -> type:
    if not any(value is a for a in allowed):
        raise HandleError(f"payload passes {value!r:.60} as the {what} class of a rebuild call; "
                          f"expected one of {[a._cls.__name__ for a in allowed]}")
    return value._cls


def _storage_arg(value: Any) -> Any:
    if not isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
        raise HandleError(f"payload passes {type(value).__name__} where a storage belongs")
    return value


def _check_view(itemsize: int, nbytes: Any, offset: Any, size: Any, stride: Any) -> None:
    """A view must lie inside its storage: torch would otherwise try to grow the shared storage
    (refused with a cryptic message) or, for a CUDA handle, read past the allocation."""
    ints = lambda v: isinstance(v, (tuple, list)) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    if type(offset) is not int or offset < 0 or not ints(size) or not ints(stride) or len(size) != len(stride):
        raise HandleError(f"payload's tensor view (offset {offset!r:.30}, size {size!r:.60}, stride "
                          f"{stride!r:.60}) is not non-negative ints of one rank; refused")
    if type(nbytes) is not int:
        raise HandleError(f"payload's storage size {nbytes!r:.30} is not an int; refused")
    if 0 in size:
        return
    end = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * itemsize
    if end > nbytes:
        raise HandleError(f"payload's tensor view (offset {offset}, size {tuple(size)}, stride "
                          f"{tuple(stride)}) reaches byte {end} of a {nbytes}-byte storage: it points "
                          f"outside its buffer; refused")


def _safe_rebuild_tensor(cls, storage, metadata):
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise HandleError("payload's tensor metadata is not (offset, size, stride, requires_grad)")
    if isinstance(storage, torch.TypedStorage):
        _check_view(storage.dtype.itemsize, storage._untyped_storage.nbytes(), *metadata[:3])
    elif isinstance(storage, torch.UntypedStorage):
        _check_view(1, storage.nbytes(), *metadata[:3])
    return _red.rebuild_tensor(_cls(cls, (_TENSOR, _PARAM), "tensor"), _storage_arg(storage), metadata)




def _safe_rebuild_storage_filename(cls, manager, handle, size, dtype=None, *, via_manager=False):
    _cls(cls, (_USTORAGE,), "storage")
    if not (isinstance(manager, bytes) and isinstance(handle, bytes) and type(size) is int):
        raise HandleError("payload's shared-memory handle is not (bytes, bytes, int)")
    check_segment(manager, handle, size)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise HandleError(f"payload's storage dtype is {type(dtype).__name__}, not a torch dtype")
    if via_manager or _red.storage_from_cache(torch.UntypedStorage, handle) is not None:
        # a relay that shares the segment again needs torch's own mapping (`adopt`); a segment
        # this process made or mapped through torch is in torch's cache and needs no manager
        with refcount_lock(handle):
            return _red.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size, dtype)
    storage = map_segment(handle, size if dtype is None else size * dtype.itemsize)
    return storage if dtype is None else torch.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                           _internal=True)


def _safe_rebuild_storage_empty(cls):
    return _cls(cls, (_USTORAGE,), "storage")()


def _safe_rebuild_typed_storage(storage, dtype):
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise HandleError("payload's typed storage is not (UntypedStorage, dtype)")
    return _red.rebuild_typed_storage(storage, dtype)


def _safe_rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage bytes, storage offset,
    #  requires_grad, ref-counter handle, ref-counter offset, event handle, event sync required)
    if len(args) != 15:
        raise HandleError(f"payload's CUDA tensor handle has {len(args)} fields, expected 15")
    args = list(args)
    args[0] = _cls(args[0], (_TENSOR, _PARAM), "tensor")
    args[4] = _cls(args[4], (_USTORAGE, _TSTORAGE), "storage")
    if not isinstance(args[5], torch.dtype):
        raise HandleError("payload's CUDA tensor dtype is not a torch dtype")
    fields = {"device": (args[6], (int, str)), "IPC handle": (args[7], (bytes, type(None))),
              "storage size": (args[8], (int,)), "storage offset": (args[9], (int,)),
              "requires_grad": (args[10], (bool,)), "ref-counter handle": (args[11], (bytes, type(None))),
              "ref-counter offset": (args[12], (int,)), "event handle": (args[13], (bytes, type(None))),
              "event sync flag": (args[14], (bool,))}
    for what, (value, types_) in fields.items():
        if type(value) not in types_ or (type(value) is int and value < 0):
            raise HandleError(f"payload's CUDA tensor {what} is {value!r:.40} "
                              f"({type(value).__name__}); refused")
    _check_view(args[5].itemsize, args[8], args[3], args[1], args[2])
    return _rebuild_cuda_tensor_by_uuid(*args)


def _latin1_bytes(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 writes a ``bytes`` value (a CUDA IPC handle, say):
    ``encode(str, 'latin1')``. Nothing else: no other codec, no other argument types."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise HandleError(f"payload calls _codecs.encode({type(text).__name__}, {encoding!r:.20}); "
                          f"only encode(str, 'latin1'), protocol 2's bytes, is accepted")
    return text.encode("latin1")


def _refuse_by_value(*_args: Any) -> Any:
    raise HandleError("payload holds a by-value storage (torch.storage._load_from_bytes, a nested "
                      "unrestricted unpickle); refused: payloads carry shared-memory or CUDA IPC "
                      "handles, made by fsdp_sync.weights.handles.make_payloads")


def _no_count(cls: type) -> Any:
    """``bytes`` / ``bytearray`` as older protocols pickle them (from a list or a string), never
    from a count: ``bytearray(10**12)`` in a payload would exhaust the receiver's memory."""
    def build(*args: Any) -> Any:
        if any(isinstance(a, int) for a in args):
            raise HandleError(f"payload builds {cls.__name__} from a count; refused")
        return cls(*args)

    return build


_RED = "torch.multiprocessing.reductions"
# Exact (module, name) pairs, each mapped to the object a payload gets: nothing by prefix, no
# getattr, no dotted names (``torch.serialization.os`` is the os module). Mutable classes and
# torch's rebuild functions are replaced by stand-ins and wrappers that check their arguments.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", t.__name__): t for t in (dict, list, tuple, set, frozenset, int, float, str,
                                             bool, complex, slice)},
    ("builtins", "bytes"): _no_count(bytes),
    ("builtins", "bytearray"): _no_count(bytearray),
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): _TENSOR,
    ("torch._tensor", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAM,
    ("torch.storage", "UntypedStorage"): _USTORAGE,
    ("torch", "UntypedStorage"): _USTORAGE,
    ("torch.storage", "TypedStorage"): _TSTORAGE,
    ("_codecs", "encode"): _latin1_bytes,
    (_RED, "rebuild_tensor"): _safe_rebuild_tensor,
    (_RED, "rebuild_storage_filename"): _safe_rebuild_storage_filename,
    (_RED, "rebuild_storage_empty"): _safe_rebuild_storage_empty,
    (_RED, "rebuild_typed_storage"): _safe_rebuild_typed_storage,
    (_RED, "rebuild_cuda_tensor"): _safe_rebuild_cuda_tensor,
    ("torch.storage", "_load_from_bytes"): _refuse_by_value,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


class _Unpickler(pickle.Unpickler):
    """Accepts what SGLang's safe deserializer accepts (exact pairs), and nothing of ours.
    ``via_manager``: map shared memory through torch's rebuild (see `open_payload`)."""

    def __init__(self, file: io.BytesIO, via_manager: bool = False) -> None:
        super().__init__(file)
        self._via_manager = via_manager

    def find_class(self, module: str, name: str):
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise HandleError(f"payload holds {module}.{name}, which is not on the allow-list "
                              f"(builtin data types, SimpleNamespace, torch dtypes and tensor/storage "
                              f"rebuild functions); refused")
        if obj is _safe_rebuild_storage_filename and self._via_manager:
            return functools.partial(obj, via_manager=True)
        return obj

    def persistent_load(self, pid: Any):
        raise HandleError("payload holds a persistent id; refused")


def _check_value(obj: Any, path: str, device: str | None) -> None:
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
            if isinstance(v, _NESTED):   # leaves are not checked: no path made for them
                _check_value(v, f"{path}.{k}" if path else str(k), device)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            if isinstance(v, _NESTED):
                _check_value(v, f"{path}[{i}]", device)
    elif isinstance(obj, types.SimpleNamespace):
        _check_value(vars(obj), path, device)


_NESTED = (torch.Tensor, dict, list, tuple, types.SimpleNamespace)


def _dump(obj: Any, keep: list, shared: list) -> bytes:
    buf = io.BytesIO()
    pickler = _Pickler(buf, keep, shared)
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

    def state(self, rank: int) -> int:
        s = self.states[rank]
        return ACKED if s is None else int(s[0])

    def unacknowledged(self) -> list[int]:
        """Indices into ``payloads`` whose consumer has not acknowledged."""
        return [r for r in range(len(self.payloads)) if self.state(r) != ACKED]

    def release(self, *, require_ack: bool = True, unopened: Sequence[int] = ()) -> None:
        """Free every buffer. Raises `HandleError` naming ranks that never acknowledged.

        A consumer that opened its payload gave the reference back as it opened it (a consumer that
        died later leaves nothing counted). ``unopened``: consumer ranks the caller knows never opened their payload. A tagged payload
        tells by its state word; an untagged one (SGLang's) only the caller can tell.
        """
        if self.released:
            return
        missing = [r for r in range(len(self.payloads)) if self.states[r] is not None
                   and self.state(r) != ACKED]
        # A payload nobody opened still holds the reference its pickling took: give it back, or
        # the segment outlives every process that maps it.
        for i in range(len(self.payloads)):
            rank = self.ranks[i] if self.ranks else i
            tagged = self.states[i] is not None
            if rank in unopened or (tagged and self.state(i) == FRESH):
                for storage in self._shared[i]:
                    add_torch_reference(storage, -1)
        ranks = self.ranks
        self.payloads, self.obj, self._keep, self._shared, self.states = [], None, [], [], []
        self.released = True
        _prune_owned()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
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
    _check_value(obj, "tensor" if isinstance(obj, torch.Tensor) else "", None)
    if tagged and isinstance(obj, dict) and TAG in obj:
        raise HandleError(f"payload dict already has a {TAG!r} key")
    keep: list = []
    states: list[torch.Tensor | None] = []
    shared_per_rank: list[list] = []
    payloads: list = []
    for rank in ranks:
        shared: list = []
        if tagged:
            state = empty_shared(4).view(torch.int32)
            state.zero_()
            states.append(state)
            tag = {"rank": rank, "of": num_consumers, "state": state}
            wire = dict(obj, **{TAG: tag}) if isinstance(obj, dict) else {"tensor": obj, TAG: tag}
        else:
            states.append(None)
            wire = obj
        data = _dump(wire, keep, shared)
        payloads.append(base64.b64encode(data).decode("ascii") if output_str else data)
        shared_per_rank.append(shared)
    return PayloadSet(payloads, obj, states, keep, shared_per_rank, ranks)


# --------------------------------------------------------------------------- consumer side

@dataclass
class Received:
    """What a consumer got from its payload. Call `ack` once it no longer needs the memory."""

    value: Any
    rank: int | None
    _state: torch.Tensor | None = field(default=None, repr=False)

    def ack(self) -> None:
        if self._state is not None:
            self._state[0] = ACKED
            self._state = None
        self.value = None


def _for_each_cpu_storage(obj: Any, fn) -> None:
    seen: set[int] = set()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if o.device.type == "cpu" and st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                fn(st)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)


def open_payload(payload: bytes | str, rank: int | None = None, *, share_again: bool = False) -> Received:
    """Rebuild a payload in this process. ``rank`` is the consuming rank, checked against the tag.

    CPU shared memory is mapped by file, without the producer's ``torch_shm_manager``
    (`map_segment`). ``share_again``: the caller will share the tensors again without a copy
    (`adopt`, a relay such as `hostbuf`): map them through torch's rebuild, which connects this
    process to the producer's manager for its lifetime (harmless between ranks of one job)."""
    data = base64.b64decode(payload) if isinstance(payload, str) else payload
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandleError(f"a payload is bytes or base64 text, got {type(payload).__name__}")
    try:
        obj = _Unpickler(io.BytesIO(data), share_again).load()
    except HandleError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's own errors say little about why
        raise HandleError(f"cannot open payload{'' if rank is None else f' on rank {rank}'}: "
                          f"{type(exc).__name__}: {exc}. Was it released by its producer already "
                          f"(PayloadSet.release), or made in another host's memory?") from exc
    if not (isinstance(obj, dict) and TAG in obj):
        return Received(obj, rank)
    tag = obj.pop(TAG)
    state = tag.get("state") if isinstance(tag, dict) else None
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.int32 and state.numel() == 1
            and isinstance(tag.get("rank"), int)):
        raise HandleError(f"payload's {TAG!r} tag is malformed: {tag!r:.80}")
    error = None
    if rank is not None and rank != tag["rank"]:
        error = f"payload for infer-TP rank {tag['rank']} (of {tag['of']}) opened by rank {rank}"
    elif int(state[0]) != FRESH:
        error = (f"payload for rank {tag['rank']} opened twice (state "
                 f"{'opened' if int(state[0]) == OPENED else 'acknowledged'})")
    if error is not None:
        # unpickling took the reference meant for the rightful consumer: hand it back
        _for_each_cpu_storage(obj, take_back)
        _for_each_cpu_storage(tag, take_back)
        raise HandleError(error)
    state[0] = OPENED
    value = obj["tensor"] if set(obj) == {"tensor"} else obj
    return Received(value, tag["rank"], state)

