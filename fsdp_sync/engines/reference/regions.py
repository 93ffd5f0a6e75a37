"""Memory regions of one reference worker: the `MemoryRegions` its `Worker` owns.

Memory tags: releasing ``weights`` drops the parameter tensors (contents lost, or kept as a CPU
backup when the engine was started with one); releasing ``kv_cache`` drops the cache;
``cuda_graph`` holds nothing here (no graphs are captured) and is accepted for SGLang parity. On
CUDA, `torch_memory_saver` is used when installed (same virtual addresses after resume), else the
tensors are freed and reallocated. The KV cache is sized from ``kv_cache_tokens`` or
``mem_fraction``.

Not here: weight contents and their validity (`staging`), the process loop (`worker`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import KIND_STATE, WorkerError

__all__ = ["MemoryRegions"]


class MemoryRegions:
    """Weights, KV cache and CUDA-graph regions of worker ``w``; allocates both at construction."""

    def __init__(self, w: Any, libc: Any) -> None:
        self.w, self.libc = w, libc
        self.saver = self._memory_saver() if w.device.type == "cuda" else None
        self.weights_released = False
        self.backup: dict[str, torch.Tensor] | None = None
        self.alloc_weights()
        self.kv_tokens = self._kv_budget()
        self.kv: torch.Tensor | None = None
        self.kv_released = False
        self.alloc_kv()
        self.cuda_graph_released = False

    def _memory_saver(self) -> Any:
        if not self.w.opts.get("use_memory_saver", True):
            return None
        try:
            import torch_memory_saver as tms  # noqa: F401 - optional
        except ImportError:
            return None
        saver = getattr(tms, "torch_memory_saver", None) or getattr(tms, "memory_saver", None)
        if saver is None and hasattr(tms, "TorchMemorySaver"):
            saver = tms.TorchMemorySaver()
        if saver is not None and hasattr(saver, "hook_mode"):
            try:
                saver.hook_mode = "torch"   # no LD_PRELOAD needed
            except Exception:  # noqa: BLE001 - older versions fix the mode
                pass
        return saver

    def region(self, tag: str, backup: bool = False):
        from contextlib import nullcontext

        if self.saver is None:
            return nullcontext()
        try:
            return self.saver.region(tag=tag, enable_cpu_backup=backup)
        except TypeError:
            return self.saver.region(tag=tag)

    def alloc_weights(self) -> None:
        with self.region("weights", bool(self.w.opts.get("weights_cpu_backup"))):
            self.w.model.allocate()

    def _kv_shape(self, tokens: int) -> tuple[int, ...]:
        s = self.w.layout.spec
        return (s.num_layers, 2, tokens, self.w.layout.kv_local, s.head_dim)

    def _kv_bytes_per_token(self) -> int:
        s = self.w.layout.spec
        return s.num_layers * 2 * self.w.layout.kv_local * s.head_dim * self.w.dtype.itemsize

    def _kv_budget(self) -> int:
        if self.w.opts.get("kv_cache_tokens") is not None:
            return int(self.w.opts["kv_cache_tokens"])
        frac = float(self.w.opts["mem_fraction"])
        if self.w.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.w.device)[1]
        else:
            import psutil

            total = psutil.virtual_memory().total / self.w.tp     # ranks share the host's memory
        budget = frac * total - self.w.model.nbytes()
        tokens = int(budget // self._kv_bytes_per_token())
        if tokens < 1:
            raise WorkerError(KIND_STATE, f"mem_fraction {frac} of {total / 2**30:.1f} GiB leaves no room "
                                          f"for a KV cache after {self.w.model.nbytes() / 2**20:.1f} MiB "
                                          f"of weights on TP rank {self.w.rank}")
        return tokens

    def alloc_kv(self) -> None:
        with self.region("kv_cache"):
            self.kv = torch.zeros(self._kv_shape(self.kv_tokens), dtype=self.w.dtype, device=self.w.device)

    def trim(self) -> None:
        # no gc.collect(): freed tensors go at once (reference counts), and a full collection in a
        # process with torch loaded cost ~100 ms of every release
        if self.w.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.libc is not None:
            self.libc.malloc_trim(0)

    def release(self, tags: list[str]) -> None:
        if self.w.updates.call is not None or self.w.updates.txn is not None:
            raise WorkerError(KIND_STATE, "cannot release memory while a weight update is open")
        for tag in tags:
            if tag == "kv_cache" and not self.kv_released:
                if self.saver is not None:
                    self.saver.pause("kv_cache")
                else:
                    self.kv = None
                self.kv_released = True
            elif tag == "weights" and not self.weights_released:
                backup = bool(self.w.opts.get("weights_cpu_backup"))
                if self.saver is not None:
                    self.saver.pause("weights")   # tms keeps a CPU copy when the region asked for one
                elif backup:
                    # On CPU the backup *is* the weights (no copy, nothing freed); on CUDA a copy.
                    self.backup = {k: (v if v.device.type == "cpu" else v.to("cpu"))
                                   for k, v in self.w.model.params.items()}
                    self.w.model.params = {}
                else:
                    self.w.model.params = {}
                self.weights_released = True
                if not backup:
                    self.w.updates.valid, self.w.updates.coverage = False, set()
            elif tag == "cuda_graph":
                self.cuda_graph_released = True
        self.trim()

    def resume(self, tags: list[str]) -> None:
        if self.w.updates.call is not None or self.w.updates.txn is not None:
            raise WorkerError(KIND_STATE, "cannot resume memory while a weight update is open")
        for tag in tags:
            if tag == "weights" and self.weights_released:
                if self.saver is not None:
                    self.saver.resume("weights")
                elif self.backup is not None:
                    self.w.model.params = {k: v.to(self.w.device) for k, v in self.backup.items()}
                    self.backup = None
                else:
                    self.alloc_weights()     # zeros: the contents were lost with the release
                self.weights_released = False
            elif tag == "kv_cache" and self.kv_released:
                if self.saver is not None:
                    self.saver.resume("kv_cache")
                else:
                    self.alloc_kv()
                self.kv_released = False
            elif tag == "cuda_graph":
                self.cuda_graph_released = False

    def stats(self) -> dict:
        import psutil

        proc = psutil.Process()
        try:
            full = proc.memory_full_info()
            rss, uss = int(full.rss), int(full.uss)
        except (psutil.Error, OSError):
            rss, uss = int(proc.memory_info().rss), 0
        staging = 0
        if self.w.updates.txn is not None:
            staging = sum(w.src.numel() * w.src.element_size() for w in self.w.updates.txn.writes)
        out = {
            "rank": self.w.rank, "pid": os.getpid(), "alive": True,
            "weights_bytes": 0 if self.weights_released else self.w.model.nbytes(),
            "kv_cache_bytes": 0 if self.kv_released else self.kv.numel() * self.kv.element_size(),
            "kv_cache_tokens": self.kv_tokens,
            "cpu_backup_bytes": sum(v.numel() * v.element_size() for v in (self.backup or {}).values()),
            "staging_bytes": staging,
            "weights_valid": self.w.updates.valid and not self.weights_released,
            "rss": rss, "uss": uss,
        }
        if self.w.device.type == "cuda":
            out["cuda"] = {"device": self.w.device.index,
                           "allocated": int(torch.cuda.memory_allocated(self.w.device)),
                           "reserved": int(torch.cuda.memory_reserved(self.w.device)),
                           "max_allocated": int(torch.cuda.max_memory_allocated(self.w.device)),
                           "max_reserved": int(torch.cuda.max_memory_reserved(self.w.device))}
        return out
