"""The disk method's writer thread (one bucket written while the collective stream makes the next),
and what the disk transport's modules share: one bucket written as one hashed file (`write_shard`),
the collectives over the trainer group (`rank_world`, `agree_on`, `broadcast`, `all_gather`), and the
method's floor (`disk_floor`, re-exported by `transport.disk`).

Not here: what a file holds and how it is hashed (`weights.hf_checkpoint.write_safetensors`), the
sync's phases (`transport.disk`), per-rank versions (`transport.disk_ranked`).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

try:
    import fcntl
except ImportError:    # not POSIX: no leases, no reuse (`open_elsewhere`)
    fcntl = None  # type: ignore[assignment]

import torch
import torch.distributed as dist

from ..topology import SyncError, agree, cpu_group
from . import timed_items
from ..weights import bucket as _bucket
from ..weights import hf_checkpoint as ckpt

__all__ = ["OneWriter", "write_shard", "open_elsewhere", "no_space", "plain_alloc", "disk_hash",
           "float_dtype", "rank_world", "agree_on", "broadcast", "all_gather", "disk_floor"]


def plain_alloc(nbytes: int) -> torch.Tensor:
    # buffers stay in this process (written to a file, never shared): plain memory, no /dev/shm
    return torch.empty(nbytes, dtype=torch.uint8)


def write_shard(directory: str, file: str, bkt: _bucket.Bucket, flat: torch.Tensor,
                rename: Callable[[str], str] = str, hash: str = ckpt.DEFAULT_HASH,
                fsync: bool = True, pool: str | None = None) -> dict:
    """One bucket as one safetensors file, hashed under ``hash`` while it is written
    (`hf_checkpoint.write_safetensors`) and fsynced (``fsync=False``: its writeback started, the
    caller fsyncs it). ``rename``: the name each entry gets in the file (per-rank files:
    `hf_checkpoint.rank_tensor_name`). ``pool``: a directory holding a dropped version's files
    (`transport.disk`, keep-N): the file of the same name there, if any, is moved here and
    overwritten in place, its pages reused instead of fresh ones allocated (and the old ones freed),
    unless another link to it exists (a user's copy of that version), it is no regular file (a
    symlink, a directory) or it may be open elsewhere (`open_elsewhere`): then it is removed and a
    fresh file written.

    Why not ``safetensors.torch.save_file`` then a hash of the file: save_file serializes the
    whole file into one more bucket-sized buffer before writing it, and the hash read every byte
    back from the page cache; at 0.5 GB/s (sha256) that second pass was most of the method's time
    over its floor (issue 27)."""
    path = os.path.join(directory, file)
    reuse = False
    if pool is not None:
        try:
            os.rename(os.path.join(pool, file), path)
            reuse = True
        except OSError:          # none there (or gone): a fresh file
            pass
        # a dropped version's file linked elsewhere (`cp -al`, `rsync --link-dest`, `os.link`:
        # a user keeping that version) is theirs too: writing in place would change their copy
        # under its old manifest. Unlinked here, written fresh (O_TRUNC would truncate theirs).
        # So is an entry that is no regular file (a symlink, which the in-place open refuses to
        # follow, ELOOP, or a directory): removed, the file written fresh.
        # And a file some process still has open or mapped (a job reading that old version, an
        # rsync of it): it would see the new bytes under the old version's name, torn halfway
        # (`open_elsewhere`); unlinked, it keeps reading the old bytes.
        if reuse:
            st = os.lstat(path)
            if st.st_nlink > 1 or not stat.S_ISREG(st.st_mode) or open_elsewhere(path):
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                reuse = False
    digest, size, names = ckpt.write_safetensors(path, flat, bkt.entries, hash=hash, rename=rename,
                                                 fsync=fsync, in_place=reuse)
    return {"file": file, "digest": digest, "bytes": size, "names": names}


def open_elsewhere(path: str) -> bool:
    """Whether the file at ``path`` may be open (or memory-mapped) in any process but this call: a
    Linux write lease (``F_SETLEASE``), which the kernel grants only while no other descriptor or
    mapping of the file exists, taken and dropped at once. True wherever that cannot be told (no
    leases on this OS or filesystem, a file of another user): the caller then writes a fresh file,
    which costs only the reuse of its pages. Sees this host only: NFS grants no write lease (so
    there it is True), but a reader on another host of a filesystem that grants them is not seen.
    A lease broken in the instant it is held (someone opening the file then) is signalled with
    SIGURG, ignored by default, rather than SIGIO, which would end the process."""
    setlease, setsig = getattr(fcntl, "F_SETLEASE", None), getattr(fcntl, "F_SETSIG", None)
    if fcntl is None or setlease is None or setsig is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return True
    try:
        fcntl.fcntl(fd, setsig, signal.SIGURG)
        fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)    # EAGAIN: another open file or mapping of it
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def no_space(err: BaseException | None, directory: str, tmp: str | None, need: int | None,
             keep: int) -> BaseException | None:
    """``err`` itself, or for a full disk (ENOSPC, EDQUOT) an `OSError` of the same errno saying
    what to do: the directory, the version's size (``need``: its tensors' bytes, None if unknown),
    the room free once this sync's partial files (``tmp``, removed after the failure) are gone,
    and how many versions ``disk_keep`` holds. The published versions are untouched."""
    if not isinstance(err, OSError) or err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return err
    free = None
    try:
        free = shutil.disk_usage(directory).free
        for root, _, names in os.walk(tmp) if tmp else ():
            free += sum(os.lstat(os.path.join(root, n)).st_blocks * 512 for n in names)
    except OSError:
        free = None
    size = f"about {need / 2**20:.1f} MiB ({need} bytes) of tensors" if need is not None else "its files"
    room = f"{free / 2**20:.1f} MiB ({free} bytes)" if free is not None else "an unknown amount"
    return OSError(err.errno, f"no room on the filesystem of {directory} ({os.strerror(err.errno)}): "
                   f"this version needs {size}, "
                   f"and {room} is free there without this sync's partial files (removed); "
                   f"disk_keep={keep} keeps {keep} published version(s) beside the one written "
                   f"(a dropped one is reused in place). Nothing was published: the versions "
                   f"there are whole and the engines keep theirs. Free space there, lower "
                   f"SyncConfig.disk_keep or use a disk_dir with room, then sync again "
                   f"({type(err).__name__}: {err})")


def disk_hash(config: Any) -> str:
    """The digest the manifest holds (``SyncConfig.disk_hash``; a config without one: the default)."""
    return getattr(config, "disk_hash", ckpt.DEFAULT_HASH)


def float_dtype(metas: list) -> torch.dtype | None:
    """The rollout dtype: the first floating-point tensor's that is neither fp8 nor a scale."""
    for m in metas:
        if m.dtype.is_floating_point and m.dtype.itemsize > 1 and not m.name.endswith("_scale_inv"):
            return m.dtype
    return None


