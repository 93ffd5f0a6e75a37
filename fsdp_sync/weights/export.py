"""Export: an FSDP1, FSDP2 or plain module -> a lazy stream of full, Hugging Face-named tensors.

Three entry points, all collective over the module's shard group when the module is sharded (every
rank calls them with the same arguments and consumes the same number of items):

- `param_metas(module, dtype)`: name, rollout dtype and full shape of every exported tensor, in
  checkpoint (``state_dict``) order, without moving any data. This is what buckets are planned from.
- `iter_params(module, dtype=...)`: ``(name, full tensor)`` one at a time.
- `iter_buckets(module, bucket_bytes, dtype=...)`: ``(bucket.Bucket, flat uint8 buffer)`` laid out by
  `bucket.plan_buckets` over `param_metas`, the buffer from ``alloc`` (shared memory by default, so
  `handles` can share it without a copy).

What is exported: the module's ``state_dict`` entries that are tensors, named as in a Hugging Face
checkpoint (wrapper prefixes ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``,
``_orig_mod.`` and a leading ``module.`` stripped, see `hf_name`), each tensor once: a tied weight
(``lm_head.weight`` tied to ``model.embed_tokens.weight``) is exported under its first name only, as
``save_pretrained`` does. Buffers that are not weights (rotary ``inv_freq``: `NON_WEIGHT_BUFFERS`)
are left out. MoE experts leave under their Hub names too: transformers 5's fused
``experts.gate_up_proj`` / ``experts.down_proj`` are cut into one item per expert and projection
(`experts.hub_parts`), each a contiguous range of the fused tensor's shards, so no rank ever holds
a fused tensor whole: a stream holds at most one expert's slice (or one bucket) beyond the shards. With ``dtype`` set, floating-point tensors are cast to it (not a float32 one SGLang keeps in
float32, `float32_params`); the cast is done on the
local shard before any gather (fewer bytes on the wire, the same bits as casting the full tensor).
Non-float buffers keep their dtype; a non-float *parameter* asked to be cast is an error.

How each kind of module is gathered, and the memory it costs beyond the trainer's own shards:

- plain ``nn.Module``: no gather. `iter_params` yields the tensor itself (detached) when no cast
  is asked; `iter_buckets` costs one bucket buffer.
- FSDP2 (``Shard(0)`` DTensors on a 1-D mesh): `iter_params` casts the local shard and runs one
  ``all_gather_into_tensor`` per parameter (what ``full_tensor()`` does, without the functional-
  collective wrappers): one full parameter at a time. `iter_buckets` packs every local shard of a
  bucket into one send buffer and runs ONE ``all_gather_into_tensor`` per bucket: scratch of about
  one bucket (receive) plus bucket/W (send), reused across buckets, plus the bucket buffer itself.
- FSDP1 ``"local"``: LOCAL ``state_dict()`` hands out views of the flat-parameter shards (no copy,
  no collective); each parameter's pieces are located from the flat parameter's metadata and
  gathered as above (per parameter, or one all-gather per bucket). Best bound: one parameter (or
  one bucket) beyond the shards.
- FSDP1 ``"sharded"``: torch's SHARDED ``state_dict()`` itself unshards unit by unit and keeps a
  sharded *copy* of every parameter (1/W of the model) until the stream ends; the root unit stays
  unsharded while it runs. The ``ShardedTensor`` shards are then gathered as above.
- FSDP1 ``"full"``: torch's FULL ``state_dict()`` materializes the WHOLE model, full size and in
  the training dtype, on every rank before the first item (the cast comes after the gather);
  entries are dropped as they are yielded. It exists because it is what verl used for HF-style
  rollouts; prefer ``"local"``.
- Other DTensor placements (HSDP's 2-D mesh, tensor-parallel ``Shard(1)``): cast locally, then
  ``full_tensor()`` per parameter, in both entry points.

A stream holds at most the item being produced: a yielded tensor (or bucket buffer) belongs to the
caller, and the generator keeps no reference to it. The state-dict type of an FSDP1 module is
switched only around its ``state_dict()`` call (`state_dict_type`) and restored at once, so a
suspended stream does not leave the module in a foreign type.

A failure found before the first collective on any rank (a shard that contradicts its metadata, a
cast the rule forbids), or before a bucket's (its buffer's allocation, `gather.alloc_bucket`), is
raised on every rank as `topology.SyncError` naming the failing rank, so no peer waits in a gather. Stopping a stream early must happen on every rank at the same item.

Modules that are part of a larger FSDP tree are refused with an error that says what to pass,
never exported as partial or wrong tensors: an inner FSDP1 unit or inner ``fully_shard`` module
after the root's first forward (torch marks it non-root then), and a module holding parameters
that an FSDP1 unit outside it has flattened (``accelerator.unwrap_model`` of an FSDP1 model: the
module inside the root wrapper, whose own parameters are shards of the root's flat parameter).
Before the first forward torch has not yet told inner units from the root, so an inner unit
handed over then is exported as what it is: its own parameters, bit-exact, under its own names.

At about 650 lines (a third of it this docstring) it is one concept that reads best whole: what
each kind of module exports, in which order, and where each tensor's data lives.

Not here: the collectives that gather the pieces (`gather`), the host-shared buffer (`hostbuf`),
planning (`bucket`), handles (`handles`), who sends payloads where (`topology`, transports), or
moving FSDP parameters between devices (the manager's memory stages).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import bucket as _bucket
from . import experts as _experts
from . import float32_params
from . import handles as _handles
from .gather import (Pieces, Received, Scratch, agree_group, alloc_bucket, fill_bucket, fill_shared, materialize,
                     shared_group, sub_pieces)
from .hostbuf import HostShared
from .items_memo import ItemsMemo, submodules, tensors_key
from .peft_names import base_parts, is_lora, select  # noqa: F401 - is_lora: part of the export API
from .shards import dim0_pieces, rank as _rank, sharded_tensor_pieces
from ..topology import agree

__all__ = [
    "param_metas", "iter_params", "iter_buckets", "state_dict_type", "state_dict_bytes_in", "hf_name", "resolve",
    "STATE_DICT_TYPES", "WRAPPER_PREFIXES", "NON_WEIGHT_BUFFERS",
]

STATE_DICT_TYPES = ("full", "sharded", "local")
"""FSDP1 state-dict types `iter_params` / `iter_buckets` accept as ``fsdp1_state_dict``."""

WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""Name components added by wrappers (FSDP1, activation checkpointing, torch.compile); dropped
wherever they appear. A leading ``module`` (DDP and friends) is dropped too."""

