"""Audit H62, memory.py: `empty_cache` hands freed heap memory back to the OS (measured), and
`temp_dirs` counts only the leftover directories of owners that are gone.

A trainer rank's freed heap memory stays in its RSS while glibc keeps it for reuse: free chunks
between live ones are never given back by ``free`` itself, only by ``malloc_trim``, which is why
`empty_cache` calls it (a colocated engine otherwise finds less memory than is free).
"""

from __future__ import annotations

import ctypes

import pytest

from fsdp_sync import memory


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        pytest.skip("not glibc: malloc_trim is glibc's")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return libc


def test_empty_cache_gives_freed_heap_pages_back_to_the_os():
    """48 MiB of 32 KiB heap blocks (below glibc's mmap threshold), every other one then freed:
    each freed block lies between two live ones, a hole, not a free top of the heap, so ``free``
    gives (nearly) none of it back and `empty_cache` gives back each hole's whole pages (28 of its
    32 KiB: 21 MiB in all; asked: >= 16 MiB). (Freeing every block instead, glibc may merge them
    into the top of the heap and trim it at once, as it does where earlier tests left small free
    chunks for the small blocks between them.) Mutant: empty_cache without ``malloc_trim``,
    killed."""
    libc = _glibc()
    size, n = 32 << 10, 1536
    blocks: list = []
    try:
        for _ in range(n):
            p = libc.malloc(size)
            libc.memset(p, 1, size)         # touched: in RSS
            blocks.append(p)
        holes, blocks = blocks[0::2], blocks[1::2]
        for p in holes:
            libc.free(p)
        held = memory.status("self")["rss"]
        memory.empty_cache()
        after = memory.status("self")["rss"]
        assert held - after >= 16 << 20, ((held - after) >> 20, "MiB given back")
    finally:
        for p in blocks:
            libc.free(p)


def test_temp_dirs_counts_the_dead_owners_directories_not_a_live_ones(tmp_path):
    """`memory.temp_dirs` (the soak's and the fault matrix's leftover count): a ``pymp-*`` /
    ``torch-shm-dir-*`` directory is left behind when no live process has a socket bound in it:
    empty (its owner exited) or holding a socket file nobody listens on (its owner was killed); a
    live owner's, its socket bound, is not; other directories are not looked at. Mutant: the
    bound-socket test inverted (live owners counted, dead ones not), killed."""
    import socket

    if memory._bound_socket_dirs() is None:
        pytest.skip("not allowed to see other processes' sockets: only empty directories count")
    for d in ("pymp-live", "pymp-killed", "pymp-exited", "torch-shm-dir-killed", "other"):
        (tmp_path / d).mkdir()
    live = socket.socket(socket.AF_UNIX)
    dead = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    try:
        live.bind(str(tmp_path / "pymp-live" / "listener"))
        live.listen()
        for s, d in zip(dead, ("pymp-killed", "torch-shm-dir-killed")):
            s.bind(str(tmp_path / d / "listener"))
        for s in dead:
            s.close()               # its file stays, bound by nobody: a killed owner's
        (tmp_path / "other" / "x").mkdir()
        assert memory.temp_dirs(str(tmp_path)) == {str(tmp_path / d) for d in
                                                   ("pymp-killed", "pymp-exited", "torch-shm-dir-killed")}
    finally:
        live.close()
