"""The receiving half of handle payloads (`handles`): the restricted unpickler and torch's tensor
rebuild functions as a payload may name them, and the CUDA device naming both halves share.

`Unpickler` admits exact ``(module, name)`` pairs only (`_ALLOWED`): builtins, ``SimpleNamespace``,
torch dtypes and sizes, and torch's rebuild functions replaced by wrappers that check every argument
(a CPU segment must be a shared-memory file of this user, a view must lie inside its storage, a
CUDA device is named by its UUID). Mutable classes and the functions a payload may call come in as
stand-ins (`_Cls`, `_Fn`) so a payload's ``BUILD`` cannot set attributes on them. torch's own
reducer and ``rebuild_cuda_tensor`` are taken from under SGLang's ``monkey_patch_torch_reductions``
where it ran (`torch_reduce_tensor`, `torch_rebuild_cuda_tensor`).

Not here: making payloads, their state words and lifetime (`handles`), shared memory (`shm`).
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import pickle
import types
from typing import Any

import torch
from torch.multiprocessing import reductions as _red

from .shm import HandleError, check_segment, empty_storage, map_segment, refcount_lock

# --------------------------------------------------------------------------- CUDA device UUIDs

@functools.lru_cache(maxsize=None)
def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == device:
            return i
    raise HandleError(f"payload names CUDA device {device!r}, which this process cannot see "
                      f"(CUDA_VISIBLE_DEVICES exposes {torch.cuda.device_count()} devices)")


def torch_reduce_tensor():
    """torch's own ``reduce_tensor``. SGLang's ``monkey_patch_torch_reductions`` (applied in the
    caller's process by verl's weight-sync utilities and SGLang's serializer) replaces the module's
    ``reduce_tensor`` with a wrapper that fails on every CPU tensor (IndexError) and keeps torch's
    as ``_reduce_tensor_original``."""
    return getattr(_red, "_reduce_tensor_original", _red.reduce_tensor)


def torch_rebuild_cuda_tensor():
    """torch's own ``rebuild_cuda_tensor`` (the same patch keeps it as
    ``_rebuild_cuda_tensor_original`` and puts SGLang's wrapper under the module's name)."""
    return getattr(_red, "_rebuild_cuda_tensor_original", _red.rebuild_cuda_tensor)


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` with the device named by UUID, and the producer's writes
    waited for on every open. torch makes the current stream wait on the event the producer
    recorded when it shared the storage only where it opens the IPC handle; a storage this process
    still holds (torch's shared-storage cache: an engine worker keeps a per-rank bucket's buffer
    mapped for the whole update, `staging.UpdateStager._keep_mapped`) is handed back without that
    wait, and a copy out of it could read the buffer before the producer's writes of this bucket
    land. Here that wait is made on a cache hit too, with the event of this payload."""
    args = list(args)
    args[6] = device_index(args[6])
    # held across the rebuild, so torch's lookup finds what this one found; the wait is queued
    # first, before torch's hit gives back this payload's reference counter
    held = (_red.storage_from_cache(args[4], (args[7], args[9]))
            if args[7] is not None and args[8] else None)
    if held is not None:
        wait_for_producer(args[6], args[13], args[14])
    return torch_rebuild_cuda_tensor()(*args)


def wait_for_producer(device: int, event_handle: bytes | None, sync_required: bool) -> None:
    """Make ``device``'s current stream wait on the producer's IPC event (what torch's open of a
    CUDA storage does); nothing where the producer synchronized its stream instead (torch does
    once it has made its maximum number of IPC events, and says so by ``sync_required`` False)."""
    if sync_required and event_handle:
        event = torch.cuda.Event.from_ipc_handle(device, event_handle)
        event.wait(torch.cuda.current_stream(device))


# --------------------------------------------------------------------------- unpickling

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


