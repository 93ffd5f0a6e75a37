"""``update_weights_from_distributed`` on a reference engine, from the client's side: joining and
leaving SGLang's weight-update group, and receiving one call's broadcast all or nothing. A mixin of
`ReferenceEngine`: it uses the engine's lock and update gate (``_gate``: the scheduler's writer
gate and the lock, bounded by `wait_limit`), its two-phase rounds (``_two_phase``) and the
weight-version bookkeeping (``_versioned``).

Not here: the workers' receive (`worker.Worker.receive_broadcast`), checking a call's entries
(`update_items`), the trainer's send (`fsdp_sync.transport.distributed`).
"""

from __future__ import annotations

from ..base import EngineError, EngineStateError, WeightUpdateError
from .scheduler import check_version
from .update_items import check_entries, distributed_entries

__all__ = ["UpdateGroupCalls"]


class UpdateGroupCalls:
    """`ReferenceEngine`'s update-group methods (see the module docstring)."""

    @property
    def update_group_backends(self) -> tuple[str, ...]:
        """The ``backend`` values `init_weights_update_group` takes: gloo on CPU, NCCL (SGLang's
        default) or gloo on CUDA."""
        return ("nccl", "gloo") if self.device == "cuda" else ("gloo",)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        """Join SGLang's weight-update group: TP worker r as rank ``rank_offset + r`` of
        ``world_size``, the trainer as rank 0 (hosting the store at ``master_address:master_port``).
        Blocks until every rank has joined. A group of the same name is replaced (SGLang leaks it)."""
        what = f"init_weights_update_group({group_name!r})"
        if not group_name:
            raise WeightUpdateError(f"{what}: the group name must not be empty")
        if backend not in self.update_group_backends:
            raise WeightUpdateError(f"{what}: backend {backend!r} is not one this {self.device} engine "
                                    f"joins; expected one of {list(self.update_group_backends)}")
        if not (isinstance(master_address, str) and master_address) or isinstance(master_port, bool) \
                or not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise WeightUpdateError(f"{what}: master_address must be a host name and master_port in "
                                    f"1..65535, got {master_address!r}:{master_port!r}")
        if not (_is_int(rank_offset) and rank_offset >= 1
                and _is_int(world_size) and rank_offset + self.tp_size <= world_size):
            raise WeightUpdateError(f"{what}: ranks {rank_offset}..{rank_offset + self.tp_size - 1} "
                                    f"(rank_offset {rank_offset!r}, tp {self.tp_size}) do not fit a "
                                    f"group of world_size {world_size!r} whose rank 0 is the trainer")
        with self._gate(what, exclusive=False):
            self._check_usable()
            if group_name in self._update_groups:
                self._destroy_group(group_name)
            args = [{"group_name": group_name, "backend": str(backend), "master_address": str(master_address),
                     "master_port": int(master_port), "world_size": world_size,
                     "rank": rank_offset + r} for r in range(self.tp_size)]
            replies = self._round("join_group", per_rank=args, what=what)
            if any(rep[0] != "ok" for rep in replies.values()):
                self._round("leave_group", {"group_name": group_name}, ranks=self._responsive(),
                            what=what + " (undo)")
                self._raise_errors(replies, what)
            self._update_groups[group_name] = {"world_size": world_size, "rank_offset": rank_offset,
                                               "backend": str(backend)}

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the group on every worker. An unknown name is refused, as SGLang does."""
        with self._gate(f"destroy_weights_update_group({group_name!r})", exclusive=False):
            if group_name not in self._update_groups:
                raise WeightUpdateError(f"destroy_weights_update_group: no group {group_name!r} "
                                        f"(known: {sorted(self._update_groups)})")
            self._check_usable()
            self._destroy_group(group_name)

    def _destroy_group(self, group_name: str) -> None:
        self._update_groups.pop(group_name, None)
        self._raise_errors(self._round("leave_group", {"group_name": group_name}, ranks=self._responsive(),
                                       what=f"destroy_weights_update_group({group_name!r})"),
                           "destroy_weights_update_group")

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True, load_format: str | None = None,
                                        weight_version: str | None = None) -> None:
        """Receive tensors broadcast by rank 0 of ``group_name`` and load them, all or nothing.

        ``load_format=None``: one broadcast per tensor, in ``names`` order. ``"flattened_bucket"``:
        one broadcast of all of them, tightly packed in ``names`` order (each offset a multiple of
        its dtype size). ``"per_rank_bucket"`` (fsdp_sync's, not SGLang's): ``names`` are the
        engine's own parameter names and ``shapes`` one TP rank's shard shapes; each worker
        receives only its own shard, one point-to-point message from group rank 0 laid out by
        `wire.per_rank_bucket_plan`. dtypes are torch attribute names (``"bfloat16"``). Refused before any
        worker joins the broadcast: no open `begin_weight_update`, an unknown group, a bad dtype,
        shape or layout, lengths that differ. A sender that dies mid-broadcast makes the workers
        give up after ``update_recv_timeout_s``; the group is then dropped (make it again) and the
        previous weights serve. ``weight_version``: the version the loaded weights are (at the
        transaction's commit, in a transactional update)."""
        what = f"update_weights_from_distributed(load_format={load_format!r}, {len(names)} tensors)"
        check_version(weight_version, what)
        with self._gate(what):
            self._check_usable()
            if not self._in_txn:
                raise EngineStateError(f"{what}: no open weight update: call begin_weight_update() "
                                       f"first (SGLang 0.5.21+ refuses updates outside begin/end)")
            self._check_not_aborted(what)
            try:
                entries = distributed_entries(names, dtypes, shapes, load_format)
                check_entries(entries, self.layout, self.dtype, load_format)   # before joining
                if group_name not in self._update_groups:
                    raise WeightUpdateError(f"unknown weight-update group {group_name!r} (known: "
                                            f"{sorted(self._update_groups)}); call init_weights_update_group first")
            except WeightUpdateError as exc:
                self._abort_all(what, str(exc))
                raise WeightUpdateError(f"{what}: {exc}", name=exc.name) from None
            spec = {"group_name": group_name, "load_format": load_format, "entries": entries}
            try:
                self._two_phase([spec] * self.tp_size, what, cmd="stage_broadcast")
            except WeightUpdateError:
                # a receive that failed (sender gone, timeout) leaves the group unusable: drop it
                if any(not p.is_alive() for p in self._w.procs) or self._broken:
                    raise
                try:
                    self._destroy_group(group_name)
                except EngineError:
                    pass
                raise
            self._after_update(weight_version, flush_cache)


def _is_int(value) -> bool:
    """An int that is not a bool: ``rank_offset=True`` would otherwise join as rank 1."""
    return isinstance(value, int) and not isinstance(value, bool)
