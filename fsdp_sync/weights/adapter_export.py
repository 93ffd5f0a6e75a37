"""The LoRA adapter's export, kept from one adapter-only sync to the next (`SyncConfig.lora=
"adapter"`, `fsdp_sync.lora_sync`): an adapter sync moves a few MB, so what a full export pays once
per sync (walking the state dict, resolving every parameter's shards, planning, a fresh buffer
whose pages fault in) would be most of its time. `AdapterExport.tensors` keeps, per manager:

- the plan: ONE flattened bucket for the whole adapter (the engine takes it as one), and its
  buffer, reused while the adapter's names, rollout dtypes and shapes stay the same (a change makes
  a new plan and buffer, the old one is freed);
- the buffer: on one host, a host-shared buffer (`hostbuf.HostShared`) into which every trainer
  rank writes its own shards (`gather.fill_shared`: a copy and two barriers instead of an
  all-gather); elsewhere a plain buffer gathered into (`gather.fill_bucket`);
- where each tensor's data comes from (its parameter and its shard counts), so that a sync whose
  LoRA parameters are the same objects, names, shapes, dtypes and placements as the previous one
  (checked every sync, by one walk over ``named_parameters``) takes each shard straight from its
  parameter instead of resolving the module again (`export.resolve`). Every rank must take the same
  path (the two differ in collectives): one all-reduce agrees on it, and on any rank's error.

Only one adapter's tensors are exported (``adapter``: a peft model keys each layer's ``lora_A`` /
``lora_B`` by adapter name and may hold several; `peft_names.adapter_of`); two tensors that the
caller's ``rename`` gives one name (peft's name without the adapter level) are refused, never sent
as one.

The returned tensors are views of the kept buffer: valid until the next call (the caller hands them
to the engine, which copies them, and verifies them within the same sync). `close` frees it.

`AdapterCopy` keeps a copy of the adapter last loaded into the engines (its tensors and config),
for the engines to be put back on it where a later load failed on some of them
(`lora_sync.sync_adapter`).

Not here: naming the tensors as peft saves them, the config, the engine (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..topology import agree, cpu_group, released_by_backend
from .bucket import Bucket, TensorMeta, plan_one, unflatten
from .export import hf_name, is_lora, resolve
from .peft_names import adapter_of
from .gather import Pieces, Scratch, fill_bucket, fill_shared, shared_group
from .hostbuf import HostShared

__all__ = ["AdapterExport", "AdapterCopy"]


class _Src:
    """One tensor's data for the fill (`gather.fill_bucket` / `gather.fill_shared` read these)."""

    __slots__ = ("name", "pieces", "full", "dtensor")

    def __init__(self, name: str, pieces: Pieces | None, full: torch.Tensor | None) -> None:
        self.name, self.pieces, self.full, self.dtensor = name, pieces, full, None


def _walk(module: torch.nn.Module, adapter: str | None) -> list[tuple[str, Any]]:
    """The LoRA parameters (of ``adapter`` alone; None: all) by name."""
    return [(n, p) for n, p in module.named_parameters()
            if "lora_" in n and is_lora(n) and (adapter is None or adapter_of(n) == adapter)]


def _key(walk: list[tuple[str, Any]], dtype: torch.dtype | None) -> tuple:
    """What must not change for the kept sources to be the module's: each LoRA parameter's name,
    identity, shape, dtype and (DTensor) placements and mesh; the rollout dtype."""
    out: list = [dtype]
    for n, p in walk:
        placements = getattr(p, "placements", None)
        mesh = getattr(p, "device_mesh", None)
        out.append((n, id(p), tuple(p.shape), p.dtype, p.device,
                    None if placements is None else tuple(placements), id(mesh)))
    return tuple(out)


