"""glibc's mmap threshold pinned in the bench's trainer rank processes, so that what a sync frees
leaves their RSS and the rows' ``peak_extra_bytes`` measure what the sync holds, not what glibc keeps.

glibc serves an allocation of at least its mmap threshold (128 KiB at start) with a mapping of its
own, returned to the OS on free; but each time such a block is freed it raises the threshold to
that block's size (up to 32 MiB), after which blocks that size come from its heap, whose freed
pages stay in the process's RSS. A sync gathers tensors and buckets of a few MiB and frees them:
on `small` at 2 and 8 MiB buckets the bucketed rows read 34-36 MiB against their 24 MiB budget,
16.6-16.8 MiB with the threshold pinned. Setting it explicitly (``mallopt``) turns that adjustment
off, as the reference engine's workers do for their weights (`engines.reference.worker`).

The bench is the project's own tool and its rank processes are its own; a library does not change
its user's allocator, so `FSDPShardingManager` leaves a trainer's as it is.

Not here: the sampling (`sampling`), the budgets (`methods.memory_budget`).
"""

from __future__ import annotations

import ctypes

__all__ = ["MMAP_THRESHOLD", "pin_malloc"]

MMAP_THRESHOLD = 128 * 1024
"""The pinned threshold (and trim threshold), bytes: glibc's own starting value."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3     # mallopt's parameter numbers (malloc.h)


def pin_malloc() -> int | None:
    """Make glibc serve every allocation >= `MMAP_THRESHOLD` with its own mapping, and keep it so
    (its trim threshold set alike: freed heap tops above it go back at once). Returns the pinned
    threshold in bytes, or None where the C library is not glibc (nothing to pin)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):       # not glibc
        return None
    return MMAP_THRESHOLD if ok else None