NON_WEIGHT_BUFFERS = ("inv_freq", "original_inv_freq")
"""Buffer names (last name component) that are computed, not weights: never exported."""

_FLAT_PARAM = "_flat_param"


@functools.lru_cache(maxsize=1 << 16)     # a pure function of the key, asked for every key of every sync
def hf_name(name: str) -> str:
    """The Hugging Face checkpoint name of a (possibly wrapped) module's state-dict key. A peft
    model's base weights lose peft's levels (`peft_names`)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PREFIXES]
    while parts and parts[0] == "module":
        parts.pop(0)
    return ".".join(base_parts(parts))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --------------------------------------------------------------------------- what is exported

@dataclass
class _Item:
    """One exported tensor: what it is, and (once the source is resolved) where its data lives."""

    name: str
    shape: tuple[int, ...]
    src_dtype: torch.dtype
    is_param: bool
    full: torch.Tensor | None = None       # the whole tensor on this rank
    dtensor: Any = None                    # a DTensor gathered with full_tensor()
    pieces: Pieces | None = None          # gathered with one all-gather (alone or per bucket)
    # FSDP1 flat-parameter layout (param_metas and the "local" type)
    unit: Any = None
    offset: int = 0
    src: int = -1                          # its entry's index in the state dict it came from

    def out_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is None or dtype == self.src_dtype:
            return self.src_dtype
        if self.src_dtype.is_floating_point:     # float32 where SGLang keeps it (`float32_params`)
            return float32_params.out_dtype(self.name, self.src_dtype, dtype)
        if self.is_param:
            raise TypeError(f"cannot cast parameter {self.name!r} of dtype "
                            f"{_bucket.dtype_name(self.src_dtype)} to {_bucket.dtype_name(dtype)} "
                            f"(rank {_rank()}): only floating-point parameters are cast")
        return self.src_dtype   # integer/bool buffers keep their dtype

    def drop(self) -> None:
        self.full = self.dtensor = self.pieces = None


@functools.lru_cache(maxsize=1)
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        return None
    return DTensor


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()      # imported once, not per tensor (every tensor of every sync asks)
    return cls is not None and isinstance(t, cls)


def _fsdp1_units(module: nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return []
    return [m for m in submodules(module) if isinstance(m, FSDP)]


def _skip(name: str, is_param: bool) -> bool:
    return not is_param and name.rsplit(".", 1)[-1] in NON_WEIGHT_BUFFERS


_PASS_ROOT = ("pass the root: the model `accelerator.prepare` returned (for FSDP1 the "
              "FullyShardedDataParallel wrapper, not `accelerator.unwrap_model` of it), or the "
              "module you wrapped with FSDP / fully_shard last")


def _fsdp_flattened(p: Any) -> bool:
    """A parameter FSDP1 has folded into a flat parameter (its own ``_fsdp_flattened`` mark,
    set on the FlatParameter and, with ``use_orig_params``, on each original parameter)."""
    return bool(getattr(p, "_fsdp_flattened", False))


def _foreign_error(module: nn.Module, names: list[str]) -> ValueError:
    return ValueError(
        f"cannot export {type(module).__name__} (rank {_rank()}): {names[:4]}"
        f"{' ...' if len(names) > 4 else ''} are held by an FSDP1 unit outside this module, so "
        f"what it holds are shards of a flat parameter, not the weights (this is what "
        f"`accelerator.unwrap_model` returns for an FSDP1 model: the module inside the root "
        f"FullyShardedDataParallel, without the root's flat parameter); {_PASS_ROOT}")


def _check_root(module: nn.Module, units: list) -> None:
    """Refuse a module that is part of a larger FSDP tree: an inner FSDP1 unit or an inner
    ``fully_shard`` module once the root has run (``_is_root`` is False: torch set it at the
    root's first forward), or a module whose FSDP1 units all answer to a root outside it."""
    if units:
        if module in units:
            if module._is_root is False:
                raise ValueError(f"cannot export an inner FSDP1 unit (rank {_rank()}): "
                                 f"FullyShardedDataParallel around "
                                 f"{type(module.module).__name__} holds only its own part of "
                                 f"the model; {_PASS_ROOT}")
        elif all(u._is_root is False for u in units):
            raise ValueError(f"cannot export {type(module).__name__} (rank {_rank()}): its FSDP1 "
                             f"units answer to a root FullyShardedDataParallel outside it, which "
                             f"holds the rest of the weights (e.g. `accelerator.unwrap_model` of "
                             f"an FSDP1 model); {_PASS_ROOT}")
        return
    state = getattr(module, "_get_fsdp_state", None)
    if callable(state):
        try:
            is_root = state()._is_root
        except (AssertionError, AttributeError, RuntimeError):
            return
        if is_root is False:
            raise ValueError(f"cannot export an inner fully_shard module (rank {_rank()}): "
                             f"{type(module).__name__} holds only its own part of the model; "
                             f"{_PASS_ROOT}")


def _state_dict_items(module: nn.Module, sd: dict | None = None) -> list[_Item]:
    """Plain modules and FSDP2 (or any DTensor) modules: ``state_dict(keep_vars=True)`` (or
    ``sd``, that of ``module``), which moves no data, keeps Parameter identity (tied weights are
    one object) and state-dict order."""
    items: list[_Item] = []
    seen: dict[int, str] = {}
    foreign: list[str] = []
    sd = module.state_dict(keep_vars=True) if sd is None else sd
    for src, (key, value) in enumerate(sd.items()):
        if not isinstance(value, torch.Tensor):
            continue  # _extra_state and the like
        name = hf_name(key)
        is_param = isinstance(value, nn.Parameter)
        if is_param and _fsdp_flattened(value):
            foreign.append(name)
        if foreign or _skip(name, is_param) or id(value) in seen:
            continue
        seen[id(value)] = name
        item = _Item(name, tuple(value.shape), value.dtype, is_param, src=src)
        if _is_dtensor(value):
            item.dtensor = value
        else:
            item.full = value.detach()
        items.append(item)
    if foreign:
        raise _foreign_error(module, foreign)
    return items


def _fsdp1_layout(module: nn.Module, units: list) -> list[_Item]:
    """FSDP1: every exported tensor from the flat parameters' metadata (no state_dict, no data),
    in the unwrapped module's state-dict order: modules in registration (DFS) order, each module's
    parameters before its persistent buffers."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    mod_names = {id(m): hf_name(n) for n, m in module.named_modules()}
    mod_order = {id(m): i for i, m in enumerate(module.modules())}
    keyed: list[tuple[tuple, _Item]] = []
    covered: set[tuple[int, str]] = set()
    seq = 0
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        fp = handle.flat_param
        infos = iter(fp._param_infos)
        shapes = iter(fp._shapes)
        offset = 0
        for numel, is_pad in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not is_pad:
                info, shape = next(infos), next(shapes)
                name = _join(mod_names[id(info.module)], info.param_name)
                item = _Item(name, tuple(shape), fp.dtype, True, unit=unit, offset=offset)
                keyed.append(((mod_order[id(info.module)], 0, seq), item))
                covered.add((id(info.module), info.param_name))
                seq += 1
            offset += numel
        for shared in fp._shared_param_infos:   # tied aliases: exported under the primary name
            covered.add((id(shared.module), shared.param_name))
    seen: set[int] = set()
    own_flat = {id(u._handle.flat_param) for u in units if u._handle is not None}
    # with use_orig_params, a tied weight whose modules two units hold (an embedding wrapped apart,
    # lm_head in the root): the second module keeps the original parameter the first unit flattened
    own_flat.update(id(q) for u in units if u._handle is not None
                    for q in (u._handle.flat_param._params or ()))
    foreign: list[str] = []
    for m in module.modules():
        prefix = mod_names[id(m)]
        for pname, p in m._parameters.items():  # parameters FSDP does not manage (ignored modules)
            if p is None or (id(m), pname) in covered or id(p) in own_flat:
                continue
            if isinstance(p, FlatParameter) or _fsdp_flattened(p):   # a unit outside `module`
                foreign.append(_join(prefix, pname))
                continue
            if id(p) in seen:
                continue
            seen.add(id(p))
            item = _Item(_join(prefix, pname), tuple(p.shape), p.dtype, True, full=p.detach())
            keyed.append(((mod_order[id(m)], 0, seq), item))
            seq += 1
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set or id(b) in seen:
                continue
            name = _join(prefix, bname)
            if _skip(name, False):
                continue
            seen.add(id(b))
            keyed.append(((mod_order[id(m)], 1, seq), _Item(name, tuple(b.shape), b.dtype, False,
                                                             full=b.detach())))
            seq += 1
    if foreign:
        raise _foreign_error(module, foreign)
    keyed.sort(key=lambda kv: kv[0])
    return [item for _, item in keyed]


def _layout(module: nn.Module, lora: bool = False) -> list[_Item]:
    units = _fsdp1_units(module)
    _check_root(module, units)
    return _hub_items(select(_fsdp1_layout(module, units) if units else _state_dict_items(module), lora),
                      _experts.model_type_of(module), data=False)


def _hub_items(items: list[_Item], model_type: str | None, data: bool = True) -> list[_Item]:
    """transformers 5's fused expert tensors cut into per-expert items under their Hub names
    (`experts.hub_parts`): each a contiguous range of the fused tensor, so its data is a slice of
    a piece (sharded), a view (whole) or a range of an FSDP1 flat parameter. ``data=False``: names
    and shapes only (`param_metas`)."""
    out: list[_Item] = []
    for it in items:
        parts = _experts.hub_parts(it.name, it.shape, model_type)
        if parts is None:
            out.append(it)
            continue
        if data and it.dtensor is not None:
            raise ValueError(f"{it.name!r} (rank {_rank()}): a fused expert tensor held as a DTensor "
                             f"with placements {tuple(it.dtensor.placements)} cannot be cut expert by "
                             f"expert without gathering all of it; shard it with fully_shard (Shard(0) "
                             f"on a 1-D mesh) or FSDP1")
        flat = it.full.reshape(-1) if data and it.full is not None else None
        for name, shape, off in parts:
            n = math.prod(shape)
            sub = _Item(name, shape, it.src_dtype, it.is_param, unit=it.unit, offset=it.offset + off)
            if flat is not None:
                sub.full = flat[off:off + n].view(shape)
            elif data and it.pieces is not None:
                sub.pieces = sub_pieces(it.pieces, off, n)
            out.append(sub)
        if data:
            it.drop()
    return out


def param_metas(module: nn.Module, dtype: torch.dtype | None = None, *,
                lora: bool = False) -> list[_bucket.TensorMeta]:
    """Name (HF), rollout dtype and full shape of every exported tensor, in state-dict order
    (``lora``: of the LoRA tensors instead of the base weights).

    Moves no data and runs no collective: callable on one rank alone. Worked out again only when
    the module's parameters and buffers are other objects, or of other dtypes or shapes, than when
    it was last asked (one added, replaced, tied, wrapped, cast in place): every sync asks, and the
    layout walk is 6 ms of a 338-tensor sync on this host, the walk that tells whether anything
    changed (`items_memo.tensors_key`) 0.3 ms.
    """
    _check_dtype(dtype)
    key = tensors_key(module)
    known = _METAS.setdefault(module, {})
    hit = known.get((dtype, lora))
    if hit is None or hit[0] != key:
        hit = known[(dtype, lora)] = (key, tuple(_bucket.TensorMeta(it.name, it.out_dtype(dtype), it.shape)
                                                 for it in _layout(module, lora)))
    return list(hit[1])


_METAS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
"""`param_metas`' answers per module, (dtype, lora) -> (the module's tensors' ids, the metas)."""


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"the rollout dtype must be a floating-point torch.dtype, got {dtype!r}")


