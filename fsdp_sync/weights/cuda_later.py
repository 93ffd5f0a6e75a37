"""CUDA tensors of a tagged payload rebuilt only once its tag has admitted it (`handles.open_payload`).

Opening a CUDA IPC handle is not undone by dropping the tensor: torch's ``rebuild_cuda_tensor``
takes the payload's IPC reference counter, which the storage's death gives back, while the
producer, seeing the payload's state word still fresh, gives it back again (`PayloadSet.release`).
A payload refused for its tag (another rank's, opened twice, released) must therefore open no CUDA
handle at all. `LaterUnpickler` loads a payload with every ``rebuild_cuda_tensor`` call recorded as
an inert `Later` (its arguments, nothing opened); `where` finds each one reachable from the loaded
value (dict values, list and tuple items, ``SimpleNamespace`` attributes: where a payload's tensors
are) and refuses one anywhere else (a dict key, a set, a slice, a tuple on a cycle), before
anything is opened; `rebuild` then opens them, in order, and `put` puts the tensors in their places.

Not here: the tag's checks and the state word (`handles`), the allow-list and the argument checks
of the rebuild itself (`unpickle`, whose wrapper `rebuild` calls).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .shm import HandleError
from .unpickle import RED, Unpickler

__all__ = ["Later", "LaterUnpickler", "where", "rebuild", "put"]


class Later:
    """One ``rebuild_cuda_tensor`` call a payload made, not yet run: the checked wrapper and the
    payload's arguments. Inert: no attribute or state can be set on it (a payload's ``BUILD``)."""

    __slots__ = ("_fn", "_args")

    def __init__(self, fn: Any, args: tuple) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_args", args)

    def __setattr__(self, key: str, value: Any) -> None:
        raise HandleError("payload tried to set an attribute on a CUDA tensor")

    def __setstate__(self, state: Any) -> None:
        raise HandleError("payload tried to set the state of a CUDA tensor; refused")

    def __reduce__(self):
        raise HandleError("a pending CUDA tensor is not picklable")


class _Record:
    """Stands in for ``rebuild_cuda_tensor`` while a payload loads: each call becomes a `Later`."""

    __slots__ = ("_fn", "_calls")

    def __init__(self, fn: Any, calls: list) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_calls", calls)

    def __call__(self, *args: Any) -> Later:
        later = Later(self._fn, args)
        self._calls.append(later)
        return later

    def __setattr__(self, key: str, value: Any) -> None:
        raise HandleError("payload tried to set an attribute on a function it may call")

    def __reduce__(self):
        raise HandleError("a function stand-in is not picklable")


class LaterUnpickler(Unpickler):
    """`unpickle.Unpickler` with its ``rebuild_cuda_tensor`` recorded (``later``), not run."""

    def __init__(self, file: Any, via_manager: bool = False) -> None:
        super().__init__(file, via_manager)
        self.later: list[Later] = []

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name)
        if (module, name) == (RED, "rebuild_cuda_tensor"):
            return _Record(obj, self.later)
        return obj


def where(value: Any) -> list[Later]:
    """The `Later` calls reachable from ``value``, each once, in the order met; raises
    `HandleError` (nothing opened) for one where no tensor belongs or that could not be put back."""
    found: dict[int, Later] = {}
    # by (object, slot): what sits inside a key, a set or a slice is no slot either, however deep
    # (`put` does not go there); an object met both ways is walked both ways
    done: set[tuple[int, bool]] = set()
    open_: set[tuple[int, bool]] = set()

    def walk(o: Any, slot: bool) -> None:
        t = type(o)
        if t is Later:
            if not slot:
                raise HandleError("payload holds a CUDA tensor where no tensor belongs (a dict key, "
                                  "a set, a slice); refused")
            found.setdefault(id(o), o)
            return
        if t in (int, str, float, bool, bytes, type(None), torch.dtype, torch.Size) \
                or isinstance(o, torch.Tensor):
            return
        key = (id(o), slot)
        if key in open_:
            if isinstance(o, tuple):      # a tuple on a cycle cannot be rebuilt with its tensors
                raise HandleError("payload holds a tuple inside itself; refused")
            return
        if key in done:
            return
        open_.add(key)
        if isinstance(o, dict):
            for k, v in o.items():
                walk(k, False)
                walk(v, slot)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, slot)
        elif isinstance(o, types.SimpleNamespace):
            for v in vars(o).values():
                walk(v, slot)
        elif isinstance(o, (set, frozenset)):
            for v in o:
                walk(v, False)
        elif isinstance(o, slice):
            for v in (o.start, o.stop, o.step):
                walk(v, False)
        open_.discard(key)
        done.add(key)

    try:
        walk(value, True)
    finally:
        del walk        # a recursive closure is a cycle: it would keep every tensor until a gc
    return list(found.values())


def rebuild(calls: list[Later]) -> dict[int, torch.Tensor]:
    """Run each call (`unpickle`'s checked ``rebuild_cuda_tensor``): its tensor by the call's id."""
    return {id(c): c._fn(*c._args) for c in calls}


def put(value: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """``value`` with every `Later` replaced by its tensor: dicts, lists and namespaces in place,
    tuples rebuilt (each once, wherever it is referenced)."""
    if not tensors:
        return value
    new: dict[int, Any] = {}
    seen: set[int] = set()

    def swap(o: Any) -> Any:
        t = type(o)
        if t is Later:
            return tensors[id(o)]
        if t in (int, str, float, bool, bytes, type(None), torch.dtype, torch.Size) \
                or isinstance(o, torch.Tensor):
            return o
        if id(o) in new:
            return new[id(o)]
        if id(o) in seen:
            return o
        seen.add(id(o))
        if isinstance(o, dict):
            for k, v in o.items():
                w = swap(v)
                if w is not v:
                    o[k] = w
        elif isinstance(o, list):
            for i, v in enumerate(o):
                w = swap(v)
                if w is not v:
                    o[i] = w
        elif isinstance(o, types.SimpleNamespace):
            for k, v in vars(o).items():
                w = swap(v)
                if w is not v:
                    setattr(o, k, w)
        elif isinstance(o, tuple):
            items = [swap(v) for v in o]
            if any(w is not v for w, v in zip(items, o)):
                new[id(o)] = out = type(o)(items) if type(o) is tuple else type(o)(*items)
                return out
        return o

    try:
        return swap(value)
    finally:
        del swap        # (as in `where`: no cycle keeps the rebuilt tensors)