def rank_world(group: Any) -> tuple[int, int]:
    """This rank and the group's size (0, 1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def agree_on(error: BaseException | None, group: Any, what: str) -> None:
    """`topology.agree` (every rank raises the same `SyncError` when any failed); one process:
    its own error as a `SyncError`."""
    if not (dist.is_available() and dist.is_initialized()):   # one process: no peers to tell
        if error is not None:
            raise SyncError(f"{what} failed: {type(error).__name__}: {error}") from error
        return
    agree(error, group, what=what)


def broadcast(obj: Any, group: Any) -> Any:
    """Group rank 0's ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None
                               else 0, group=cpu_group(group))
    return box[0]


def all_gather(obj: Any, group: Any, world: int) -> list:
    """Every rank's ``obj``, in group rank order."""
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=cpu_group(group))
    return out


class OneWriter:
    """One writer thread over a collective bucket stream: at most one bucket is being written
    (`submit` waits for the previous one first) while the stream produces the next. The first
    error is kept (`fail`); after it the caller keeps consuming the stream, which is collective
    (a rank that stopped would leave its peers waiting), and submits nothing more.

    Files are written without waiting for the device (their writeback is started) and fsynced
    together once the stream ends (`drive`): an fsync per file, in turn, held the next bucket
    back until the device had the previous one (about 1 s of the write phase's 2 at qwen2-160m,
    the device idle meanwhile while the bucket was cut).

    ``seconds`` (this rank's split of the write phase): ``export_s`` the stream making buckets
    (gathers, the cut into per-rank buffers, waits on peers), ``write_s`` the writer thread writing
    and hashing files (beside the export), ``wait_s`` the stream held back by an unfinished write,
    ``fsync_s`` the fsyncs at the end."""

    def __init__(self, what: str, planned: int, directory: str) -> None:
        self.what, self.planned = what, planned      # what yields the buckets, how many it should
        self.directory = directory                   # where the records' files are
        self.records: list[dict] = []
        self.err: BaseException | None = None
        self.count = 0
        self._pending: Future | None = None
        self.seconds = {"export_s": 0.0, "write_s": 0.0, "wait_s": 0.0, "fsync_s": 0.0}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_sync-disk-writer")

    def fail(self, exc: BaseException) -> None:
        self.err = self.err or exc

    def collect(self) -> None:
        """Wait for the bucket being written, if any, and keep its records (raises its error)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            t0 = time.perf_counter()
            try:
                self.records.extend(fut.result())
            finally:
                self.seconds["wait_s"] += time.perf_counter() - t0

    def submit(self, fn: Callable[..., list[dict]], *args: Any) -> None:
        self.collect()
        self._pending = self._pool.submit(self._timed, fn, *args)

    def _timed(self, fn: Callable[..., list[dict]], *args: Any) -> list[dict]:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds["write_s"] += time.perf_counter() - t0

    def drive(self, stream: Iterable, body: Callable[[Any], None],
              written: Callable[[list[dict]], None] | None = None) -> tuple[list[dict],
                                                                            BaseException | None]:
        """``body(item)`` for every item of ``stream`` (it catches its own errors into `fail`), then
        the last write is waited for (then ``written(records)``, before the fsyncs, when nothing
        failed); returns the records and the first error, a count of buckets other than the
        planned one included."""
        sec = self.seconds
        try:
            for item in timed_items(stream, sec, "export_s"):
                self.count += 1
                body(item)
                del item        # not alive while the stream makes the next bucket
            try:
                self.collect()
                if self.err is None and written is not None:
                    written(self.records)
                t0 = time.perf_counter()
                if self.err is None:
                    for r in self.records:   # durable before this rank reports its files written
                        ckpt.fsync_file(os.path.join(self.directory, r["file"]))
                sec["fsync_s"] = time.perf_counter() - t0
            except Exception as exc:   # noqa: BLE001
                self.fail(exc)
        except Exception as exc:   # noqa: BLE001 - stream failures come as the same SyncError
            self.fail(exc)
        finally:
            if self._pending is not None:
                self._pending.cancel()
            self._pool.shutdown(wait=True)
        if self.err is None and self.count != self.planned:
            self.err = RuntimeError(f"{self.what} yielded {self.count} buckets, {self.planned} "
                                    f"were planned")
        return self.records, self.err


def disk_floor(nbytes: int, directory: str, *, files: int = 1, chunk_bytes: int = 8 << 20) -> float:
    """Seconds to write ``nbytes`` with plain file I/O into ``files`` files under ``directory``,
    fsync them and the directory, and read them back (the disk method's floor; no hashing, no
    serialization). The files are removed afterwards."""
    if nbytes < 0 or files < 1:
        raise ValueError(f"nbytes must be >= 0 and files >= 1, got {nbytes}, {files}")
    os.makedirs(directory, exist_ok=True)
    work = os.path.join(directory, f".disk-floor-{uuid.uuid4().hex[:12]}")
    os.mkdir(work)
    chunk = bytearray(os.urandom(min(chunk_bytes, max(nbytes, 1))))
    sizes = [nbytes // files + (1 if i < nbytes % files else 0) for i in range(files)]
    try:
        t0 = time.perf_counter()
        paths = []
        for i, size in enumerate(sizes):
            path = os.path.join(work, f"part-{i:05d}")
            paths.append(path)
            with open(path, "wb", buffering=0) as f:
                left = size
                view = memoryview(chunk)
                while left:
                    n = f.write(view[:min(left, len(chunk))])
                    left -= n
                os.fsync(f.fileno())
        ckpt.fsync_dir(work)
        buf = bytearray(len(chunk))
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