# --------------------------------------------------------------------------- FSDP1 state dicts

@contextlib.contextmanager
def state_dict_type(module: nn.Module, kind: str) -> Iterator[None]:
    """Switch every FSDP1 unit under ``module`` to state-dict type ``kind`` ("full", "sharded",
    "local"); on exit, exceptions included, give each unit back exactly the settings it had."""
    from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                        LocalStateDictConfig, ShardedStateDictConfig,
                                        StateDictType)

    if kind not in STATE_DICT_TYPES:
        raise ValueError(f"fsdp1_state_dict must be one of {STATE_DICT_TYPES}, got {kind!r}")
    units = FSDP.fsdp_modules(module)
    if not units:
        raise ValueError(f"state_dict_type needs an FSDP1 module; {type(module).__name__} holds "
                         f"no FullyShardedDataParallel unit")
    if kind == "full":
        # offload_to_cpu=True crashes on CPU in torch 2.13 (setStorage out of bounds / segfault,
        # and the module is unusable afterwards); rank0_only=False because every rank exports.
        new = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False,
                                                                  rank0_only=False))
    elif kind == "sharded":
        # shards stay on the device they live on: they are gathered from there
        new = (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=False))
    else:
        new = (StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(offload_to_cpu=False))
    saved = [(u, u._state_dict_type, u._state_dict_config, u._optim_state_dict_config)
             for u in units]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "state_dict_type is deprecated"
            FSDP.set_state_dict_type(module, *new)
        yield
    finally:
        for u, sd_type, sd_config, optim_config in saved:
            u._state_dict_type = sd_type
            u._state_dict_config = sd_config
            u._optim_state_dict_config = optim_config


