"""Host-shared buffers: shared-memory buffers that every rank of a process group on one host maps.

`HostShared.create(group, count, nbytes)` makes ``count`` buffers of ``nbytes`` each: group rank 0
allocates them (`handles.empty_shared`) and scatters one tagged handle payload to each other rank
(one per opener, so each segment's reference count stays balanced, also where an opener fails
part-way: what it mapped it gives back, and its payload's release gives back the rest); every
rank then holds the same
memory (``bufs``), adopted so that re-sharing a buffer with an engine needs no copy. `fill` runs one
rank's writes between the group's two barriers (nobody still reads the previous bytes; every
rank's bytes are in).

Two users: `gather.fill_shared` (one buffer per group: a full bucket, each rank writing its own
shards) and `reshard` (one buffer per engine TP rank, times the pipelining depth). `create`
returns None, on every rank alike, where the path does not apply (one rank, nothing to share, ranks
on several hosts, rank 0 cannot make shared memory, or a rank cannot open it): the caller then
gathers instead.

Not here: what is written into the buffers (`gather`, `reshard`) or how they reach an engine
(`handles`, the transports).
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..topology import SyncError, cpu_group
from . import handles as _handles

__all__ = ["HostShared", "host_key"]

_log = logging.getLogger("fsdp_sync")


def host_key() -> str:
    """This host, as the ranks sharing memory must agree on it (host name and boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class HostShared:
    """``count`` shared-memory buffers mapped by every rank of ``group`` (see the module)."""

    def __init__(self, group: Any, me: int, bufs: list[torch.Tensor]) -> None:
        self.group, self.me, self.bufs = group, me, bufs

    @classmethod
    def create(cls, group: Any, count: int, nbytes: int) -> "HostShared | None":
        """Collective over ``group``: the buffers, or None on every rank when the path does not
        apply (see the module)."""
        if nbytes == 0 or count < 1:
            return None
        world = dist.get_world_size(group)
        if world == 1:
            return None
        keys: list = [None] * world
        group = cpu_group(group)   # objects, barriers: never the data plane's NCCL group
        dist.all_gather_object(keys, host_key(), group=group)
        if any(k != keys[0] for k in keys):
            return None                      # several hosts: the caller gathers instead
        me = dist.get_rank(group)
        src = dist.get_global_rank(group, 0)
        out: list = [None]
        if me == 0:
            try:
                bufs = [_handles.empty_shared(nbytes) for _ in range(count)]
                # tagged: a rank that fails part-way gives back what it mapped and its state word
                # stays fresh, so the release gives back exactly the references still taken (an
                # untagged one, counted as unopened, had its mapped buffers given back twice: they
                # stayed in /dev/shm until this process exited)
                sets = _handles.make_payloads(bufs, world, ranks=list(range(1, world)))
            except Exception as exc:  # noqa: BLE001 - e.g. torch_shm_manager cannot start (a
                # TMPDIR too long for its socket): every rank takes the gather path instead
                # of waiting for payloads that never come
                why = ("unavailable", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                dist.scatter_object_list(out, [None] + [why] * (world - 1), src=src, group=group)
                _log.warning("fsdp_sync: no host-shared memory (%s): gathering instead", why[1])
                return None
            try:
                dist.scatter_object_list(out, [None] + sets.payloads, src=src, group=group)
                failed = _failures(None, group, world)   # every rank has opened them (or said why not)
            finally:
                # (a rank that has not opened its payload by now never will: revoked)
                sets.release(require_ack=False)
        else:
            dist.scatter_object_list(out, None, src=src, group=group)
            if isinstance(out[0], tuple) and out[0][:1] == ("unavailable",):
                return None                  # group rank 0 could not make them
            error = None
            try:
                rec = _handles.open_payload(out[0], me, share_again=True)
                bufs = list(rec.value)
                rec.ack()                    # (a pooled state word goes back to its page)
                for b in bufs:
                    _handles.adopt(b)        # re-sharing them with the engine needs no copy
            except Exception as exc:  # noqa: BLE001 - e.g. this rank cannot reach rank 0's shm
                # manager: every rank gathers instead, rather than wait for it in a barrier
                bufs, error = [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            failed = _failures(error, group, world)
        if failed:
            bufs = []
            _log.warning("fsdp_sync: no host-shared memory (group ranks %s could not open group rank "
                         "0's buffers: %s): gathering instead", sorted(failed), next(iter(failed.values())))
            return None
        return cls(group, me, bufs)

    def fill(self, write: Callable[[], None], *, wait_readers: bool = True) -> None:
        """Run ``write`` (this rank's bytes into ``bufs``) between the group's barriers: before it
        (skipped with ``wait_readers=False`` when the caller knows nobody reads the bytes it
        overwrites), nobody still reads the previous bytes; after it, every rank's bytes are in.
        The one after it also says whether every rank's write went through: a rank whose write
        raised fails every rank's fill alike (`SyncError` naming the group rank and the error),
        where it left its peers in the barrier until the group's timeout."""
        if wait_readers:
            dist.barrier(group=self.group)
        error = cause = None
        try:
            with torch.no_grad():
                write()
        except Exception as exc:  # noqa: BLE001 - every peer must hear of it
            error, cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", exc
        failed = _failures(error, self.group, dist.get_world_size(self.group))
        if failed:
            rank = min(failed)
            err = SyncError(f"writing the ranks' bytes into a host-shared buffer failed on group "
                            f"rank {rank}: {failed[rank]}")
            err.failures = failed
            try:
                raise err from cause
            finally:
                err = cause = None     # (no cycle through this frame's traceback)


def _failures(error: str | None, group: Any, world: int) -> dict[int, str]:
    """Collective: every group rank's error opening the buffers, by group rank (empty when all
    opened): one flag all-reduce (what the barrier it replaces cost), the texts only on failure."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return {}
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    return {r: e for r, e in enumerate(errors) if e is not None}
