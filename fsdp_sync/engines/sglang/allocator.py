"""The CUDA allocator switch: expandable segments off while SGLang holds GPU memory in this node.

Not here: when SGLang releases or resumes memory (`adapter.SGLangEngine` tells `ExpandableSegments`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...weights import ipc_memory
from ..base import TAGS

__all__ = ["ExpandableSegments"]

def _cuda_available() -> bool:
    return torch.cuda.is_available()


# module names, so that a test can stand in for torch's allocator
_set_allocator_settings = ipc_memory.set_allocator_settings
_allocator_settings = ipc_memory.allocator_settings


class ExpandableSegments:
    """Expandable segments off while SGLang holds GPU memory in this node, restored afterwards.

    verl turns them off while SGLang owns GPU memory (it measured 73.6 GB reserved with them on,
    14.2 GB off). SGLang owns memory while it holds its weights or KV cache; the CUDA-graph pool
    alone does not count. Only a setting that was on is switched, only with CUDA available;
    `events` records every decision (on CPU each is a recorded no-op).
    """

    BIG = ("weights", "kv_cache")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[str] = []
        self.held: set[str] = set(TAGS)   # a launched engine holds everything
        self._switched_off = False

    def _was_on(self) -> bool:
        return ipc_memory.says_on(_allocator_settings())

    def resumed(self, tags: Sequence[str]) -> None:
        self.held |= set(tags)
        if not self.enabled or self._switched_off:
            return
        if not _cuda_available():
            self.events.append(f"skipped expandable_segments:False on resume {list(tags)}: no CUDA")
            return
        if not self._was_on():
            self.events.append(f"skipped expandable_segments:False on resume {list(tags)}: "
                               f"they were not on")
            return
        _set_allocator_settings("expandable_segments:False")
        self._switched_off = True
        self.events.append(f"expandable_segments:False on resume {list(tags)}")

    def released(self, tags: Sequence[str]) -> None:
        self.held -= set(tags)
        if not self.enabled or self.held & set(self.BIG):
            return
        if not self._switched_off:
            self.events.append(f"skipped expandable_segments restore on release {list(tags)}: "
                               f"not switched off")
            return
        self.restore(f"release {list(tags)}")

    def restore(self, why: str = "shutdown") -> None:
        if self._switched_off:
            _set_allocator_settings("expandable_segments:True")
            self._switched_off = False
            self.events.append(f"expandable_segments:True on {why}")