def _fsdp1_state_dict(module: nn.Module, kind: str) -> dict[str, Any]:
    with state_dict_type(module, kind), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # ShardedTensor deprecation notices
        warnings.simplefilter("ignore", UserWarning)     # _get_pg_default_device notices
        sd = module.state_dict()
    return {hf_name(k): v for k, v in sd.items()}


def state_dict_bytes_in(module: nn.Module, kind: str) -> int:
    """The bytes this rank receives while torch builds an FSDP1 ``kind`` state dict: "full" and
    "sharded" unshard every sharded unit (an all-gather of its padded flat parameter, in its own
    dtype); "local" and a module that is not FSDP1 gather nothing. From sizes known here."""
    if kind == "local":
        return 0
    n = 0
    for u in _fsdp1_units(module):
        if u._handle is not None and u._handle.uses_sharded_strategy:
            fp = u._handle.flat_param
            n += (u.process_group.size() - 1) * fp._sharded_size.numel() * fp.dtype.itemsize
    return n


def _missing(name: str, kind: str, sd: dict) -> KeyError:
    return KeyError(f"FSDP1 {kind} state dict has no entry {name!r} (rank {_rank()}); it has "
                    f"{len(sd)} entries, e.g. {list(sd)[:4]}")


def _flat_pieces(item: _Item, local: torch.Tensor, local_offset: int) -> Pieces:
    """The item's pieces inside an FSDP1 flat parameter sharded in equal padded chunks of ``L``."""
    unit = item.unit
    fp = unit._handle.flat_param
    pg = unit.process_group
    world, me = pg.size(), pg.rank()
    length = fp._sharded_size.numel()
    numel = math.prod(item.shape)
    lo_hi = [(max(item.offset, r * length), min(item.offset + numel, (r + 1) * length))
             for r in range(world)]
    counts = tuple(max(0, hi - lo) for lo, hi in lo_hi)
    lo = lo_hi[me][0] - me * length
    if local_offset != me * length or (counts[me] and lo + counts[me] > local.numel()):
        raise ValueError(f"{item.name!r} (rank {_rank()}): local flat shard of "
                         f"{local.numel()} elements at offset {local_offset} does not hold "
                         f"elements [{lo_hi[me][0]}, {lo_hi[me][0] + counts[me]}) of the flat "
                         f"parameter (shard size {length})")
    return Pieces(local[lo:lo + counts[me]], counts, pg, me)