class AdapterExport:
    """The adapter's plan, buffer and sources, kept between syncs (see the module docstring)."""

    def __init__(self, rename: Callable[[str], str] = lambda n: n) -> None:
        self.rename = rename
        self.key: tuple | None = None          # `_key` of the kept sources (None: none kept)
        self.srcs: list[tuple] | None = None   # per entry: (param, counts, group, rank) / (param,)
        self.metas: tuple | None = None        # (name, dtype, shape) of the plan's entries
        self.bucket: Any = None
        self.host: HostShared | None = None
        self.buf: torch.Tensor | None = None
        self.views: list[tuple[str, torch.Tensor]] = []
        self.named: Bucket | None = None       # the plan under the renamed names
        self.scratch = Scratch()
        self.hits = self.misses = 0            # syncs that took the kept sources / resolved

    def close(self) -> None:
        """Free the buffer and forget the sources (the next call starts afresh)."""
        self.key = self.srcs = self.metas = self.bucket = self.host = self.buf = self.named = None
        self.views = []
        self.scratch = Scratch()

    def tensors(self, module: torch.nn.Module, dtype: torch.dtype | None,
                adapter: str | None = None) -> dict[str, torch.Tensor]:
        """The full LoRA tensors of ``adapter`` (None: every LoRA tensor the module holds;
        collective over the module's shard group: every trainer rank calls it): ``{renamed export
        name: view of the kept buffer}``, valid until the next call. Raises ValueError (on every
        rank alike) where two tensors take one renamed name."""
        walk = _walk(module, adapter)
        key = _key(walk, dtype)
        items, err = None, None
        if self.srcs is not None and key == self.key:
            try:
                items = self._refresh(walk)
            except Exception as exc:  # noqa: BLE001 - told to every rank just below
                err = exc
        miss = items is None and err is None
        synced = dist.is_initialized() and dist.get_world_size() > 1
        if synced:
            flags = torch.tensor([int(miss), int(err is not None)], dtype=torch.int64)
            with released_by_backend(flags):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(None))
            miss, failed = bool(flags[0]), bool(flags[1])
        else:
            failed = err is not None
        if failed:
            agree(err, what="adapter export")
        if miss:
            items = self._resolve(module, dtype, walk, key, adapter)
            self.misses += 1
        else:
            self.hits += 1
        if self.bucket is None:
            return {}
        if self.host is not None:   # no barrier first: the all-reduce above was one (nobody
            # still reads the last sync's bytes: every rank is in this call), as is a miss's resolve
            fill_shared(self.host, self.bucket, items, wait_readers=not synced)
        else:
            fill_bucket(self.bucket, items, self.buf, self.scratch)
        return dict(self.views)

    def shared(self) -> tuple[torch.Tensor, Bucket] | None:
        """``(flat, plan under the renamed names)`` when the last `tensors` are in a host-shared
        buffer, which an engine's workers may open without a copy (valid until the next call);
        None when they are in plain memory."""
        if self.host is None or self.named is None:
            return None
        return self.host.bufs[0][:self.named.nbytes], self.named

    def _refresh(self, walk: list[tuple[str, Any]]) -> list[_Src]:
        """The kept sources with this sync's data: each shard taken from its parameter again (a
        parameter's local tensor may be replaced between syncs; its object, shape and placements
        may not, or the key would differ)."""
        params = dict(walk)
        out = []
        with torch.no_grad():
            for (name, _, _), src in zip(self.metas, self.srcs):
                p = params[src[0]]
                if len(src) == 1:
                    out.append(_Src(name, None, p.detach()))
                    continue
                _, counts, group, rank = src
                local = p.to_local().detach()
                if local.numel() != counts[rank]:
                    raise ValueError(f"{name!r}: its local shard has {local.numel()} elements, "
                                     f"{counts[rank]} expected on this rank")
                out.append(_Src(name, Pieces(local, counts, group, rank), None))
        return out

    def _resolve(self, module: torch.nn.Module, dtype: torch.dtype | None,
                 walk: list[tuple[str, Any]], key: tuple, adapter: str | None) -> list:
        """The export's items of ``adapter`` (collective), the plan and buffer again if the
        adapter's tensors changed, and the sources kept for the next sync where each item is a
        parameter's whole tensor or its Shard(0) pieces (`_sources`; else every sync resolves)."""
        self.key = self.srcs = None
        items = resolve(module, "full", dtype, lora=True)
        if adapter is not None:
            for it in items:
                if adapter_of(it.name) != adapter:
                    it.drop()
            items = [it for it in items if adapter_of(it.name) == adapter]
        seen: dict[str, str] = {}
        for it in items:        # names from peft's without the adapter level: one per tensor
            other = seen.setdefault(self.rename(it.name), it.name)
            if other != it.name:
                raise ValueError(f"LoRA tensors {other!r} and {it.name!r} would both be sent as "
                                 f"{self.rename(it.name)!r}: the module holds several adapters' "
                                 f"tensors and the engine serves one; sync one adapter (the peft "
                                 f"model's active one) or delete the others (delete_adapter)")
        device = _device(items)
        metas = [TensorMeta(it.name, it.out_dtype(dtype), it.shape) for it in items]
        mkey = tuple((m.name, m.dtype, m.shape) for m in metas)
        if mkey != self.metas:
            self.close()
            if metas:
                self.bucket = plan_one(metas)
                group = shared_group(items)
                self.host = HostShared.create(group, 1, self.bucket.nbytes) if group is not None else None
                flat = (self.host.bufs[0] if self.host is not None else torch.empty(
                    self.bucket.nbytes, dtype=torch.uint8, device=device))[:self.bucket.nbytes]
                self.buf = None if self.host is not None else flat
                self.views = [(self.rename(n), t) for n, t in unflatten(flat, self.bucket.entries)]
                self.named = Bucket(tuple(dataclasses.replace(e, name=self.rename(e.name))
                                          for e in self.bucket.entries), self.bucket.nbytes)
            self.metas = mkey
        srcs = _sources(items, walk)
        if srcs is not None:
            self.key, self.srcs = key, srcs
        return items


