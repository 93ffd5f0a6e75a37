"""One safetensors file checked whole before any of it is used, then read straight into its targets.

`VerifiedFile` opens a file, reads it once through one small reusable buffer (`hf_checkpoint.HASH_CHUNK`),
hashing each chunk as it is read, checks the digest and the header (dtypes, shapes, offsets that fit
the file and do not overlap), and keeps the descriptor open. Its tensors are then `FileTensor`
sources: ``read_into(dst)`` reads a tensor's bytes from that same descriptor straight into ``dst``
(one ``preadv`` into the destination's memory where it is a contiguous CPU tensor), ``load()``
reads it into a new tensor. So an engine can check every file of an update before it changes a
weight, and then copy into the weights without a staging copy of its whole shard: the second read
comes from the page cache the first one warmed (the trainer's writes warmed it first).

What keeps that second read honest: the descriptor stays open from the check to the copy, so a file
removed or renamed meanwhile (keep-N pruning, a swept temp directory) is still the file that was
hashed; `VerifiedFile.check_unchanged` refuses a file whose size, inode or modification time changed
since it was hashed (``record=True``: hashed with no digest to check yet, kept in ``digest``; a
file hashed ahead so under its temp name stands for the published one while `VerifiedFile.is_file`;
``dir_fd``: the file is opened by its name in that open directory, which a rename does not move) (a published version is never rewritten in place; this turns a writer that
breaks that rule into an error before any weight changes, not into mixed weights).

Not here: which files an engine rank reads and what the manifest says (`hf_checkpoint.resolve_ranked`),
checking names against the engine's parameters and applying the writes (the engine's stager).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

from .hf_checkpoint import HASH_CHUNK, SAFETENSORS_DTYPES, CheckpointError, new_hash
from .safetensors_read import header_entries

__all__ = ["VerifiedFile", "FileTensor"]


class FileTensor:
    """One tensor of a `VerifiedFile`: its dtype and shape, and its bytes still in the file.
    ``meta`` is a meta-device tensor of that dtype and shape (for checks that take a tensor)."""

    __slots__ = ("file", "name", "dtype", "shape", "offset", "nbytes")

    def __init__(self, file: "VerifiedFile", name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 offset: int, nbytes: int) -> None:
        self.file, self.name, self.dtype, self.shape = file, name, dtype, shape
        self.offset, self.nbytes = offset, nbytes

    @property
    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy this tensor into ``dst`` (same shape; any device or layout): straight from the
        file into ``dst``'s memory when it is a contiguous CPU tensor of this dtype, else through
        one temporary tensor."""
        if tuple(dst.shape) != self.shape:
            raise ValueError(f"{self.file.path}: tensor {self.name!r} has shape {self.shape}, "
                             f"its destination {tuple(dst.shape)}")
        if self.nbytes == 0:
            return
        if dst.device.type == "cpu" and dst.dtype == self.dtype and dst.is_contiguous():
            self.file.pread_into(dst.reshape(-1).view(torch.uint8), self.offset, self.name)
        else:
            dst.copy_(self.load())

    def load(self) -> torch.Tensor:
        """This tensor as a new CPU tensor."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            self.file.pread_into(out.reshape(-1).view(torch.uint8), self.offset, self.name)
        return out


class VerifiedFile:
    """A safetensors file read once, hashed as it is read and checked against ``expected`` (when
    not None) under ``hash`` in reads of ``chunk`` bytes, its header checked; the descriptor stays
    open until `close`.
    ``tensors``: name -> `FileTensor`; ``size``: the bytes read. Raises `CheckpointError` for a
    checksum mismatch, a read that fails or comes up short, or a header that does not describe
    the file's data (nothing stays open then)."""

    def __init__(self, path: str, expected: str | None, hash: str = "sha256", *,
                 chunk: int = HASH_CHUNK, record: bool = False, dir_fd: int | None = None) -> None:
        self.path = path
        self.fd = -1
        self.tensors: dict[str, FileTensor] = {}
        self.hash = hash
        self.digest: str | None = None      # what it hashed to (with ``expected`` or ``record``)
        try:
            self.fd = os.open(path if dir_fd is None else os.path.basename(path),
                              os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
            st = os.fstat(self.fd)
            self._stamp = _stamp(st)
            self.size = st.st_size
            head = self._hash_whole(expected, hash, max(8, int(chunk)), record)
            self._parse(head)
        except OSError as exc:
            self.close()
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _hash_whole(self, expected: str | None, hash: str, chunk: int, record: bool) -> bytes:
        """Read every byte once through one chunk-sized buffer, hashing it; returns the leading
        bytes that hold the header (u64 length + JSON)."""
        h = new_hash(hash) if expected is not None or record else None
        buf = bytearray(min(chunk, max(self.size, 1)))
        view = memoryview(buf)
        head = bytearray()
        need, got = 8, 0
        while got < self.size:
            n = os.readv(self.fd, [view[:min(len(buf), self.size - got)]])
            if not n:
                break
            chunk = view[:n]
            if h is not None:
                h.update(chunk)
            while len(head) < need and len(head) < got + n:    # the header: file bytes [0, need)
                head += chunk[len(head) - got:need - got]
                if need == 8 and len(head) == 8:
                    need = 8 + struct.unpack("<Q", bytes(head))[0]
                    if need > self.size:
                        raise CheckpointError(f"{self.path} is not a well-formed safetensors file: "
                                              f"header of {need - 8} bytes does not fit a file of "
                                              f"{self.size}")
            got += n
        if got != self.size:
            raise CheckpointError(f"{self.path} shrank while being read ({got} of {self.size} bytes)")
        if h is not None:
            digest = self.digest = h.hexdigest()
            if expected is not None and digest != expected:
                raise CheckpointError(
                    f"checksum mismatch for {self.path} ({self.size} bytes): the manifest says "
                    f"{hash} {expected[:16]}..., the file has {digest[:16]}... (torn or corrupt file)")
        if len(head) < need:
            raise CheckpointError(f"{self.path} is not a well-formed safetensors file: "
                                  f"{self.size} bytes hold no safetensors header")
        return bytes(head)

    def _parse(self, head: bytes) -> None:
        try:
            header = json.loads(head[8:])
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            base = len(head)
            data = self.size - base
            spans = []
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                code, shape, (a, b) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
                dtype = SAFETENSORS_DTYPES.get(code)
                if dtype is None or min(shape, default=0) < 0 or not (0 <= a <= b <= data) \
                        or b - a != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"tensor {name!r}: dtype {code}, shape {list(shape)}, offsets [{a}, {b})")
                spans.append((a, b))
                self.tensors[name] = FileTensor(self, name, dtype, shape, base + a, b - a)
            spans.sort()
            if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
                raise ValueError("tensors overlap")
            header_entries(header, data)   # and the rest of safetensors' rules (as SGLang reads)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path} is not a well-formed safetensors file: {exc}") from exc

    def pread_into(self, out: torch.Tensor, offset: int, name: str) -> None:
        """Read ``out.numel()`` bytes at ``offset`` into the uint8 CPU tensor ``out``."""
        view = memoryview(out.numpy())
        done = 0
        try:
            while done < len(view):
                n = os.preadv(self.fd, [view[done:]], offset + done)
                if not n:
                    break
                done += n
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {name!r} of {self.path}: {exc}") from exc
        if done != len(view):
            raise CheckpointError(f"{self.path} shrank after it was checked (tensor {name!r}: "
                                  f"{done} of {len(view)} bytes)")

    def is_file(self, path: str, expected: str, hash: str) -> bool:
        """``path`` is this file as it was hashed (same device, inode, size and modification time,
        as `check_unchanged` asks) and it hashed to ``expected`` under ``hash``: what lets a file
        hashed ahead, under its temp name, stand for the published one without a second pass."""
        try:
            same = _stamp(os.stat(path)) == self._stamp == _stamp(os.fstat(self.fd))
        except OSError:
            return False
        return same and self.fd >= 0 and self.hash == hash and self.digest == expected

    def check_unchanged(self) -> None:
        """Raise `CheckpointError` if the file changed since it was hashed (size, inode, mtime)."""
        try:
            now = _stamp(os.fstat(self.fd))
        except OSError as exc:
            raise CheckpointError(f"cannot check {self.path}: {exc}") from exc
        if now != self._stamp:
            raise CheckpointError(f"{self.path} changed after it was checked (size, inode or "
                                  f"modification time); a published version must not be "
                                  f"rewritten; nothing was loaded")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "VerifiedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