def _fsdp1_items(module: nn.Module, units: list, kind: str) -> list[_Item]:
    items = _fsdp1_layout(module, units)
    sd = _fsdp1_state_dict(module, kind)
    if kind == "local":
        flat = {}
        unit_names = {id(m): hf_name(n) for n, m in module.named_modules()}
        for u in units:
            if u._handle is None or not u._handle.uses_sharded_strategy:
                continue   # NO_SHARD: torch hands out whole, named parameters instead
            key = _join(unit_names[id(u)], _FLAT_PARAM)
            if key not in sd:
                raise _missing(key, kind, sd)
            flat[id(u)] = sd[key]
    for it in items:
        if it.unit is None:                # buffers and parameters FSDP does not manage
            v = sd.get(it.name, it.full)
            if _is_dtensor(v):
                it.full, it.dtensor = None, v
            else:
                it.full = v.detach() if isinstance(v, torch.Tensor) else it.full
            continue
        if kind == "local" and it.unit._handle.uses_sharded_strategy:
            st = flat[id(it.unit)]
            shards = st.local_shards()
            local = shards[0].tensor if shards else torch.empty(0, dtype=it.src_dtype)
            local_offset = (shards[0].metadata.shard_offsets[0] if shards
                            else it.unit._handle.flat_param._sharded_size.numel()
                            * it.unit.process_group.rank())
            it.pieces = _flat_pieces(it, local.reshape(-1), local_offset)
            continue
        if it.name not in sd:
            raise _missing(it.name, kind, sd)
        v = sd.pop(it.name)
        if kind == "full" or not hasattr(v, "local_shards") and not _is_dtensor(v):
            it.full = v
        elif _is_dtensor(v):
            it.dtensor = v
        else:
            it.pieces = sharded_tensor_pieces(it.name, v)
        if tuple(v.shape) != it.shape:
            raise ValueError(f"{it.name!r} (rank {_rank()}): the {kind} state dict has shape "
                             f"{tuple(v.shape)}, the flat parameter's metadata says {it.shape}")
    return items


