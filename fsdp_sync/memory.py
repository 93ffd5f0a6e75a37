"""Memory tags, probes and the stage timeline.

`Tag` names what an engine can release and resume (SGLang's tags and orders). `probe()` reads this
process's memory (CUDA allocated/reserved when CUDA is in use; RSS/USS/PSS always). `Timeline`
records, for each named stage of a sync, its wall time and the memory of the trainer rank and of
the engine's workers after it; it renders to a dict/JSON and to a short log line.

Not here: deciding which stage runs when (manager) or freeing anything (engines).
"""

from __future__ import annotations

import enum
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import psutil
import torch

__all__ = ["Tag", "RELEASE_ORDER", "RESUME_ORDER", "ordered", "probe", "StageRecord", "Timeline",
           "empty_cache"]


class Tag(str, enum.Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


RELEASE_ORDER = (Tag.KV_CACHE, Tag.WEIGHTS, Tag.CUDA_GRAPH)
RESUME_ORDER = (Tag.CUDA_GRAPH, Tag.WEIGHTS, Tag.KV_CACHE)


def ordered(tags, order) -> list[str]:
    """Tags (None = all) validated and put in ``order``; raises naming an unknown tag."""
    if tags is None:
        return [t.value for t in order]
    wanted = []
    for t in tags:
        try:
            wanted.append(Tag(t))
        except ValueError:
            raise ValueError(f"unknown memory tag {t!r}; expected one of "
                             f"{[x.value for x in Tag]}") from None
    return [t.value for t in order if t in wanted]


def empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def probe(pid: int | None = None) -> dict[str, int]:
    """Memory of a process (default: this one) in bytes: rss, uss, pss; plus CUDA stats if in use."""
    out: dict[str, int] = {}
    try:
        info = psutil.Process(pid or os.getpid()).memory_full_info()
        out.update(rss=int(info.rss), uss=int(info.uss), pss=int(getattr(info, "pss", 0)))
    except (psutil.Error, OSError):
        out.update(rss=int(psutil.Process(pid or os.getpid()).memory_info().rss))
    if pid is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update(cuda_allocated=int(torch.cuda.memory_allocated()),
                   cuda_reserved=int(torch.cuda.memory_reserved()),
                   cuda_max_allocated=int(torch.cuda.max_memory_allocated()))
    return out


@dataclass
class StageRecord:
    name: str
    seconds: float
    memory: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0  # time.perf_counter() at the stage's start (same clock as samplers)


@dataclass
class Timeline:
    """Stages of one enter/exit in order, each with seconds and memory after it."""

    stages: list[StageRecord] = field(default_factory=list)
    engine_probe: Callable[[], dict] | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRecord]:
        t0 = time.perf_counter()
        rec = StageRecord(name, 0.0, started=t0)
        try:
            yield rec
        finally:
            rec.seconds = time.perf_counter() - t0
            rec.memory["trainer"] = probe()
            if self.engine_probe is not None:
                try:
                    rec.memory["engine"] = self.engine_probe()
                except Exception as exc:  # noqa: BLE001 - a probe must never mask the real error
                    rec.memory["engine"] = {"error": str(exc)}
            self.stages.append(rec)

    def seconds(self, name: str) -> float:
        return sum(s.seconds for s in self.stages if s.name == name)

    def to_dict(self) -> list[dict]:
        return [asdict(s) for s in self.stages]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        def mb(rec: StageRecord) -> str:
            m = rec.memory.get("trainer", {})
            v = m.get("cuda_allocated", m.get("uss", m.get("rss", 0)))
            return f"{v / 2**20:.0f}MB"
        return " | ".join(f"{s.name} {s.seconds * 1e3:.1f}ms {mb(s)}" for s in self.stages)