class _Fn:
    """Stands in for a function a payload may call (our wrappers, a bound ``functools.partial``):
    a payload's ``BUILD`` opcode could otherwise set its attributes, in this process for good (a
    function's ``__defaults__``), or reset a partial's function and arguments (its
    ``__setstate__``). Calling it calls the function; nothing of it can be set."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __setattr__(self, key: str, value: Any) -> None:
        raise HandleError("payload tried to set an attribute on a function it may call")

    def __reduce__(self):
        raise HandleError("a function stand-in is not picklable")


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
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise HandleError(f"payload's storage dtype is {type(dtype).__name__}, not a torch dtype")
    # with a dtype the size counts elements: what is mapped (and checked) is size * itemsize bytes
    check_segment(manager, handle, size if dtype is None else size * dtype.itemsize)
    if via_manager or _red.storage_from_cache(torch.UntypedStorage, handle) is not None:
        # a relay that shares the segment again needs torch's own mapping (`adopt`); a segment
        # this process made or mapped through torch is in torch's cache and needs no manager
        with refcount_lock(handle):
            return _red.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size, dtype)
    storage = map_segment(handle, size if dtype is None else size * dtype.itemsize)
    return storage if dtype is None else torch.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                           _internal=True)


def _mapped(out: list, *args, via_manager: bool = False):
    storage = _safe_rebuild_storage_filename(*args, via_manager=via_manager)
    out.append(storage if isinstance(storage, torch.UntypedStorage) else storage._untyped_storage)
    return storage


def _safe_rebuild_storage_empty(cls):
    """An empty storage that cannot grow (`shm.empty_storage`): torch's is resizable, and a
    payload's ``BUILD`` on a tensor made from it grew it to any size (a 300-byte payload allocated
    1.2 GB here)."""
    _cls(cls, (_USTORAGE,), "storage")
    return empty_storage()


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
    return rebuild_cuda_tensor_by_uuid(*args)


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
    from a count: ``bytearray(10**12)`` in a payload would exhaust the receiver's memory. A count
    is anything with ``__index__``: an int, a bool, or a one-element integer tensor the payload
    rebuilt over a segment's bytes."""
    def build(*args: Any) -> Any:
        if any(hasattr(type(a), "__index__") for a in args):
            raise HandleError(f"payload builds {cls.__name__} from a count; refused")
        return cls(*args)

    return build


RED = "torch.multiprocessing.reductions"
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
    (RED, "rebuild_tensor"): _safe_rebuild_tensor,
    (RED, "rebuild_storage_filename"): _safe_rebuild_storage_filename,
    (RED, "rebuild_storage_empty"): _safe_rebuild_storage_empty,
    (RED, "rebuild_typed_storage"): _safe_rebuild_typed_storage,
    (RED, "rebuild_cuda_tensor"): _safe_rebuild_cuda_tensor,
    ("torch.storage", "_load_from_bytes"): _refuse_by_value,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


def _recorded(rebuild: Any, into: list, *args: Any) -> torch.Tensor:
    t = rebuild(*args)
    into.append(t)
    return t


class Unpickler(pickle.Unpickler):
    """Accepts what SGLang's safe deserializer accepts (exact pairs), and nothing of ours.
    ``via_manager``: map shared memory through torch's rebuild (see `open_payload`)."""

    def __init__(self, file: io.BytesIO, via_manager: bool = False) -> None:
        super().__init__(file)
        self._via_manager = via_manager
        self.rebuilt: list[torch.Tensor] = []
        """Every tensor the payload rebuilt (its only way to make one), in order."""
        self.mapped: list[torch.UntypedStorage] = []
        """Every shared-memory storage mapped so far: a load that fails after mapping one gives
        back the reference it took (`handles.open_payload`)."""

    def find_class(self, module: str, name: str):
        # protocols 0-2 write builtins under Python 2's names (``__builtin__.set``, an empty
        # ``bytes``), which Python's own find_class maps back: the same objects, looked up here
        obj = _ALLOWED.get(_compat_pickle.NAME_MAPPING.get((module, name), ("builtins", name))
                           if module == "__builtin__" else (module, name))
        if obj is None:
            raise HandleError(f"payload holds {module}.{name}, which is not on the allow-list "
                              f"(builtin data types, SimpleNamespace, torch dtypes and tensor/storage "
                              f"rebuild functions); refused")
        if obj is _safe_rebuild_storage_filename:
            return _Fn(functools.partial(_mapped, self.mapped, via_manager=self._via_manager))
        if obj is _safe_rebuild_tensor or obj is _safe_rebuild_cuda_tensor:
            return _Fn(functools.partial(_recorded, obj, self.rebuilt))
        return _Fn(obj) if isinstance(obj, types.FunctionType) else obj

    def persistent_load(self, pid: Any):
        raise HandleError("payload holds a persistent id; refused")