def resolve(module: nn.Module, fsdp1_state_dict: str, dtype: torch.dtype | None,
            lora: bool = False) -> list[_Item]:
    """Items with their data sources; any rank's failure is raised on every rank. Collective like
    the streams; `reshard` builds its per-rank buckets from these items too. ``lora``: the LoRA
    tensors' items instead of the base weights' (`is_lora`)."""
    return _resolve(module, fsdp1_state_dict, dtype, lora)[0]


def _resolve(module: nn.Module, fsdp1_state_dict: str, dtype: torch.dtype | None,
             lora: bool) -> tuple[list[_Item], Any]:
    """`resolve`, and the group its failures were agreed over (None: none, or one rank)."""
    _check_dtype(dtype)
    if fsdp1_state_dict not in STATE_DICT_TYPES:
        raise ValueError(f"fsdp1_state_dict must be one of {STATE_DICT_TYPES}, "
                         f"got {fsdp1_state_dict!r}")
    units = _fsdp1_units(module)
    group = None
    error: BaseException | None = None
    items: list[_Item] = []
    try:
        if units:
            group = units[0].process_group
            _check_root(module, units)
            items = _fsdp1_items(module, units, fsdp1_state_dict)
        else:
            _check_root(module, units)
            sd = module.state_dict(keep_vars=True)
            # the group a failure is agreed over, known before anything can fail
            group = next((agree_group(v) for v in sd.values() if _is_dtensor(v)), None)
            items = _MEMO.items(module, sd, functools.partial(_sharded_items, module))
        items = _hub_items(select(items, lora), _experts.model_type_of(module))
        for it in items:
            it.out_dtype(dtype)
    except Exception as exc:  # noqa: BLE001 - whatever it is, every peer must hear of it
        error = exc
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        agree(error, group, what="export")
        return items, group
    if error is not None:
        raise error
    return items, None


