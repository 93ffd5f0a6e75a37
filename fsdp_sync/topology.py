"""Who talks to whom: one `SyncTopology` built once from a ``("dp", "infer_tp")`` DeviceMesh.

It names this rank's dp and infer-TP coordinates, the infer-TP group, and the global rank of that
group's infer-TP rank 0 (the only rank that holds an engine handle and calls the engine). The
collectives the sync needs are here: `gather_to_src` (payloads to infer-TP rank 0 with
``gather_object``), `broadcast_from_src`, `agree` (every rank learns whether any rank failed,
so no rank waits forever in a later collective), `agree_values` (the same, and settings that must
be equal on every rank compared in its one all-reduce) and `agree_after_rank0` (the same after work
that only group rank 0 does, however long it takes).

Objects, agreement flags and barriers run on `cpu_group`: the group itself where it has a CPU
backend (gloo, ``"cpu:gloo,cuda:nccl"``), else a gloo group over the same ranks, made once by its
members. Users' groups are often NCCL-only (``init_process_group("nccl")`` under torchrun or
accelerate), and a CPU tensor's collective on such a group raises ``No backend type associated with
device type cpu``. Weights keep travelling over the user's group (NCCL on GPUs).

Not here: what is gathered (handles) or when (manager). No module-level process groups: every
collective takes the topology it runs on.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["SyncTopology", "make_mesh", "gather_to_src", "broadcast_from_src", "agree", "agree_values",
           "agree_after_rank0", "agree_after_each", "SyncError", "RanksDiffer", "cpu_group", "group_ranks", "has_cpu_backend", "released_by_backend", "let_go_of_frames"]

log = logging.getLogger(__name__)

DIMS = ("dp", "infer_tp")


class SyncError(RuntimeError):
    """A sync failed on some rank; raised on every rank with the same message.

    ``failures``: what each failing rank passed to `agree`, by its rank in the group."""

    failures: dict[int, str] = {}


def make_mesh(dp: int, infer_tp: int, device_type: str = "cpu") -> DeviceMesh:
    """A ``("dp", "infer_tp")`` mesh over the default process group (dp × infer_tp == world size).

    ``dp`` and ``infer_tp`` must be ints >= 1: ``world / tp`` (a float) or a size read from the
    environment as text is refused naming it, as torch otherwise fails with ``sizes (2.0,) and
    strides (1,) don't match`` and ``-1`` with ``only one dimension can be inferred``."""
    world = dist.get_world_size()
    sizes = []
    for name, v in (("dp", dp), ("infer_tp", infer_tp)):
        try:
            n = operator.index(v) if not isinstance(v, bool) else 0   # an int, numpy's too
        except TypeError:
            n = 0
        if n < 1:
            raise ValueError(f"make_mesh: {name} must be an int >= 1, got {v!r} "
                             f"({type(v).__name__}); e.g. make_mesh(dp=world // tp, infer_tp=tp) "
                             f"with world = {world}, the default group's size (// not /)")
        sizes.append(n)
    dp, infer_tp = sizes
    if dp * infer_tp != world:
        hint = (f"the world size {world} is not a multiple of infer_tp {infer_tp}: run a world of "
                f"a multiple of the engine's TP, or an engine whose TP divides {world}"
                if world % infer_tp else f"use dp={world // infer_tp} (world // infer_tp)")
        raise ValueError(f"dp ({dp}) × infer_tp ({infer_tp}) must equal the world size ({world}): {hint}")
    return init_device_mesh(device_type, (dp, infer_tp), mesh_dim_names=DIMS)


