"""What every trainer rank checks of the module before a sync's export runs its first collective.

Every collective of the export (FSDP2's per-parameter or per-bucket all-gathers, FSDP1's state-dict
all-gathers, the tied-head check's gathers) runs once per exported tensor, in `export.param_metas`
order, with that tensor's size. Ranks that hold different models (a buffer registered on one rank
only, a parameter shaped otherwise, one layer more) do not fail there with an error: they block in
mismatched collectives until the group's timeout and then each raises a different backend error,
or gloo aborts the process ("collective mismatch", SIGABRT). So the sync first compares, across
every rank of the default group, a digest of what each rank would export (`agree_on_model`): the
names, rollout dtypes and full shapes of `export.param_metas` (parameters and persistent buffers,
the buffers the export leaves out excepted; with ``lora="adapter"`` the adapter's tensors too) and
the config's ``tie_word_embeddings`` (it decides whether the tied-head check gathers), and the
`SyncConfig` fields that decide the sync's collectives (`SETTINGS`: a rank with another
``bucket_bytes`` plans other buckets).
`param_metas` moves no data and runs no collective (FSDP1: the flat parameters' metadata; FSDP2:
``state_dict(keep_vars=True)`` of DTensors), and the digest travels in the status all-reduce the
sync runs at that point anyway (`topology.agree`'s ``digest``): no extra round trip. Only where the
digests differ are the lists gathered, and every rank raises the same `SyncError` naming the first
rank that differs and the first tensor with both ranks' dtypes and shapes (or the rank it is only
on).

In the same all-reduce: `state_dict_refusal`, an FSDP1 state-dict type the module's units cannot
give (torch's LOCAL state dict under a ``device_mesh``, or over a shard group smaller than the
default group: HSDP with ``process_group=(shard, replicate)``), said in `SyncConfig`'s words.
After it, the tied head (`tied.module_refusal`), agreed apart only where it has anything to compare.

Not here: whether the trainer's model matches the engine's (`config_check`, the manager's coverage
check); the tied-head check itself (`tied`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from ..topology import RanksDiffer, SyncError, agree, cpu_group
from . import export, tied

__all__ = ["SETTINGS", "model_entries", "digest_of", "describe_difference", "agree_on_model", "state_dict_refusal",
           "check_module"]

Entry = tuple[str, str, tuple[int, ...]]
"""(name, dtype, shape): one exported tensor, or one setting (``(config) ...``, its value, ())."""

_TIE = "(config) tie_word_embeddings"
_SETTING = "(config) SyncConfig."

SETTINGS = ("method", "strategy", "bucket_bytes", "fsdp1_state_dict", "share_host_memory", "layout",
            "pipelined", "quantization", "dist_format", "verify", "lora")
"""`SyncConfig` fields that decide which collectives a trainer rank's sync runs (how the export
buckets and gathers, which transport, what is verified after): compared with the model, as a rank
whose ``bucket_bytes`` differs plans other buckets and blocks in mismatched all-gathers until the
process group's timeout (measured: 65 s, then raw gloo errors on 2 ranks)."""


def model_entries(module: torch.nn.Module, config: Any) -> list[Entry]:
    """What this rank would export under ``config``, as comparable entries (see the docstring)."""
    metas = export.param_metas(module, config.dtype)
    if getattr(config, "lora", "off") == "adapter":
        metas = metas + export.param_metas(module, config.dtype, lora=True)
    out: list[Entry] = [(m.name, str(m.dtype).removeprefix("torch."), tuple(int(s) for s in m.shape))
                        for m in metas]
    out.append((_TIE, str(tied.ties(getattr(module, "config", None))), ()))
    out.extend((_SETTING + f, repr(getattr(config, f)), ()) for f in SETTINGS if hasattr(config, f))
    return out


