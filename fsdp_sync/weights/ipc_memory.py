"""CUDA memory another process can open: expandable segments off while a sync allocates what it shares.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (verl's workers, and many trainers, run
so) torch's caching allocator carves blocks out of virtual-memory segments. torch (2.5 on) shares
such a block (`torch.UntypedStorage._share_cuda_`, handle type ``'e'``) as a POSIX file descriptor
that the consumer copies out of the producer with ``pidfd_getfd``, or as a fabric handle (an IMEX
channel). ``pidfd_getfd`` needs ptrace rights over the producer: Yama's ``ptrace_scope=1`` (the
Ubuntu default) refuses it to a child (a reference engine's worker is the trainer rank's child) and
container seccomp profiles commonly deny it; torch's own tests of that path are skipped on some
GPUs. A block of an ordinary segment goes as a ``cudaIpcMemHandle`` (handle type ``'c'``), which
every colocated engine opens. torch's allocator honours the setting turned off for a while (its
``get_free_block``: "since we cannot share expandable memory via IPC, someone might temporarily
disable it"): what is allocated meanwhile comes from ordinary segments, and cached expandable blocks
are not handed out. verl and SGLang switch it the same way around their own updates.

- `shareable`: a context in which CUDA allocations are shareable by ``cudaIpcMemHandle``; it turns
  expandable segments off only where they are known to be on (and back on after), nests, and does
  nothing without CUDA.
- `is_expandable_handle`: whether a share handle torch made names an expandable segment (a tensor
  allocated before the switch, or where the setting could not be read), which `handles` then
  copies into memory allocated under `forced_off`.

Not here: when SGLang's own memory is resumed and released (`engines.sglang.allocator`), the
handles themselves (`handles`).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["allocator_settings", "set_allocator_settings", "says_on", "expandable_segments_state",
           "shareable", "forced_off", "is_expandable_handle", "cuda_in_use", "SWITCHED"]

# torch's share handle (c10 CUDACachingAllocator shareIpcHandle, torch 2.5 on): a version byte,
# then 'c' (cudaMalloc: a cudaIpcMemHandle follows) or 'e' (an expandable segment's handles)
_HANDLE_VERSION, _EXPANDABLE = 2, ord("e")

# a sync's ``stats.extra["expandable_segments"]`` where `shareable` switched them
SWITCHED = "off during the sync (CUDA IPC handles)"

_lock = threading.Lock()
_depth = 0           # how many `shareable` contexts are open in this process
_switched = False    # whether the outermost one turned expandable segments off
_last_set: str | None = None   # the expandable_segments value set through this module, if any
_left_off = False              # `forced_off` said so once
_log = logging.getLogger(__name__)


def allocator_settings() -> str:
    """The CUDA allocator's settings as torch holds them now. torch 2.11 and before have no getter
    (2.13 has): there, the environment's, with the expandable-segments value this module last set (a
    setting changed by another library's call to torch's setter is not seen)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    current = getter() if getter is not None else ""
    if current:
        return current
    env = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    if _last_set is None:
        return env
    kept = [kv for kv in env.split(",") if kv.split(":")[0].strip() != "expandable_segments"]
    return ",".join([kv for kv in kept if kv.strip()] + [f"expandable_segments:{_last_set}"])


def set_allocator_settings(value: str) -> None:
    """Change the named allocator settings of this process (the others keep their values)."""
    global _last_set
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(value)
    for kv in value.split(","):
        key, _, val = kv.partition(":")
        if key.strip() == "expandable_segments":
            _last_set = val.strip()


def says_on(settings: str) -> bool:
    """Whether an allocator settings string turns expandable segments on."""
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def expandable_segments_state() -> bool | None:
    """Expandable segments on (True), off (False), or unknown (None). torch 2.13 reads its setting
    back; before, only a value this module set is known: the environment may say on while a
    library switched them off through torch's own setter (verl does around its updates), and
    turning them back on under it would undo that."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return says_on(getter())
    if _last_set is not None:
        return _last_set.lower() == "true"
    return None


def cuda_in_use() -> bool:
    """CUDA is there and this process has used it (nothing was allocated on it otherwise)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextmanager
def shareable(device: torch.device | str | None = None) -> Iterator[bool]:
    """CUDA blocks allocated inside are shareable as ``cudaIpcMemHandle``: expandable segments are
    off within, where they were on and ``device`` (None: any) is a CUDA device. Yields whether this
    context switched them (an inner one, or one where they were off, switches nothing). Restored
    on the way out, also when the body raised. The setting is the process's: another thread
    allocating meanwhile gets ordinary segments too."""
    global _depth, _switched
    if device is not None and torch.device(device).type != "cuda":
        yield False
        return
    with _lock:
        _depth += 1
        switched = _depth == 1 and cuda_in_use() and expandable_segments_state() is True
        if switched:
            set_allocator_settings("expandable_segments:False")
            _switched = True
    try:
        yield switched
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _switched:      # the last one out, in whichever thread
                _switched = False
                set_allocator_settings("expandable_segments:True")


@contextmanager
def forced_off() -> Iterator[None]:
    """Expandable segments off around an allocation that must be shareable, whatever the state
    (a tensor to share was just found in an expandable segment). Turned back on after only where
    they were known to be on; where the state is unknown (torch 2.11 and before, set through
    torch by someone else) they stay off, torch's default, and a warning says so once."""
    global _left_off
    with _lock:
        before = expandable_segments_state()
        set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        with _lock:
            if before is True and not _switched:
                set_allocator_settings("expandable_segments:True")
            elif before is None and not _left_off:
                _left_off = True
                _log.warning("fsdp_sync: CUDA expandable segments turned off for this process: a "
                             "tensor to share by CUDA IPC was in one (a consumer opens such a block "
                             "only with ptrace rights over this process), and this torch cannot "
                             "tell whether something else had turned them off; torch 2.13 can, "
                             "or leave expandable_segments out of PYTORCH_CUDA_ALLOC_CONF")


def is_expandable_handle(handle: object) -> bool:
    """Whether ``handle`` (a CUDA storage's share handle, the 8th field of torch's
    ``rebuild_cuda_tensor`` arguments) names a block of an expandable segment."""
    return (isinstance(handle, bytes) and len(handle) >= 2 and handle[0] == _HANDLE_VERSION
            and handle[1] == _EXPANDABLE)