@dataclass(frozen=True)
class SyncTopology:
    mesh: DeviceMesh
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    tp_ranks: tuple[int, ...]   # global ranks of this rank's infer-TP group, in TP order
    tp_group: Any               # ProcessGroup of the infer-TP group

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "SyncTopology":
        """The topology of ``mesh``, which must span every rank of the default process group:
        the sync agrees (`agree`, the fleet's broadcasts) over the whole default group, so a rank
        outside the mesh would never join and the mesh's ranks would wait for it until the
        group's timeout."""
        names = tuple(mesh.mesh_dim_names or ())
        if names != DIMS:
            # a trainer's own mesh (("dp", "tp"), HSDP's ("dp_replicate", "dp_shard")) is a
            # layout of the training, not of the engines: say how to make the one asked for
            raise ValueError(
                f"expected a mesh with dims {DIMS}, got {names or 'unnamed dims'} (shape "
                f"{tuple(mesh.mesh.shape)}): the mesh tells how the engines' TP groups lie over the "
                f"trainer ranks, not how the trainer shards; make one with make_mesh(dp=world // "
                f"infer_tp, infer_tp=<the engine's TP>) alongside the trainer's own mesh")
        world = dist.get_world_size()
        if mesh.size() != world:
            raise ValueError(
                f"the {DIMS} mesh spans {mesh.size()} ranks {sorted(int(r) for r in mesh.mesh.flatten().tolist())} "
                f"but the default process group has {world}: fsdp_sync agrees over the whole default "
                f"group, so every rank of it must be a trainer rank in the mesh (ranks outside it would "
                f"never join, and the sync would wait for them until the group's timeout). Build the "
                f"mesh over every rank (make_mesh(dp, infer_tp) with dp * infer_tp == {world}), or run "
                f"the trainer in a process group of its own")
        tp = mesh["infer_tp"]
        dp = mesh["dp"]
        group = tp.get_group()
        return cls(
            mesh=mesh, rank=dist.get_rank(), world_size=dist.get_world_size(),
            dp_rank=dp.get_local_rank(), dp_size=dp.size(),
            tp_rank=tp.get_local_rank(), tp_size=tp.size(),
            tp_ranks=group_ranks(group), tp_group=group,
        )

    @property
    def tp_src(self) -> int:
        """Global rank of infer-TP rank 0 of this rank's group."""
        return self.tp_ranks[0]

    @property
    def is_tp_src(self) -> bool:
        return self.tp_rank == 0

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (dp {self.dp_rank}/{self.dp_size}, "
                f"infer_tp {self.tp_rank}/{self.tp_size})")


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` in the order of their rank in it. A mesh dimension's
    ``get_local_rank()`` is the rank in its process group, which torch numbers by ascending global
    rank whatever the order of the mesh's tensor: a mesh made from ``[[1, 0]]`` has rank 0 as
    infer-TP rank 0, though its row reads ``[1, 0]``. Read in the tensor's order, infer-TP rank 0
    and `SyncTopology.tp_src` were two ranks: the gather to it was refused by torch on both."""
    ranks = dist.get_process_group_ranks(group)
    return tuple(sorted((int(r) for r in ranks), key=lambda r: dist.get_group_rank(group, r)))


def has_cpu_backend(group: Any = None) -> bool:
    """Whether ``group`` (None: the default group) runs collectives of CPU tensors."""
    from torch.distributed.distributed_c10d import _get_default_group

    try:
        (group or _get_default_group())._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


# Gloo groups made for groups without a CPU backend, by (the default group's id, member ranks).
# A cache of groups derived from the caller's, not a group of the library's own: an entry is used
# only while its group is registered (a destroyed world takes its groups with it).
_CPU_TWINS: dict[tuple, Any] = {}


def _timeout_of(group: Any) -> Any:
    import datetime

    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return datetime.timedelta(minutes=10)


def cpu_group(group: Any = None) -> Any:
    """A group over the ranks of ``group`` (None: the default group) that runs CPU tensors and
    objects: ``group`` itself (None stays None) where it has a CPU backend, else a gloo group made
    at the first call and kept. Every member of ``group`` must make this call at the same point
    (as for any collective on ``group``); non-members are not involved.

    The twin is made as SGLang makes its update group: a name and a store prefix of its own on the
    default store. ``new_group(use_local_synchronization=True)`` would hash the number of groups a
    process holds into the name, which differs between ranks when one of them holds more (trainer
    rank 0's weight-update group), and they would wait for each other forever."""
    if has_cpu_backend(group):
        return group
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(group or default))
    key = (id(default), ranks)
    twin = _CPU_TWINS.get(key)
    if twin is not None and twin in c10d._world.pg_map:
        return twin
    name = "fsdp_sync_cpu_" + "_".join(map(str, ranks)) if len(ranks) <= 16 else (
        "fsdp_sync_cpu_" + hashlib.sha1(repr(ranks).encode()).hexdigest())
    store = c10d.PrefixStore("fsdp_sync_cpu/", c10d._get_default_store())
    twin, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(dist.get_rank()), list(ranks), c10d.Backend("gloo"), store,
        group_name=name, backend_options=None, timeout=_timeout_of(group or default),
        group_desc="fsdp_sync objects and agreement (the user's group has no CPU backend)")
    c10d._world.pg_group_ranks[twin] = {r: i for i, r in enumerate(ranks)}
    _CPU_TWINS[key] = twin
    return twin


@contextlib.contextmanager
def released_by_backend(*tensors: torch.Tensor, timeout_s: float = 5.0) -> Iterator[None]:
    """Around collectives on ``tensors`` (small CPU tensors of the caller's own): on leaving, wait
    until the backend has let go of them (at most ``timeout_s``; then go on, logged).

    gloo's worker thread completes a collective's work, which wakes the caller, before it drops
    its own reference to the work's tensors. A tensor whose Python object dies in between is freed
    by that thread, which must take the GIL to do it; when the rank has meanwhile reached
    interpreter exit (its last collective was the agreement that closed a ``with`` block), taking
    the GIL ends the thread inside a frame that cannot unwind: ``terminate called without an
    active exception``, SIGABRT at exit (seen on CPU in 4 of ~180 runs of a launcher test, most
    under load; pytorch/pytorch#179291 describes it). Keeping the tensor alive until the backend
    let go makes its release a plain count decrement that needs no GIL."""
    counts = [t._use_count() for t in tensors] if hasattr(torch.Tensor, "_use_count") else None
    yield
    if counts is None:
        return
    deadline = None
    for t, base in zip(tensors, counts):
        while t._use_count() > base:
            now = time.monotonic()
            deadline = deadline or now + timeout_s
            if now > deadline:
                log.debug("fsdp_sync: a collective's tensor still held by the backend after %.1f s",
                          timeout_s)
                return
            time.sleep(0.0002)


def gather_to_src(obj: Any, topo: SyncTopology) -> list | None:
    """``gather_object`` of ``obj`` to infer-TP rank 0: a list by TP rank there, None elsewhere."""
    if topo.tp_size == 1:
        return [obj]
    out = [None] * topo.tp_size if topo.is_tp_src else None
    dist.gather_object(obj, out, dst=topo.tp_src, group=cpu_group(topo.tp_group))
    return out


def broadcast_from_src(obj: Any, topo: SyncTopology) -> Any:
    """Infer-TP rank 0's ``obj`` on every rank of its group."""
    if topo.tp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=topo.tp_src, group=cpu_group(topo.tp_group))
    return box[0]


def agree(error: str | BaseException | None, group: Any = None, *, what: str = "sync",
          digest: int | None = None) -> None:
    """Collective over ``group`` (default: the whole world): raise `SyncError` on every rank if
    any rank passed an error.

    Each rank passes its own error (text or exception, or None; or ``(what, text)`` where the
    failure names what failed itself, as the manager's stages agreed together do). The message
    names the first failing rank (its rank in ``group``) and carries its text, identical on every
    rank. One all-reduce when all is well; the messages travel only on failure. A group of one
    rank runs no collective: there is no other rank to tell; without a process group (a
    one-process trainer) the error is raised as ``"<what> failed: <text>"``.

    ``digest`` (an int in [0, 2**62), passed by every rank or by none): also compare it across
    ranks in the same all-reduce (its max and min), at no extra round trip; where they differ,
    `RanksDiffer` is raised on every rank instead (the caller gathers what differs), carrying the
    `SyncError` the errors alone would have raised, if any rank passed one. A rank that failed
    before reaching the digest's agree meets it in an agree of its own (no digest): then the
    errors are raised as usual.
    """
    if digest is not None and not 0 <= digest < 1 << 62:
        raise ValueError(f"agree's digest must be an int in [0, 2**62), got {digest!r}")
    who = "rank" if group is None else "group rank"
    own_what = None
    if isinstance(error, tuple):
        own_what, error = error
    text = None if error is None else (
        f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error))
    if not dist.is_initialized():
        if text is None:
            return
        exc = SyncError(f"{own_what or what} failed: {text}")
        exc.failures = {0: text}
        try:
            raise exc
        finally:
            exc = None   # no cycle frame -> exc -> traceback -> frame: see below
    differ = False
    if dist.get_world_size(group) == 1:
        msgs: list = [None if text is None else (own_what, text)]
    else:
        group = cpu_group(group)
        # MAX of [failed << 62 | digest, -digest] (digest 0 where none): whether any rank failed,
        # and the digests' max and min. Two words in EVERY agree, digest or not: a rank that failed
        # entering a stage meets its peers in whatever agree they reach first (`manager._run`),
        # and an all-reduce of another size there would leave both waiting until the timeout.
        failed, own = (0 if error is None else 1), (0 if digest is None else digest)
        flag = torch.tensor([(failed << 62) | own, -own], dtype=torch.int64)
        with released_by_backend(flag):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        head = int(flag[0].item())
        failed = head >> 62
        differ = not failed and head != -int(flag[1].item())   # the same answer on every rank
        if not failed and not differ:
            return
        msgs = [None] * dist.get_world_size(group)
        if failed:       # the digests travel with the messages (the max no longer tells them apart)
            dist.all_gather_object(msgs, (None if text is None else (own_what, text), digest), group=group)
            digests = [m[1] for m in msgs]      # compared only if every rank passed one (all in one agree)
            differ = None not in digests and len(set(digests)) > 1
            msgs = [m[0] for m in msgs]
    exc = None
    if any(m is not None for m in msgs):
        first = next(r for r, m in enumerate(msgs) if m is not None)
        others = [r for r, m in enumerate(msgs) if m is not None and r != first]
        suffix = f" ({who}s {others} failed too)" if others else ""
        exc = SyncError(f"{msgs[first][0] or what} failed on {who} {first}{suffix}: {msgs[first][1]}")
        exc.failures = {r: m[1] for r, m in enumerate(msgs) if m is not None}
    # the error raised is dropped from this frame's locals as it leaves: a local holding it makes a
    # cycle (frame -> exc -> traceback -> frame) that keeps every caller's frame of a failed sync,
    # and what they hold (a bucket buffer, gathered tensors), alive until a gen-2 collection
    try:
        if differ:
            diff = RanksDiffer(f"{what}: the ranks' digests differ" + (f"; {exc}" if exc else ""))
            diff.error, diff.failures = exc, (exc.failures if exc is not None else {})
            raise diff from (error if isinstance(error, BaseException) else None)
        if exc is not None:
            raise exc from (error if isinstance(error, BaseException) else None)
    finally:
        exc = diff = None


class RanksDiffer(SyncError):
    """`agree` found that the ranks passed different digests (raised on every rank alike).
    ``error``: the `SyncError` the ranks' errors would have raised, or None."""

    error: SyncError | None = None


def agree_values(error: Any, values: dict[str, Any], group: Any = None, *, what: str,
                 why: str = "") -> None:
    """`agree` of ``error``, with ``values`` (setting name -> value, ``repr``-comparable) that
    must be equal on every rank compared in the same all-reduce (a digest: no extra round trip).
    Where they differ, every rank raises the same `SyncError` naming each setting that differs,
    each value and the ranks holding it (``"SyncConfig.pause_mode is 'abort' on rank 0, None on
    rank 1"``, the names as ``values`` has them), then ``why``, then any rank's error ("besides,
    ..."); only then are the values gathered."""
    text = repr(sorted((k, repr(v)) for k, v in values.items()))
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
    try:
        agree(error, group, what=what, digest=digest)
    except RanksDiffer as exc:
        lists: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(lists, {k: repr(v) for k, v in values.items()}, group=cpu_group(group))
        who = "rank" if group is None else "group rank"
        parts = []
        for key in dict.fromkeys(k for vals in lists for k in vals):  # every rank's, in rank order
            held: dict[str, list[int]] = {}
            for r, vals in enumerate(lists):
                held.setdefault(vals.get(key, "(not set)"), []).append(r)
            if len(held) > 1:
                parts.append(f"{key} is " + ", ".join(
                    f"{v} on {who}{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}"
                    for v, rs in held.items()))
        msg = f"{what} failed: the ranks' settings differ: {'; '.join(parts) or 'another setting'}"
        msg += (f". {why}" if why else "") + (f"; besides, {exc.error}" if exc.error is not None else "")
        err = SyncError(msg)
        err.failures = dict(exc.failures) or {0: msg}
        try:
            raise err from None
        finally:
            err = None      # no frame -> exc -> traceback -> frame cycle (`agree`)


def agree_after_rank0(work: Callable[[], str | BaseException | None], group: Any = None, *, what: str,
                      round_s: float = 1.0) -> None:
    """Run ``work()`` on group rank 0 of ``group`` and raise one `SyncError` on every rank if it
    failed (it returns an error text or exception, or raises), however long it takes.

    Why not rank 0 working while the others wait in `agree`: their collective is bounded by the
    group's timeout, rank 0's work (a rendezvous with engines, bounded by ``dist_timeout_s``; an
    engine loading a checkpoint from disk; a commit) is not, and a collective that times out
    raises a raw backend error, a different one on each rank. Here rank 0 works in a thread and
    tells the others, every ``round_s`` (far inside any group timeout) and at once when it is
    done, whether it is still working: one small broadcast a round (one in all where the work
    takes under ``round_s``). Without peers the work runs here and a returned exception is the
    `SyncError`'s cause."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _agree_alone(work, group, what)
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    _wait_for_work(work if dist.get_rank(group) == 0 else None, group, what, round_s,
                   lambda flag, flags: dist.broadcast(flag, src=src, group=flags))


def agree_after_each(work: Callable[[], str | BaseException | None] | None, group: Any = None, *,
                     what: str, round_s: float = 1.0) -> None:
    """`agree_after_rank0` where any ranks work: each passes its own ``work`` (the others None),
    and every round one small all-reduce (MAX) tells every rank whether any is still working (one
    in all where every work takes under ``round_s``). The failing ranks' texts are agreed as in
    `agree`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _agree_alone(work, group, what)
        return

    def still_working(flag: torch.Tensor, flags: Any) -> None:
        flag.neg_().add_(1)                       # MAX of "not done"
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=flags)
        flag.neg_().add_(1)

    _wait_for_work(work, group, what, round_s, still_working)


def _agree_alone(work: Callable[[], str | BaseException | None] | None, group: Any, what: str) -> None:
    """No peers to keep informed: run ``work`` here; a returned exception stays the cause."""
    err = _run_caught(work) if work is not None else None
    if dist.is_initialized():
        agree(err, group, what=what)
    elif err is not None:
        text = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else err
        raise SyncError(f"{what} failed: {text}") from (err if isinstance(err, BaseException) else None)


def _wait_for_work(work: Callable[[], Any] | None, group: Any, what: str, round_s: float,
                   tell: Callable[[torch.Tensor, Any], None]) -> None:
    """``work`` (where given) in a thread; ``tell(done, flags)`` every ``round_s`` until every rank
    hears done (1); then `agree` on the outcomes."""
    flags = cpu_group(group)                     # a CPU flag: the group's own where it has CPU
    out: list = [None]
    thread = None
    if work is not None:
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def run() -> None:
            try:
                if cuda is not None:
                    torch.cuda.set_device(cuda)      # the device is per thread
                out[0] = _run_caught(work)
            except BaseException as exc:  # noqa: BLE001 - SystemExit and the like end only this
                out[0] = f"{type(exc).__name__}: {exc}"     # thread: a failure all the same

        thread = threading.Thread(target=run, name="fsdp_sync-rank0-work", daemon=True)
        thread.works_for = threading.current_thread()   # what it notes is this sync's (`fleet`)
        thread.start()
    done = torch.zeros(1, dtype=torch.int64)
    with released_by_backend(done):
        while not int(done.item()):
            done.fill_(1)
            if thread is not None:
                thread.join(round_s)
                done.fill_(0 if thread.is_alive() else 1)
            tell(done, flags)
    agree(out[0], group, what=what)


def _run_caught(work: Callable[[], Any]) -> Any:
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - every rank hears of it through `agree`
        return exc


def let_go_of_frames(exc: BaseException) -> None:
    """Let go of the locals of every frame a failed sync's error came through (and its causes'):
    those frames have returned, but the error keeps them, and the caller keeps the error (it is
    raised again, it is in a cycle with the frame that holds it until the garbage collector runs),
    so a bucket's buffers (shared memory, a host-shared segment every rank maps) would outlive the
    failed sync by as long. The traceback still says where it failed. (Found on 2 gloo ranks: a
    refused per-rank bucket's host-shared segments stayed mapped on trainer rank 1 until a
    collection, `tests/test_distributed.py`.)"""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)    # the frame still running is left as it is
        e = e.__cause__ or e.__context__