def digest_of(entries: list[Entry]) -> int:
    """An int in [0, 2**62) (`topology.agree`'s digest range) of ``entries``, in order."""
    h = hashlib.blake2b(repr(entries).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2


def _fmt(entry: Entry) -> str:
    name, dtype, shape = entry
    return dtype if name.startswith("(config) ") else f"{dtype} {shape}"


def describe_difference(lists: list[list[Entry]]) -> str:
    """The first rank that differs from the most common list (ties: the lowest rank's) and the
    first tensor where it does. Deterministic: every rank computes the same text."""
    keys = [repr(x) for x in lists]
    counts = Counter(keys)
    top = max(counts.values())
    ref = min(r for r, k in enumerate(keys) if counts[k] == top)
    other = next(r for r, k in enumerate(keys) if k != keys[ref])
    odd = [r for r, k in enumerate(keys) if k != keys[ref]]
    a, b = lists[ref], lists[other]
    da, db = {e[0]: e for e in a}, {e[0]: e for e in b}
    where, setting = None, False
    for e in a + b:       # in export order: the reference's, then what only the other has
        name = e[0]
        if name not in db:
            where = f"{name!r} ({_fmt(da[name])}) is only on rank {ref}, not on rank {other}"
        elif name not in da:
            where = f"{name!r} ({_fmt(db[name])}) is only on rank {other}, not on rank {ref}"
        elif da[name] != db[name]:
            setting = name.startswith(_SETTING)
            what = ("model.config.tie_word_embeddings" if name == _TIE
                    else name.removeprefix("(config) ") if setting else repr(name))
            where = (f"{what} is {_fmt(db[name])} on rank {other}, {_fmt(da[name])} on rank {ref}")
        if where is not None:
            break
    if where is None:     # the same tensors, listed in another order
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        where = (f"the same tensors in another order: export position {i} is {a[i][0]!r} on rank "
                 f"{ref}, {b[i][0]!r} on rank {other}")
    more = f" (ranks {odd} differ from rank {ref})" if len(odd) > 1 else ""
    if setting:
        return (f"the trainer ranks' sync settings differ: rank {other} differs from rank {ref}{more}: "
                f"{where}. It decides the sync's collectives, so they would not match (a hang "
                f"until the process group's timeout, or a crash); nothing was sent. Pass every "
                f"rank the same SyncConfig")
    return (f"the trainer ranks hold different models: rank {other} differs from rank {ref}{more}: "
            f"{where}. The sync's collectives run once per exported tensor, so they would not "
            f"match (a hang until the process group's timeout, or a crash); nothing was sent. "
            f"Every rank must build the same model (same config and code, the same buffers "
            f"registered) and wrap it alike")


def agree_on_model(module: torch.nn.Module, config: Any, error: Any, *, what: str) -> None:
    """`topology.agree` of ``error`` over the default group, carrying this rank's model digest:
    raises the same `SyncError` on every rank if any rank failed or the ranks' models differ
    (that one first: it is what makes the others fail; the errors are named after it)."""
    entries: list[Entry] | None = None
    digest = 0
    try:
        entries = model_entries(module, config)
        digest = digest_of(entries)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the agree below
        error = error or f"{type(exc).__name__}: {exc}"
    try:
        agree(error, what=what, digest=digest)
    except RanksDiffer as exc:
        lists: list = [None] * dist.get_world_size()
        dist.all_gather_object(lists, entries, group=cpu_group())
        if any(x is None for x in lists):    # some rank could not list its model: its error
            raise exc.error from None
        text = describe_difference(lists)
        if exc.error is not None:
            text += f"; besides, {exc.error}"
        err = SyncError(f"{what} failed: {text}")
        err.failures = dict(exc.failures) or {0: text}
        raise err from None


def state_dict_refusal(module: torch.nn.Module, config: Any) -> str | None:
    """Why ``config.fsdp1_state_dict`` cannot export ``module``, or None, said before the export,
    naming the field and the values that work. Torch's LOCAL state dict cannot give:
    - an FSDP1 unit made with a ``device_mesh`` (HSDP's 2-D mesh, or a 1-D one) that shards: it
      refuses it ("DeviceMesh is not compatible with LOCAL_STATE_DICT", raised inside the export,
      naming no field of the sync's; a unit whose shard group has one rank runs as NO_SHARD and
      is not refused);
    - a unit that shards over a group smaller than the default group (HYBRID_SHARD with
      ``process_group=(shard, replicate)``, both > 1 rank; any sharding over a subgroup): torch
      places each local shard at the unit's rank *in its shard group* as if it were a global rank
      (``_local_post_state_dict_hook``), so on every shard group but ``[0, k)`` the export fails
      ("Global rank 1 does not exist in input process group: [2, 3]") on some ranks while the
      others wait in its ``all_gather_object``: a wrong error, or a hang until the process
      group's timeout. "sharded" and "full" export these units bit-exact."""
    if getattr(config, "fsdp1_state_dict", None) != "local":
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    units = FSDP.fsdp_modules(module)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    meshed = [u for u in units if getattr(u, "_device_mesh", None) is not None
              and u.sharding_strategy != ShardingStrategy.NO_SHARD]
    if meshed:
        u = meshed[0]
        # process_group= exports with "local" only where the shard group is the default group
        instead = (", or wrap with process_group= instead of device_mesh="
                   if u.process_group.size() == world else "")
        return (f"SyncConfig.fsdp1_state_dict='local' cannot export this FSDP1 model: its units were made "
                f"with a device_mesh ({u.sharding_strategy.name} over a mesh of shape "
                f"{tuple(u._device_mesh.shape)}, {len(meshed)} units), and torch's LOCAL_STATE_DICT "
                f"refuses a DeviceMesh; set SyncConfig.fsdp1_state_dict='sharded' (a 1/W sharded copy "
                f"while it streams) or 'full' (the whole model on every rank){instead}")
    sub = [u for u in units if u._handle is not None and u._handle.uses_sharded_strategy
           and u.process_group.size() < world]
    if not sub:
        return None
    u = sub[0]
    ranks = dist.get_process_group_ranks(u.process_group)
    return (f"SyncConfig.fsdp1_state_dict='local' cannot export this FSDP1 model: on rank "
            f"{dist.get_rank()} its units shard over a process group of {len(ranks)} of the default "
            f"group's {world} ranks ({u.sharding_strategy.name}, shard group {ranks}, {len(sub)} "
            f"units), and torch's LOCAL_STATE_DICT places each shard at its rank in that group as "
            f"if it were a global rank: the export fails on some ranks and hangs on the others; "
            f"set SyncConfig.fsdp1_state_dict='sharded' (a 1/W sharded copy while it streams) or "
            f"'full' (the whole model on every rank)")


def check_module(module: torch.nn.Module, config: Any, error: Any, *, what: str) -> None:
    """Everything checked of the module on every rank before the export's first collective:
    the ranks' models agree (`agree_on_model`, with ``error``, this rank's own finding, in the
    same all-reduce), then the tied head (`tied.module_refusal`), which gathers only where the
    config ties it and the trainer exports a head of its own (then one more agree; the same
    choice on every rank, their models agreeing). ``error``, if None, becomes this rank's
    `state_dict_refusal` (an FSDP1 state-dict type its units cannot give)."""
    try:
        error = error or state_dict_refusal(module, config)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the agree below
        error = f"{type(exc).__name__}: {exc}"
    agree_on_model(module, config, error, what=what)
    names = (m.name for m in export.param_metas(module, config.dtype))
    if not tied.needs_check(names, tied.ties(getattr(module, "config", None))):
        return
    try:
        head = tied.module_refusal(module, fsdp1_state_dict=config.fsdp1_state_dict, dtype=config.dtype)
    except Exception as exc:  # noqa: BLE001 - reported to every rank just below
        head = f"{type(exc).__name__}: {exc}"
    agree(head, what=what)
