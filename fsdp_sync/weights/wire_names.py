"""Wire classes: classes of another process, named on the wire without being importable here.

`wire_class(module, name)` makes a class whose instances `handles`' pickler writes as instances of
``module.name`` (e.g. SGLang's ``LocalSerializedTensor`` under the path of the server's release),
their ``__dict__`` as state. `handles` re-exports both names.

Not here: the pickler that writes them, or any unpickling (`handles`, `unpickle`: our receiver
admits no wire class).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["WireClass", "wire_class"]


class WireClass(type):
    """The type of a class that stands in for another process's class: its instances are pickled
    as instances of ``wire_module.wire_name`` (that name, their ``__dict__`` as state), which this
    process need not be able to import (`wire_class`)."""

    wire_module: str
    wire_name: str


@functools.lru_cache(maxsize=None)
def wire_class(module: str, name: str) -> WireClass:
    """A class whose instances (made with keyword fields, kept in ``__dict__``) unpickle as
    instances of ``module.name`` in the receiving process: e.g. SGLang's ``LocalSerializedTensor``
    under the path of the release a server runs, not the trainer's (`engines.sglang`)."""
    def __init__(self: Any, **fields: Any) -> None:
        self.__dict__.update(fields)

    cls = WireClass(name, (), {"__init__": __init__, "__module__": module, "__qualname__": name})
    cls.wire_module, cls.wire_name = module, name
    return cls