def _device(items: list) -> torch.device:
    """Where the adapter's plain buffer is made: the device its tensors are on, as a full sync's
    buckets are made on the sync's device. A CUDA trainer's shards are gathered straight into it
    (NCCL moves no CPU tensor; a buffer on the CPU, as it was, put CPU outputs beside CUDA inputs
    in one all-gather) and the engine opens it as a CUDA payload. Tensors on several devices are
    refused (the same on every rank: each holds its shards of the same tensors)."""
    found: dict[str, str] = {}
    for it in items:
        t = it.pieces.local if it.pieces is not None else it.full if it.full is not None else it.dtensor
        if t is not None:
            found.setdefault(t.device.type, it.name)
            dev = t.device
    if len(found) > 1:
        raise ValueError("the adapter's tensors are on several devices ("
                         + ", ".join(f"{d}: {n!r}" for d, n in found.items())
                         + "); move the LoRA parameters to one device (the trainer's) before the sync")
    return dev if found else torch.device("cpu")


def _sources(items: list, walk: list[tuple[str, Any]]) -> list[tuple] | None:
    """Per item, the parameter (by its name in ``walk``) and the shard layout it was resolved with:
    ``(param name, counts, group, rank)`` for Shard(0) pieces that are the parameter's own local
    tensor, ``(param name,)`` for a whole tensor that is the parameter itself. None where any item
    is something else (FSDP1's flat parameters, a DTensor gathered whole, a tensor cut into
    several): those modules are resolved every sync."""
    by_name = {hf_name(n): (n, p) for n, p in walk}
    if len(by_name) != len(walk) or len(items) != len(walk):
        return None
    out: list[tuple] = []
    for it in items:
        found = by_name.get(it.name)
        if found is None or tuple(found[1].shape) != tuple(it.shape):
            return None
        n, p = found
        if it.pieces is not None:
            to_local = getattr(p, "to_local", None)
            if to_local is None or to_local().data_ptr() != it.pieces.local.data_ptr():
                return None
            out.append((n, it.pieces.counts, it.pieces.group, it.pieces.rank))
        elif it.full is not None and not hasattr(p, "to_local") and it.full.data_ptr() == p.data_ptr():
            out.append((n,))
        else:
            return None
    return out


class AdapterCopy:
    """The adapter last loaded into the engines: ``cfg`` and a copy of its ``tensors`` (None: none
    yet), in buffers reused while the names, shapes and dtypes stay the same."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.cfg: dict | None = None

    def keep(self, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
        old = self.tensors or {}
        with torch.no_grad():
            if old.keys() == tensors.keys() and all(old[n].shape == t.shape and old[n].dtype == t.dtype
                                                    for n, t in tensors.items()):
                for n, t in tensors.items():
                    old[n].copy_(t)
            else:
                self.tensors = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
        self.cfg = dict(cfg)
