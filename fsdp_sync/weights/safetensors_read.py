"""Reading safetensors files without a copy of the whole file: `SliceReader` (slices of a file's
tensors, each a fresh tensor), safetensors' dtype codes (`SAFETENSORS_DTYPES`), the library's
own checks of a header (`header_entries`, which every reader here applies) and the error every
checkpoint check raises (`CheckpointError`). Split out of `hf_checkpoint`, which re-exports them.

Not here: which files a checkpoint directory loads, digests and manifests (`hf_checkpoint`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Any

import torch

__all__ = ["SAFETENSORS_DTYPES", "CheckpointError", "SliceReader", "header_entries"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    k: v for k, v in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U8": torch.uint8, "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    }.items() if v is not None
}
"""safetensors' dtype codes (``safe_open(...).get_slice(n).get_dtype()``) as torch dtypes."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded as it is; the message names the file or tensor."""


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1}
"""Bytes per element of safetensors' dtype codes (those torch lacks too: their sizes are checked)."""


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def header_entries(header: Any, data_bytes: int) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """A parsed safetensors header checked as the safetensors library checks it before it reads a
    byte (``safe_open``, which SGLang's loaders use), so that no reader here takes a file that
    SGLang refuses: a JSON object; ``__metadata__`` (if any) an object of strings; per tensor a
    string ``dtype``, a ``shape`` of ints >= 0 and ``data_offsets`` of two ints; in offset order
    the tensors follow each other from byte 0 and end exactly at ``data_bytes`` (no gap, no
    trailing bytes), each its shape's size in a dtype of known size. Returns (name, dtype code,
    shape, begin, end) in file order; raises `ValueError` naming what is wrong (the readers add
    the path). Before, a float offset or dimension (``2.0``, ``2.5``), a gap between tensors,
    trailing bytes or a non-string metadata value passed the readers here."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"__metadata__ is not an object of strings: {meta!r:.80}")
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(code, str) or not isinstance(shape, list) or not all(map(_count, shape)) \
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets)):
            raise ValueError(f"tensor {name!r}: dtype {code!r}, shape {shape!r}, data_offsets "
                             f"{offsets!r} (a dtype string, ints >= 0 and two ints)")
        out.append((name, code, tuple(shape), offsets[0], offsets[1]))
    out.sort(key=lambda e: (e[3], e[4]))
    at = 0
    for name, code, shape, a, b in out:
        if a != at or b < a:
            raise ValueError(f"tensor {name!r}: data_offsets [{a}, {b}) do not start where the "
                             f"tensor before ends ({at}): gaps and overlaps are refused")
        if code in _ITEMSIZE and b - a != math.prod(shape) * _ITEMSIZE[code]:
            raise ValueError(f"tensor {name!r}: data_offsets [{a}, {b}) hold {b - a} bytes, its "
                             f"dtype {code} and shape {list(shape)} {math.prod(shape) * _ITEMSIZE[code]}")
        at = b
    if at != data_bytes:
        raise ValueError(f"the tensors take {at} data bytes, the file holds {data_bytes}")
    return out


class SliceReader:
    """Slices of the tensors of one safetensors file, each read as a fresh tensor.

    ``with SliceReader(path) as r``: ``r.keys()``, ``r.dtype_code(name)`` (safetensors' code,
    e.g. ``"F32"``), ``r.shape(name)``, ``r.read(name, index)`` (``tensor[index]`` as a new
    contiguous tensor; only the pages it touches are read).

    ``SliceReader(path, data=buf)``: the file's bytes are already in memory (`read_hashed`: read
    once and checked against the manifest), so the header and the slices come from ``buf``, the
    very bytes that were hashed; the file is not opened again (``r.in_memory`` is True).

    Why not ``safe_open(...).get_slice(name)[index]``: with safetensors 0.8.0 and torch 2.13 every
    tensor that path creates leaves two small Python objects behind (about 57 bytes; measured with
    tracemalloc, the numpy framework and ``safetensors.torch.load`` do not), which an engine worker
    reloading a checkpoint each sync accumulates for ever. So ``safe_open`` validates the file and
    gives the names (it parses the header and checks that every tensor's offsets lie inside the
    file), and the bytes are read here: the header's ``data_offsets`` into one copy-on-write mmap
    of the same file, checked again (`header_entries`: safetensors' own rules, also for ``data``,
    which ``safe_open`` never sees). Raises `CheckpointError` naming the file for a header that
    does not describe its data.
    """

    def __init__(self, path: str, data: torch.Tensor | None = None):
        self.path = path
        self.in_memory = data is not None
        self._data = data
        self._file = None
        self._mm: Any = None
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}

    def _header(self) -> tuple[list[str], int, Any, int]:
        """(tensor names, file size, parsed header, header bytes) from the file or from ``data``."""
        if self._data is not None:
            view = memoryview(self._data.numpy())
            size = len(view)
            if size < 8:
                raise CheckpointError(f"{self.path}: {size} bytes hold no safetensors header")
            (n,) = struct.unpack("<Q", view[:8])
            if n > size - 8:
                raise CheckpointError(f"{self.path}: header of {n} bytes does not fit the file ({size} bytes)")
            try:
                header = json.loads(bytes(view[8:8 + n]))
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: the header is not JSON ({exc})") from exc
            if not isinstance(header, dict):
                raise CheckpointError(f"{self.path}: the header is not a JSON object")
            self._mm = view
            return [k for k in header if k != "__metadata__"], size, header, n
        from safetensors import safe_open

        try:
            with safe_open(self.path, framework="pt", device="cpu") as f:   # the library's validation
                names = list(f.keys())
        except Exception as exc:   # noqa: BLE001 - SafetensorError, OSError: this file, named
            raise CheckpointError(f"{self.path} is not a well-formed safetensors file: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        (n,) = struct.unpack("<Q", self._file.read(8))
        if n > size - 8:
            raise CheckpointError(f"{self.path}: header of {n} bytes does not fit the file ({size} bytes)")
        return names, size, json.loads(self._file.read(n)), n

    def __enter__(self) -> "SliceReader":
        try:
            names, size, header, n = self._header()
            base = 8 + n
            for name in names:
                e = header.get(name) if isinstance(header, dict) else None
                try:
                    code, shape = str(e["dtype"]), tuple(int(x) for x in e["shape"])
                    begin, end = (int(x) for x in e["data_offsets"])
                except (TypeError, KeyError, ValueError) as exc:
                    raise CheckpointError(f"{self.path}: header entry for {name!r} is malformed "
                                          f"({type(exc).__name__}: {exc})") from exc
                dtype = SAFETENSORS_DTYPES.get(code)
                if not (0 <= begin <= end <= size - base) or (
                        dtype is not None and end - begin != math.prod(shape) * dtype.itemsize):
                    raise CheckpointError(f"{self.path}: tensor {name!r} ({code}, shape {shape}) has "
                                          f"data offsets [{begin}, {end}) that do not fit the file's "
                                          f"{size - base} data bytes")
                self._entries[name] = (code, shape, base + begin, end - begin)
            try:       # and the rest of safetensors' rules (``data``: no safe_open saw it)
                header_entries(header, size - base)
            except ValueError as exc:
                raise CheckpointError(f"{self.path} is not a well-formed safetensors file: {exc}") from exc
            if self._data is None:
                self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            self._mm.close()
        self._mm, self._data = None, None
        if self._file is not None:
            self._file.close()
            self._file = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype_code(self, name: str) -> str:
        return self._entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str, index: Any = ()) -> torch.Tensor:
        """``tensor[index]`` as a new contiguous tensor (the file's dtype must be a torch dtype)."""
        code, shape, offset, nbytes = self._entries[name]
        dtype = SAFETENSORS_DTYPES[code]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)[index].clone()
        view = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        out = view.view(dtype).view(shape)[index].clone(memory_format=torch.contiguous_format)
        del view   # the mmap closes only when no tensor views it
        return out