def _sharded_items(module: nn.Module, sd: dict) -> list[_Item]:
    """A plain or FSDP2 module's items from its state dict ``sd``, each ``Shard(0)`` DTensor as
    its pieces (`_MEMO` keeps them for the next sync)."""
    items, meshes = _state_dict_items(module, sd), {}
    for it in items:
        if it.dtensor is not None:
            pieces = dim0_pieces(it.name, it.dtensor, meshes)   # also checks the shard against its shape
            if pieces is not None:
                it.pieces, it.dtensor = pieces, None
    return items


_MEMO = ItemsMemo()
"""`_sharded_items`' answer per module, reused while its state dict holds the same tensors."""


# --------------------------------------------------------------------------- public streams

def iter_params(module: nn.Module, *, dtype: torch.dtype | None = None,
                fsdp1_state_dict: str = "full",
                names: Any = None, lora: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` in state-dict order, one gathered tensor at a time.

    Collective when ``module`` is sharded. A yielded tensor is contiguous and, for a plain module
    without a cast, may be the module's own storage (detached): copy it before changing the module.
    ``names``: only these tensors are gathered and yielded (every rank must pass the same set).
    ``lora``: the LoRA tensors (`is_lora`) instead of the base weights.
    """
    items = resolve(module, fsdp1_state_dict, dtype, lora)
    for i, it in enumerate(items):
        if names is not None and it.name not in names:
            items[i] = None
            it.drop()
            continue
        out = materialize(it, it.out_dtype(dtype))
        items[i] = None           # the stream keeps nothing of what it has yielded
        it.drop()
        name = it.name
        del it
        yield name, out
        del out


def iter_buckets(module: nn.Module, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                 fsdp1_state_dict: str = "full",
                 alloc: Callable[[int], torch.Tensor] = _handles.empty_shared,
                 share_host_memory: bool = False, plan: list[_bucket.Bucket] | None = None,
                 dst: int | None = None, lora: bool = False, received: Received | None = None,
                 ) -> Iterator[tuple[_bucket.Bucket, torch.Tensor]]:
    """Yield ``(bucket, flat)``: buckets planned by `bucket.plan_buckets` over `param_metas`
    (``bucket_bytes`` a budget per bucket, alignment padding included), each gathered into a fresh
    ``alloc(bucket.nbytes)`` uint8 buffer (padding zeroed) that then belongs to the caller.

    Sharded tensors whose layout allows it (FSDP2 ``Shard(0)``, FSDP1 "local" and "sharded") are
    gathered with one ``all_gather_into_tensor`` per bucket, not one per parameter. ``alloc``
    decides where buffers live (CPU shared memory by default; pass a CUDA allocator on GPU).

    ``share_host_memory``: when every tensor is an evenly sharded CPU tensor of one gather group
    whose ranks all run on this host, skip the gather: the group shares ONE shared-memory buffer
    (sized for the largest bucket, reused by every bucket), every rank writes its own pieces into
    it, and a barrier ends the bucket. Each rank then yields a view of the same memory, which is
    valid until the next bucket is requested: every consumer must be done with a bucket before any
    rank asks for the next (the sharding manager's per-bucket status all-reduce guarantees it).
    Anything else falls back to the gather, so the flag is always safe to pass.

    ``plan``: buckets planned by the caller (e.g. `bucket.plan_tight`), in export order, instead
    of `plan_buckets` over ``bucket_bytes``. ``dst``: pieces are gathered to that rank of each
    gather group only (``gather``, not ``all_gather``): there ``flat`` holds the bucket, on the
    other ranks it holds only what was local (replicated tensors), not the model. Tensors that
    cannot be gathered by pieces (``full_tensor()``) still arrive on every rank.

    ``received``: the bytes this rank receives (an FSDP1 state dict's unsharding,
    `state_dict_bytes_in`, and the buckets' gathers, `gather.bucket_bytes_in`) are added to it.
    """
    items, agreed = _resolve(module, fsdp1_state_dict, dtype, lora)   # lora: `peft_names`
    received = received if received is not None else Received()
    received.bytes_in += state_dict_bytes_in(module, fsdp1_state_dict)
    metas = [_bucket.TensorMeta(it.name, it.out_dtype(dtype), it.shape) for it in items]
    if plan is None:
        plan = _bucket.plan_buckets(metas, bucket_bytes)
    else:
        planned = [(e.name, e.dtype, e.shape) for b in plan for e in b.entries]
        if planned != [(m.name, m.dtype, m.shape) for m in metas]:
            raise ValueError(f"the given plan does not cover this module's {len(metas)} exported "
                             f"tensors in export order (name, rollout dtype, shape)")
    group = shared_group(items) if share_host_memory and dst is None else None
    host = HostShared.create(group, 1, max((b.nbytes for b in plan), default=0)) \
        if group is not None else None
    scratch = Scratch(received)
    start = 0
    for index, bkt in enumerate(plan):
        chunk = items[start:start + len(bkt.entries)]
        items[start:start + len(bkt.entries)] = [None] * len(chunk)
        start += len(bkt.entries)
        if host is not None:
            flat = fill_shared(host, bkt, chunk)
        else:
            flat = alloc_bucket(alloc, bkt, index, agreed)
            fill_bucket(bkt, chunk, flat, scratch, dst)
        for it in chunk:
            it.drop()
        del chunk
        yield bkt, flat
        del flat
