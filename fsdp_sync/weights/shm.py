"""CPU shared memory by file: torch's ``/dev/shm/torch_*`` segments, opened without their maker's
``torch_shm_manager``.

`handles` makes and opens payloads; this module is what it does with one shared-memory segment:
check that a handle names an existing torch segment of this user (`check_segment`), map it by its
file in /dev/shm keeping torch's reference count in the segment's 64-byte header under a file lock
(`map_segment`, `add_reference`, `take_back`), so a consumer never connects to (and keeps alive)
the producer's manager; and start this process's own manager with /dev/null for its stdio
(`start_shm_manager_detached`), so it never holds a caller's pipe open.

Not here: payloads, pickling and the wire checks (`handles`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import stat
import sys
import time

import torch
from torch.multiprocessing import reductions as _red

__all__ = ["HandleError", "check_segment", "map_segment", "mapped_handle", "add_reference",
           "add_torch_reference", "take_back", "refcount_lock", "keep_sockets_from_shm_manager",
           "start_shm_manager_detached", "remove_dead_manager_dirs", "new_shared_storage", "MANAGER_TIMEOUT",
           "empty_storage"]


class HandleError(RuntimeError):
    """A payload could not be made, opened or released; the message names the tensor or rank."""



_SOCKETS_KEPT_FROM_MANAGER = False


def keep_sockets_from_shm_manager() -> None:
    """Mark this process's sockets close-on-exec, once, before it first makes shared memory.

    torch starts one ``torch_shm_manager`` per process (fork, then exec) the first time the process
    makes shared memory by file name, and the manager inherits every descriptor not marked
    close-on-exec: gloo's connections and the c10d store's are not. The manager then held a
    trainer rank's connections open after the rank died, so its peers, which see a closed
    connection at once, waited out the process-group timeout instead (`fsdp-sync faults`: a trainer
    rank 0 killed after the first sync: 6 s, the matrix's timeout, instead of 0.01 s). A running
    process never needs its sockets inherited through exec (multiprocessing and subprocess pass
    the descriptors they mean to pass explicitly)."""
    global _SOCKETS_KEPT_FROM_MANAGER
    if _SOCKETS_KEPT_FROM_MANAGER:
        return
    _SOCKETS_KEPT_FROM_MANAGER = True
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return                  # not Linux: nothing known to fix
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.set_inheritable(fd, False)
        except OSError:
            continue            # closed meanwhile (e.g. the listing's own descriptor)
    remove_dead_manager_dirs()
    start_shm_manager_detached()


def remove_dead_manager_dirs(root: str | None = None, min_age_s: float = 60.0) -> list[str]:
    """Remove, in the temp directory, this user's ``torch-shm-dir-*`` directories whose
    ``torch_shm_manager`` was killed; returns what was removed.

    A manager removes its directory when it exits, not when it is killed: Ray kills a worker's
    child processes when the worker exits (``RAY_kill_child_processes_on_worker_exit``), so every
    verl rollout worker that used shared memory left one behind (issue 21 item 14). Each manager
    has its own directory, so one whose ``manager.sock`` is at least ``min_age_s`` old (one just
    bound may not listen yet) and refuses a connection (nothing listens: a live manager listens
    until it exits) is dead, and so is one left empty for ``min_age_s`` (a starting manager makes
    its directory a moment before its socket). multiprocessing's ``pymp-*`` directories are not
    touched: one belongs to a process for its whole life and may hold a dead listener's socket
    while the process still uses it (its forkserver restarts there). Called once per process,
    before this process starts its own manager."""
    import glob
    import socket
    import tempfile
    import time

    removed = []
    for d in glob.glob(os.path.join(root or tempfile.gettempdir(), "torch-shm-dir-*")):
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            names = os.listdir(d)
            now = time.time()
            if not names:
                if now - st.st_mtime < min_age_s:
                    continue
            else:
                sock = os.path.join(d, "manager.sock")
                if names != ["manager.sock"] or not stat.S_ISSOCK(os.lstat(sock).st_mode) \
                        or now - os.lstat(sock).st_mtime < min_age_s:
                    continue     # not the shape a killed manager leaves, or too young to judge
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    try:
                        c.connect(sock)
                        continue                    # a live manager
                    except ConnectionRefusedError:
                        pass
                os.unlink(sock)
            os.rmdir(d)
            removed.append(d)
        except OSError:
            continue             # gone meanwhile, not ours, or not empty after all
    return removed


MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
"""What torch raises when its ``torch_shm_manager`` did not answer a segment's registration within
its fixed 1 s (libshm's socket poll): the manager was not scheduled in time on a busy host."""
MANAGER_TRIES = 3


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A new shared-memory storage by file name, registered with this process's
    ``torch_shm_manager``. A registration the manager did not answer within torch's 1 s
    (`MANAGER_TIMEOUT`) is tried again, `MANAGER_TRIES` times in all: torch creates no segment
    for it (the file is made only after the registration is answered) and names each try's segment
    afresh, so nothing is left or shared twice; any other error is raised at once."""
    for attempt in range(1, MANAGER_TRIES + 1):
        try:
            return torch.UntypedStorage._new_using_filename_cpu(nbytes)
        except RuntimeError as exc:
            if MANAGER_TIMEOUT not in str(exc):
                raise
            if attempt == MANAGER_TRIES:
                raise RuntimeError(f"{MANAGER_TIMEOUT} ({MANAGER_TRIES} tries for a {nbytes}-byte "
                                   f"segment: torch_shm_manager did not answer within torch's 1 s "
                                   f"each time; the host is overloaded)") from exc
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def start_shm_manager_detached() -> None:
    """Start this process's ``torch_shm_manager`` now, with /dev/null as its stdin and stderr.

    The manager also inherits those two (its stdout is torch's own pipe). It outlives this process
    while another process still holds a segment it handed out (a served engine that opened this
    process's payloads keeps its connection to the manager until it exits), and with the process's
    stderr it kept a pipe open: ``client 2>&1 | tail`` never ended (issue 21 item 5). Stdio is
    pointed at /dev/null only around the one allocation that starts the manager (a few ms; the
    Python streams are flushed first)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    saved: list[tuple[int, int]] = []
    try:
        for fd in (0, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:
                continue        # not open: nothing to keep from the manager
            os.dup2(null, fd)
        new_shared_storage(1)     # starts the manager; freed at once
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


# torch's names (``/torch_<pid>_<random>_<counter>``, made by libshm) and its segments' header
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_SHM_DIR = "/dev/shm"
_SHM_HEADER = 64      # torch's refcounted segments hold a 64-byte counter before the data


def check_segment(manager: bytes, handle: bytes, size: int) -> None:
    """A storage handle may name only a live torch segment of this user, large enough for what it
    asks, through a torch shm-manager socket. Otherwise the receiver would open ``/proc`` or
    file paths or another user's memory, or grow (ftruncate) a
    segment to a forged size and fault on reading past its end."""
    m = _SHM_NAME.fullmatch(handle)
    if m is None:
        raise HandleError(f"payload's storage names shared-memory object {handle[:80]!r}, which is not "
                          f"a torch segment name (/torch_<pid>_<n>_<n>); refused (a path, /proc, or "
                          f"another program's segment)")
    mgr = os.fsdecode(manager)
    if (os.path.basename(mgr) != "manager.sock"
            or not os.path.basename(os.path.dirname(mgr)).startswith("torch-shm-dir-")
            or ".." in mgr.split("/")):
        raise HandleError(f"payload's shm manager {mgr[:80]!r} is not a torch shm-manager socket "
                          f"(<tmp>/torch-shm-dir-*/manager.sock); refused")
    if not 0 <= size < 1 << 48:
        raise HandleError(f"payload's storage {handle.decode()} has size {size}; refused")
    path = os.path.join(_SHM_DIR, handle.decode()[1:])
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise HandleError(f"payload's storage names segment {handle.decode()}, which does not exist: "
                          f"released by its producer already (PayloadSet.release), or made on another "
                          f"host") from None
    if not stat.S_ISREG(st.st_mode):
        raise HandleError(f"payload's storage {handle.decode()} is not a regular shared-memory segment")
    if st.st_uid != os.geteuid():
        raise HandleError(f"payload's storage names segment {handle.decode()}, owned by uid "
                          f"{st.st_uid}, not by this process's uid {os.geteuid()}: another user's "
                          f"memory; refused")
    if size + _SHM_HEADER > st.st_size:
        raise HandleError(f"payload's storage asks for {size} bytes of segment {handle.decode()}, which "
                          f"holds {max(st.st_size - _SHM_HEADER, 0)}: a forged size; refused")


# --------------------------------------------------------------------------- opening segments by file

# Segments this process mapped by file (`map_segment`): by handle, so that a buffer the sender
# reuses bucket after bucket maps once while it stays mapped (as torch's shared-storage cache does
# for its own mappings), and by data pointer, so that `adopt` can refuse them.
_MAPPED: dict[bytes, "_red.StorageWeakRef"] = {}
_MAPPED_PTRS: dict[int, tuple[bytes, "_red.StorageWeakRef"]] = {}


def segment_path(handle: bytes) -> str:
    return os.path.join(_SHM_DIR, handle.decode()[1:])


@contextlib.contextmanager
def refcount_lock(handle: bytes):
    """Hold an exclusive lock on a segment's file while this process changes its reference count.

    Every change this module makes (pickling's increment, `map_segment`'s give-back,
    `PayloadSet.release`'s decrements) holds this lock, so two of ours never interleave, and
    `handles` turns a state word fresh into opened or revoked under it. torch's own changes (a
    storage's creation, the mapping torch's rebuild makes, a storage's last close) do not take it
    and may come at any time (a relay rank's mapping of a `hostbuf` buffer closes while an engine worker
    opens another rank's payload of it): `add_reference` changes the count with the same atomic
    add torch uses (`_fetch_add`), so neither loses the other's change."""
    try:
        fd = os.open(segment_path(handle), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield                   # unlinked already: nobody can change its count any more
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)            # (releases the lock)


def map_segment(handle: bytes, size: int) -> torch.UntypedStorage:
    """Open a torch shared-memory segment by its file in /dev/shm, without its producer's manager.

    torch's ``rebuild_storage_filename`` connects this process to the producer's
    ``torch_shm_manager`` and libshm keeps that connection for the life of the process, so the
    manager of every producer a long-lived consumer ever heard from (each HTTP client of ``fsdp-sync
    serve``) lived on until the consumer exited: one process per client run (issue 21 item 5). The
    manager has nothing to do for a consumer (it unlinks a segment only when all its clients are
    gone); the reference count in the segment's 64-byte header does the work, and is kept here as
    torch keeps it: the reference pickling took for this consumer is given back as soon as the
    segment is mapped (the mapping needs its name no longer; the memory stays until the last
    mapping goes), and the last reference unlinks the name, as torch's last close does.

    The mapping holds one descriptor (Python's mmap keeps a duplicate) and both go when the last
    tensor on the storage is freed."""
    ref = _MAPPED.get(handle)
    if ref is not None:
        cached = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        if cached is not None:
            add_reference(handle, -1)
            return cached
    if size == 0:
        add_reference(handle, -1)
        return empty_storage()
    try:
        fd = os.open(segment_path(handle), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HandleError(f"payload's storage names segment {handle.decode()}, which does not exist: "
                          f"released by its producer already (PayloadSet.release)") from None
    try:
        st = os.fstat(fd)       # what was checked by name is what was opened
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < size + _SHM_HEADER:
            raise HandleError(f"payload's segment {handle.decode()} changed after it was checked; refused")
        mapping = mmap.mmap(fd, size + _SHM_HEADER)
    finally:
        os.close(fd)
    storage = torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=_SHM_HEADER).untyped_storage()
    add_reference(handle, -1, mapping)
    for k in [k for k, r in _MAPPED.items() if r.expired()]:
        del _MAPPED[k]
    for k in [k for k, (_, r) in _MAPPED_PTRS.items() if r.expired()]:
        del _MAPPED_PTRS[k]
    ref = _red.StorageWeakRef(storage)
    _MAPPED[handle], _MAPPED_PTRS[storage.data_ptr()] = ref, (handle, ref)
    return storage


def empty_storage() -> torch.UntypedStorage:
    """A storage of no bytes that cannot grow: torch's own (``UntypedStorage()``) is resizable, and
    a payload's ``BUILD`` on a tensor made from it calls ``Tensor.__setstate__``, whose
    ``set_(storage, offset, size, stride)`` grows it to any size (a payload of a few hundred bytes
    allocated gigabytes). Made from a one-byte buffer (``torch.frombuffer`` storages are not
    resizable), whose one byte no view of no elements reads."""
    return torch.frombuffer(bytearray(1), dtype=torch.uint8)[:0].untyped_storage()


def add_reference(handle: bytes, delta: int, mapping: mmap.mmap | None = None) -> None:
    """Add ``delta`` to a segment's reference count (under `refcount_lock`); at zero, unlink it."""
    with refcount_lock(handle):
        own = mapping is None
        if own:
            try:
                fd = os.open(segment_path(handle), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                mapping = mmap.mmap(fd, _SHM_HEADER)
            finally:
                os.close(fd)
        try:
            count = _fetch_add(mapping, delta) + delta
            if count <= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment_path(handle))
        finally:
            if own:
                mapping.close()


def _atomic_add():
    """libatomic's ``__atomic_fetch_add_4`` (what torch's ``++refcount`` compiles to, out of line),
    or None where the library is missing."""
    import ctypes
    import ctypes.util

    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        try:
            fn = ctypes.CDLL(name).__atomic_fetch_add_4
        except (OSError, AttributeError, TypeError):
            continue
        fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int), ctypes.c_uint32
        return fn
    return None


_ATOMIC_ADD = _atomic_add()
_SEQ_CST = 5


def _fetch_add(mapping: mmap.mmap, delta: int) -> int:
    """Add ``delta`` to the count in a segment's header and return the count before it, as one
    atomic instruction where libatomic is there: torch's own changes (a storage's creation, the
    mapping its rebuild makes, a storage's last close) do not take `refcount_lock`, and a relay
    rank's mapping of a host-shared buffer (`hostbuf`) closes whenever that rank is done with it,
    which may be while an engine worker opens another rank's payload of the same buffer. A read
    and a write then lost torch's change: a lost decrement left the segment in /dev/shm until the
    producer exited (`fsdp-sync soak`), a lost increment unlinked it while still in use."""
    if _ATOMIC_ADD is None:     # no libatomic: a read and a write, under the lock (see above)
        old = int.from_bytes(mapping[:4], sys.byteorder, signed=True)
        mapping[:4] = (old + delta).to_bytes(4, sys.byteorder, signed=True)
        return old
    import ctypes

    word = ctypes.c_uint32.from_buffer(mapping)
    try:
        old = _ATOMIC_ADD(ctypes.addressof(word), delta & 0xFFFFFFFF, _SEQ_CST)
    finally:
        del word                # the mapping cannot close while the buffer is exported
    return old - (1 << 32) if old >= 1 << 31 else old


def mapped_handle(storage: torch.UntypedStorage) -> bytes | None:
    """The handle of a segment `map_segment` mapped to ``storage``, or None."""
    entry = _MAPPED_PTRS.get(storage.data_ptr())
    return None if entry is None or entry[1].expired() else entry[0]


def add_torch_reference(storage: torch.UntypedStorage, delta: int) -> None:
    """`add_reference` for a storage torch mapped (this process made it, or a relay opened it)."""
    handle = storage._share_filename_cpu_()[1]
    with refcount_lock(handle):
        (storage._shared_incref if delta > 0 else storage._shared_decref)()


def take_back(storage: torch.UntypedStorage) -> None:
    """Undo what opening did to a segment's count: the rightful consumer's reference again.
    Nothing for a storage in no segment (the one-byte `empty_storage` of an empty tensor): torch's
    ``_share_filename_cpu_`` would move it into a new segment, counted and never freed."""
    handle = mapped_handle(storage)
    if handle is not None:
        add_reference(handle, +1)
    elif storage.is_shared():
        add_torch_reference(storage, +1)
