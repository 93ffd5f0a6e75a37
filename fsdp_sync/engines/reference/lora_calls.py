"""LoRA adapters on a reference engine, from the client's side: SGLang's
``load_lora_adapter_from_tensors`` / ``load_lora_adapter`` (a peft directory) /
``unload_lora_adapter``, the loaded adapters' list, and reading an adapter back (``lora_tensors``,
what verify compares). A mixin of `ReferenceEngine`: it uses the engine's lock, the update gate
(``_sched.exclusive``: a load waits for running requests as a weight update does) and ``_call``.

A load is all or nothing, in two phases: each worker opens the tensors (one flattened bucket, one
handle per worker), checks them against its base model and builds its shard (`lora`); only when
every worker said yes are the shards installed, otherwise dropped, so a refused adapter changes
nothing (with ``replace=True``, an fsdp_sync extension, the adapter of that name keeps serving).
The engine's ``max_lora_rank`` and ``lora_target_modules`` (SGLang's server arguments of those
names) bound what it accepts, the modules compared as SGLang compares them (q/k/v stacked into
qkv_proj, gate/up into gate_up_proj; ``("all",)`` takes any); an adapter beyond them is refused by
name.

Not here: the math and the TP split (`lora`), the forward (`tp_model`), the workers' side
(`worker.Worker.lora_stage`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ...weights import handles
from ...weights.peft_names import sglang_targets
from ..base import WeightUpdateError
from .lora import LoRAConfig, check_adapter
from .update_items import pack_plain

__all__ = ["LoRACalls"]


class LoRACalls:
    """`ReferenceEngine`'s LoRA methods (see the module docstring)."""

    max_lora_rank: int | None = None
    lora_load_formats = (None, "tensor", "flattened_bucket")   # of load_lora_adapter_from_tensors
    lora_target_modules: tuple[str, ...] | None = None

    @property
    def lora_adapters(self) -> dict[str, dict]:
        """The loaded adapters: name -> ``{"r", "lora_alpha", "target_modules", "scale"}``, and
        ``"path"`` for one loaded from a peft directory (`load_lora_adapter`)."""
        return dict(self.__dict__.setdefault("_lora_loaded", {}))

    def _lora_refusal(self, cfg: LoRAConfig) -> str | None:
        if self.max_lora_rank is not None and cfg.r > self.max_lora_rank:
            return f"its rank r={cfg.r} exceeds the engine's max_lora_rank {self.max_lora_rank}"
        if self.lora_target_modules is not None:
            # as SGLang's memory pool compares them (`LoRAMemoryPool.can_support`): both normalized,
            # q/k/v -> qkv_proj, gate/up -> gate_up_proj; a pool of "all" takes any module
            pool = sglang_targets(list(self.lora_target_modules)) or set()
            extra = [] if "all" in pool else [m for m in cfg.target_modules if not sglang_targets([m]) <= pool]
            if extra:
                return (f"its target_modules {extra} are not in the engine's lora_target_modules "
                        f"{list(self.lora_target_modules)} (SGLang's --lora-target-modules; compared "
                        f"as SGLang stacks them: q/k/v into qkv_proj, gate/up into gate_up_proj): "
                        f"launch the engine with them, or leave them out of the adapter")
        return None

    def lora_refusal(self, config_dict: Any, metas: Any = ()) -> str | None:
        """Why `load_lora_adapter_from_tensors` would refuse an adapter of ``config_dict`` with
        tensors ``metas`` (``[(peft name, dtype, shape)]``), said without loading anything (None:
        it would take it): the config (`lora.LoRAConfig.from_dict`: options not served, trained
        biases, targets other than the decoder layers' linear modules), ``max_lora_rank`` /
        ``lora_target_modules``, and each tensor's name and shape against the base model
        (`lora.check_adapter`, on meta tensors). `lora_sync` asks it before the base is sent."""
        try:
            cfg = LoRAConfig.from_dict(config_dict)
            named = [(n, torch.empty(tuple(shape), dtype=dtype, device="meta")) for n, dtype, shape in metas]
            if named:
                check_adapter(self.layout, cfg, named)
        except ValueError as exc:
            return str(exc)
        return self._lora_refusal(cfg)

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any, config_dict: dict,
                                       load_format: str | None = None, pinned: bool = False,
                                       added_tokens_config: Any = None, *, replace: bool = False) -> dict:
        """Load adapter ``lora_name`` from full tensors: ``[(name, tensor)]`` or a dict, peft's names
        (`lora.hf_weight_of`), with ``config_dict`` a peft ``LoraConfig`` dict. SGLang refuses a
        name already loaded; so does this unless ``replace`` (then the old adapter is swapped out
        only once the new one is staged everywhere). ``load_format="flattened_bucket"`` (an
        fsdp_sync extension, as ``replace``): ``tensors`` is one flattened-bucket payload per TP
        rank (``handles.make_payloads``, peft's names), which the workers open without a copy here
        (`lora_sync` hands over the trainer's own buffer); each worker checks the tensors.
        Raises `WeightUpdateError` naming the tensor or the config key; nothing changes on a
        refusal. Returns ``{"success", "nbytes", "in_place", "kept_check"}``: the last two count
        the workers that staged into the shard the adapter replaced and that took the checked
        tensors of the previous payload (`worker.Worker.lora_stage`)."""
        what = f"load_lora_adapter_from_tensors({lora_name!r})"
        if not isinstance(lora_name, str) or not lora_name:
            raise WeightUpdateError(f"{what}: lora_name must be a non-empty string")
        if load_format not in self.lora_load_formats or added_tokens_config:
            raise WeightUpdateError(f"{what}: load_format={load_format!r} / added_tokens_config are not "
                                    f"served (plain tensors, or load_format='flattened_bucket' payloads, only)")
        bucketed = load_format == "flattened_bucket"
        if bucketed and not (isinstance(tensors, (list, tuple)) and len(tensors) == self.tp_size
                             and all(isinstance(p, (bytes, bytearray, str)) for p in tensors)):
            raise WeightUpdateError(f"{what}: load_format='flattened_bucket' takes one payload (bytes or "
                                    f"base64 text) per TP rank ({self.tp_size})")
        named = [] if bucketed else list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
        try:
            cfg = LoRAConfig.from_dict(config_dict)
            if not bucketed:
                check_adapter(self.layout, cfg, named)
        except ValueError as exc:
            raise WeightUpdateError(f"{what}: {exc}") from None
        refusal = self._lora_refusal(cfg)
        if refusal:
            raise WeightUpdateError(f"{what}: {refusal}")
        loaded = self.__dict__.setdefault("_lora_loaded", {})
        with self._sched.exclusive(), self._lock:
            self._check_usable()
            if lora_name in loaded and not replace:
                raise WeightUpdateError(f"{what}: an adapter named {lora_name!r} is already loaded; "
                                        f"unload_lora_adapter({lora_name!r}) first")
            sets: list[handles.PayloadSet] = []
            items: list[list] = [[] for _ in range(self.tp_size)]
            try:
                if bucketed:
                    items = [[("bucket", "hf", p)] for p in tensors]
                else:
                    pack_plain([named] * self.tp_size, "hf", items, sets, self.tp_size)
                per_rank = [{"name": lora_name, "config": dict(config_dict), "items": items[r]}
                            for r in range(self.tp_size)]
                replies = self._round("lora_stage", per_rank=per_rank, what=what)
                if any(rep[0] != "ok" for rep in replies.values()):
                    self._round("lora_abort", what=f"{what} abort")
                    self._raise_errors(replies, what)
            finally:
                for s in sets:
                    s.release(require_ack=False)
            self._raise_errors(self._round("lora_commit", {"name": lora_name}, what=f"{what} commit"),
                               f"{what} commit", collective=True)
            loaded[lora_name] = {"r": cfg.r, "lora_alpha": cfg.lora_alpha,
                                 "target_modules": list(cfg.target_modules), "scale": cfg.scale}
            nbytes = replies[0][1]["nbytes"]
            kept = {k: sum(bool(rep[1].get(k)) for rep in replies.values()) for k in ("in_place", "kept_check")}
        return {"success": True, "message": f"loaded LoRA adapter {lora_name!r}", "nbytes": nbytes, **kept}

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Load a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        from safetensors.torch import load_file

        if lora_name in self.lora_adapters:        # said before the files are read (SGLang's rule)
            raise WeightUpdateError(f"load_lora_adapter({lora_name!r}): an adapter named {lora_name!r} "
                                    f"is already loaded; unload_lora_adapter({lora_name!r}) first")
        cfg_file = os.path.join(str(lora_path), "adapter_config.json")
        st_file = os.path.join(str(lora_path), "adapter_model.safetensors")
        for f in (cfg_file, st_file):
            if not os.path.isfile(f):
                raise WeightUpdateError(f"load_lora_adapter({lora_name!r}): {f} does not exist (a peft "
                                        f"adapter directory holds adapter_config.json and adapter_model.safetensors)")
        with open(cfg_file) as fh:
            config = json.load(fh)
        out = self.load_lora_adapter_from_tensors(lora_name, load_file(st_file), config)
        with self._lock:        # where it came from: SGLang's loaded_adapters (`serve_lora`)
            held = self.__dict__.setdefault("_lora_loaded", {}).get(lora_name)
            if held is not None:
                held["path"] = str(lora_path)
        return out

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Drop adapter ``lora_name`` (waits for running requests, as a weight update does; refused
        while requests that use it wait or are paused)."""
        loaded = self.__dict__.setdefault("_lora_loaded", {})
        with self._sched.exclusive(), self._lock:
            self._check_usable()
            if lora_name not in loaded:
                raise WeightUpdateError(f"unload_lora_adapter({lora_name!r}): no such adapter is loaded "
                                        f"(loaded: {sorted(loaded)})")
            using = self._sched.rows_using(lora_name)
            if using:   # paused or waiting requests would run without it: refused, nothing changes
                raise WeightUpdateError(f"unload_lora_adapter({lora_name!r}): {using} requests waiting or "
                                        f"paused use it; let them finish (continue_generation) or abort them")
            self._raise_errors(self._round("lora_unload", {"name": lora_name}), "unload_lora_adapter",
                               collective=True)
            del loaded[lora_name]
        return {"success": True, "message": f"unloaded LoRA adapter {lora_name!r}"}

    def lora_rank_pieces(self, lora_name: str) -> dict[int, dict[str, list]]:
        """What each TP rank holds of adapter ``lora_name``: ``{rank: {peft name: [(src index,
        tensor)]}}``, replicas included (lora_A of a column-parallel module and lora_B of a
        row-parallel one are on every rank), so a verify can compare every rank's copy."""
        if lora_name not in self.lora_adapters:
            raise WeightUpdateError(f"lora_rank_pieces({lora_name!r}): no such adapter is loaded "
                                    f"(loaded: {sorted(self.lora_adapters)})")
        pieces = self._call("lora_pieces", {"name": lora_name}, what=f"lora_tensors({lora_name!r})")
        return {rank: pieces[rank] for rank in sorted(pieces)}

    def lora_tensors(self, lora_name: str) -> dict[str, torch.Tensor]:
        """Adapter ``lora_name`` read back from the workers' shards as full tensors
        (``model.layers.{i}...{module}.lora_A.weight`` names, the engine dtype). A piece held on
        several ranks (a replica) must be the same bytes on each: where a rank's copy differs from
        an earlier rank's, raises `WeightUpdateError` naming the tensor and the ranks (one full
        tensor cannot show both copies, and the rank that differs computes with its own)."""
        shapes: dict[str, torch.Tensor] = {}
        seen: dict[str, torch.Tensor] = {}     # name -> per element: the rank that wrote it + 1 (0: none)
        r = self.lora_adapters[lora_name]["r"] if lora_name in self.lora_adapters else 0
        for rank, named in self.lora_rank_pieces(lora_name).items():
            for name, lst in named.items():
                weight = name.replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")
                out_dim, in_dim = self.layout.full_shape(weight)
                full = shapes.setdefault(name, torch.empty((r, in_dim) if ".lora_A." in name else (out_dim, r),
                                                           dtype=self.dtype))
                writer = seen.setdefault(name, torch.zeros(full.shape, dtype=torch.int32))
                for src, t in lst:
                    held, mine = writer[src], t.to(full.dtype)
                    both = held > 0
                    if bool(both.any()):
                        a = full[src][both].contiguous().view(torch.uint8)
                        b = mine[both].contiguous().view(torch.uint8)
                        if not torch.equal(a, b):
                            first = int(held[both][0]) - 1
                            raise WeightUpdateError(
                                f"lora_tensors({lora_name!r}): TP rank {rank}'s copy of replicated "
                                f"{name!r} differs from TP rank {first}'s (a replica must be the same "
                                f"bytes on every rank)")
                    full[src] = mine
                    writer[src] = rank + 1
        return shapes
