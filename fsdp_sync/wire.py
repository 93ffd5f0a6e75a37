"""The wire form that the transports, the engines and the verl adapter share.

- `flattened_bucket` / `open_flattened_bucket`: SGLang's flattened-bucket payload
  ``{"flattened_tensor": uint8 tensor, "metadata": [...]}`` (``load_format="flattened_bucket"``, and
  the per-rank ``"direct"`` buckets), built and read in this one place.
- `new_update_group` / `destroy_update_group` / `update_group_open` / `call_off_join`: SGLang's
  weight-update group (below).
- `PER_RANK_BUCKET` / `per_rank_bucket_plan`: fsdp_sync's per-rank distributed load format.
- `host_store` / `join_store`: a rendezvous store that listens before its port is handed out (the
  launcher's ranks, the reference engine's workers, the update group), and a member joining it.
- `agent_store_env`: the environment that makes a torchrun-style rank (``init_process_group`` with
  ``env://``) join a store its launcher hosts, as torchrun's own ranks join its agent's.
- `free_port`: a port free at this moment only (for a server that binds it at once, or a test).

SGLang's weight-update group, made the way SGLang 0.5.23 makes it, for both ends of the wire.

SGLang's ``init_weights_update_group`` joins every TP worker of an engine to a process group
outside the trainer's world: a ``tcp://`` store hosted by rank 0 (the trainer), wrapped in a
``PrefixStore(group_name)``, and a new process group of that name whose ranks map to themselves.
`new_update_group` does exactly that with torch's own calls, so our trainer joins a real SGLang
engine's group and our reference engine's workers join a group a real SGLang trainer made; a
mismatched group name or store prefix would make every rank wait out the timeout.

`PER_RANK_BUCKET` names fsdp_sync's own ``load_format`` of ``update_weights_from_distributed``
(SGLang has none such): each engine TP worker receives, by point-to-point ``recv`` from group rank
0, one buffer holding only ITS shard of the call's tensors (engine parameter names and per-rank
shapes, each at a 16-byte-aligned offset: `per_rank_bucket_plan`), instead of one broadcast of full
tensors to all of them. Only an engine that says so (``accepts_distributed_rank_buckets``) is sent it.

Not here: how a payload travels (`weights.handles`), what travels over the group (the distributed
transport) or who calls it (the engines).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from .weights.bucket import (Bucket, KnownMetadata, entries_from_metadata, plan_buckets, sglang_metadata,
                             unflatten)

__all__ = ["new_update_group", "destroy_update_group", "DEFAULT_GROUP_NAME", "PER_RANK_BUCKET",
           "per_rank_bucket_plan", "flattened_bucket", "open_flattened_bucket", "free_port",
           "host_store", "join_store", "agent_store_env", "update_group_open", "call_off_join"]

DEFAULT_GROUP_NAME = "weight_update_group"

PER_RANK_BUCKET = "per_rank_bucket"
"""``load_format`` of a per-rank ``update_weights_from_distributed`` call (see the module)."""

_CALLED_OFF = "fsdp_sync/called_off"    # in the group's store: rank 0 gave the group up (`call_off_join`)



def flattened_bucket(flat: torch.Tensor, bucket: Bucket) -> dict:
    """SGLang's flattened-bucket payload for ``bucket`` laid out in ``flat`` (uint8, at least
    ``bucket.nbytes`` long; a longer, reused buffer is cut to the bucket's bytes)."""
    if flat.numel() < bucket.nbytes:
        raise ValueError(f"a flattened bucket of {bucket.nbytes} bytes cannot be read from a buffer "
                         f"of {flat.numel()} bytes")
    return {"flattened_tensor": flat if flat.numel() == bucket.nbytes else flat[:bucket.nbytes],
            "metadata": sglang_metadata(bucket)}


def open_flattened_bucket(value: Any, known: KnownMetadata | None = None) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an opened flattened-bucket payload (views into its buffer).
    ``known``: metadata this receiver checked before (`bucket.KnownMetadata`), kept by it.

    Raises ValueError saying what was wrong (not a dict with both keys, a buffer that is not one
    contiguous 1-D uint8 tensor, bad metadata)."""
    if not (isinstance(value, dict) and "flattened_tensor" in value and "metadata" in value):
        raise ValueError(f"a flattened bucket is a dict with 'flattened_tensor' and 'metadata', got "
                         f"{type(value).__name__}")
    flat = value["flattened_tensor"]
    if isinstance(flat, torch.Tensor) and flat.dim() == 1 and flat.stride(0) != 1:
        # torch refuses a dtype view of a strided buffer with a RuntimeError: refused here by name
        raise ValueError(f"bad flattened bucket: its flattened_tensor is not contiguous (stride "
                         f"{flat.stride(0)}): a flattened bucket is one contiguous uint8 buffer")
    try:
        entries = (known.entries if known is not None else entries_from_metadata)(value["metadata"])
        return unflatten(flat, entries)
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"bad flattened bucket: {exc}") from exc


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it). Free NOW only: on a busy machine another
    process may take it before it is bound again, so a rendezvous must not be given one of these
    (`host_store` listens first and then hands out its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int | None, timeout_s: float, port: int = 0) -> Any:
    """A `torch.distributed.TCPStore` hosted by this process, already listening (on every address)
    when it returns; its ``.port`` is what the members are told (`join_store`). ``port=0`` lets the
    OS pick one, so no other process can take it between the pick and the bind (CI once failed with
    EADDRINUSE when a port picked by `free_port` was bound a moment later). A port the caller names
    is bound here, at once (EADDRINUSE, a `DistNetworkError`, where another program holds it), and
    shared with any store of this process already there, as torch's ``tcp://`` rendezvous shares it.
    The store, and its port, live as long as the returned object (and any sharing it): dropping the
    last one closes the port and every member's connection, so a member waiting on it fails at
    once. It does not wait for its members."""
    timeout = datetime.timedelta(seconds=float(timeout_s))
    store = dist.TCPStore("127.0.0.1", int(port), world_size, True, timeout, wait_for_workers=False,
                          multi_tenant=bool(port))
    store.set_timeout(timeout)
    return store


def join_store(address: str, port: int, world_size: int | None, timeout_s: float) -> Any:
    """A member's connection to a store that `host_store` (or any TCPStore master) hosts at
    ``address:port``; waits up to ``timeout_s`` for it to answer (`_wait_listening`, `_connect`)."""
    deadline = time.monotonic() + float(timeout_s)
    left = _wait_listening(address, port, deadline)
    store = _connect(address, port, world_size, left, deadline)
    store.set_timeout(datetime.timedelta(seconds=float(timeout_s)))
    return store


def _connect(address: str, port: int, world_size: int | None, left: float, deadline: float,
             what: str = "the store", **kw: Any) -> Any:
    """A TCPStore client of ``address:port``, given up at ``deadline`` (at least 1 s from now).
    torch's client, connected to a program that accepts but is no store (another program on the
    port), waits for its handshake's answer with no timeout at all: it runs in a thread here (torch
    lets go of the GIL meanwhile), and one that has not answered by the deadline is left to end
    when that program closes the connection."""
    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(address, int(port), world_size, False,
                                         datetime.timedelta(seconds=left), **kw)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=connect, name="fsdp_sync-store-connect", daemon=True)
    t.start()
    t.join(max(1.0, deadline - time.monotonic()))
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        raise dist.DistNetworkError(
            f"something at {address}:{port} accepted a connection but did not answer as a "
            f"torch.distributed store ({what}) within the timeout: another program on that port?")
    return box["store"]


def _wait_listening(address: str, port: int, deadline: float, what: str = "the store") -> float:
    """Wait until something accepts connections at ``address:port``, at most until ``deadline``
    (``time.monotonic()``); returns the seconds left (at least 1). torch's TCPStore client, given
    a timeout T for a port nobody listens on, tries for T, sleeps up to T and tries again: 2 to
    3 T in all (160 s for a 60 s timeout, with the engine's workers held the whole time). This
    keeps the wait to the timeout given, and says what nobody answered."""
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((address, int(port)), timeout=max(0.05, min(1.0, left))).close()
            return max(1.0, deadline - time.monotonic())
        except OSError as exc:
            if deadline - time.monotonic() <= 0:
                raise dist.DistNetworkError(
                    f"nothing accepted a connection at {address}:{port} ({what}) within the "
                    f"timeout ({type(exc).__name__}: {exc or 'no answer'})") from None
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def agent_store_env(store: Any, address: str = "127.0.0.1") -> dict[str, str]:
    """What a launcher puts in each rank's environment (beside ``RANK``/``WORLD_SIZE``) so that
    ``init_process_group`` with ``env://`` joins ``store``, which the launcher hosts (`host_store`),
    instead of rank 0 binding ``MASTER_PORT`` itself: torchrun's agent-store protocol
    (``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank a client of ``MASTER_ADDR:MASTER_PORT``).
    A port that rank 0 binds only when it gets there (seconds later, on a Ray actor) can be taken
    by another process in between; a hosted store's port cannot."""
    return {"MASTER_ADDR": address, "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def per_rank_bucket_plan(entries: Any) -> Any:
    """The one `bucket.Bucket` a `PER_RANK_BUCKET` call's ``(name, dtype, shape)`` entries are laid
    out by on the wire: in order, each at a 16-byte-aligned offset (`bucket.plan_buckets`), so
    sender and receiver agree on every offset without sending them."""
    plan = plan_buckets(list(entries), 1 << 62)
    return plan[0] if plan else Bucket((), 0)


def new_update_group(*, backend: str, master_address: str, master_port: int, world_size: int,
                     rank: int, group_name: str, timeout_s: float, store: Any = None) -> Any:
    """Join (rank 0: host) the update group; blocks until all ``world_size`` ranks have joined.

    Rank 0 may pass ``store``, one it already hosts at ``master_port`` (`host_store`), or a client
    of that one (`join_store`: then dropping the host's object ends every member's wait, this
    rank's too), so that the port was listened on before anyone was told it; otherwise rank 0
    binds ``master_port`` here.

    ``timeout_s`` bounds the rendezvous and every collective on the group (a receive that waits
    longer fails). SGLang's own engines use 30 minutes, not settable."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world)

    if not group_name:
        raise ValueError("the update group's name must not be empty")
    if store is not None and rank != 0:
        raise ValueError(f"only rank 0 hosts the update group's store; rank {rank} was given one")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    deadline = time.monotonic() + float(timeout_s)
    # The store that SGLang's ``rendezvous("tcp://...")`` makes, made here directly: rank 0 hosts
    # it. torch's tcp:// handler makes every rank a client when the process's environment has
    # TORCHELASTIC_USE_AGENT_STORE=True (torchrun, accelerate launch set it for the trainer's own
    # group), and then nobody hosts this group's store: every rank waited out the timeout.
    if store is None and rank == 0:
        store = dist.TCPStore(master_address, int(master_port), world_size, True, timeout,
                              multi_tenant=True)
    elif store is None:
        what = f"the store of update group {group_name!r}, hosted by its rank 0"
        left = _wait_listening(master_address, master_port, deadline, what)
        store = _connect(master_address, master_port, world_size, left, deadline, what, multi_tenant=True)
        called_off = PrefixStore(group_name, store)
        if called_off.check([_CALLED_OFF]):
            raise dist.DistNetworkError(
                f"update group {group_name!r} at {master_address}:{master_port}: its rank 0 called the "
                f"join off ({called_off.get(_CALLED_OFF).decode(errors='replace')})")
    # the rendezvous gets what is left of the timeout; the group's collectives the whole of it
    base = store
    base.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, base),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    base.set_timeout(timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def update_group_open(group_name: str) -> bool:
    """Whether this process has a process group named ``group_name`` (another manager's update
    group, not destroyed): torch refuses to make a second one, but only once the rendezvous is
    under way, after the engines were told to join."""
    from torch.distributed.distributed_c10d import _world

    return group_name in _world.pg_names.values()


def call_off_join(store: Any, group_name: str, why: str) -> None:
    """Rank 0 gives update group ``group_name`` up before every rank joined: marked in ``store``
    (the group's, or one hosted again on its port), a member that `new_update_group` connects from
    now on fails at once, saying ``why``, instead of waiting out its timeout in a rendezvous that
    cannot complete. A member already in the rendezvous is ended by closing the store (dropping
    the host's object: `host_store`)."""
    from torch.distributed.distributed_c10d import PrefixStore

    mark = PrefixStore(group_name, store)
    mark.set(_CALLED_OFF, why)
    mark.get(_CALLED_OFF)     # a set is not answered: read back, the store surely holds it


def destroy_update_group(pg: Any) -> None:
    """Destroy a group made by `new_update_group` (its store connection goes with it)."""
    if pg is not None:
        dist.destroy_process_group(pg)
