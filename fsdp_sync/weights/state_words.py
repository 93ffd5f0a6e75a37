"""Where a tagged payload's state word lives (`handles`): a slot in a page of shared memory that
the payloads of one sync share, rather than a shared-memory segment of its own.

A segment a payload cost about 0.4 ms on this project's CPU host (torch_shm_manager registers
it, the producer maps it and unlinks it at release, the consumer maps it again): a third of what a
per-rank bucket's making and engine call cost besides the copies, and the same host work on a GPU
machine. Inside `pooled()` (the tensor transport holds it over each sync) `take` hands out a slot
of two int32 words instead: the state (``handles.FRESH``, ``OPENED``, ``ACKED``, ``REVOKED``, the
word the tag's ``"state"`` views, as before) and a generation, which the tag names (``"gen"``).

- A slot is handed out again only once its state is final: acknowledged, or revoked by its
  producer. A consumer that opened a payload and has not acknowledged it may still write the
  word, so that slot is never handed out again (its page goes when the pool and its last payload
  do).
- A payload whose slot was handed out again is refused as released (`generation_matches`), as a
  released payload's own segment is gone outside `pooled()`. The producer writes a reused slot's
  generation and state under the page's lock, the one `handles.open_payload` reads them under, so
  an old payload can never read the new generation's fresh state.
- The producer's page is unlinked when the pool and its last payload are gone (a consumer's
  mapping of it holds 4 KiB, no name and no descriptor, until its payload is dropped).

Outside `pooled()` each payload gets a segment of its own, as before. Not here: what the states
mean and who writes them (`handles`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from .shm import HandleError, refcount_lock

__all__ = ["SLOTS", "Slot", "pooled", "take", "give_back", "words_of", "generation_matches"]

SLOTS = 512
"""Slots a page (4 KiB: two int32 words each)."""

_FINAL = (2, 3)         # handles.ACKED, handles.REVOKED: nobody writes the word after these
_MAX_GEN = 2**31 - 1


class _Page:
    def __init__(self, alloc: Callable[[int], torch.Tensor]) -> None:
        self.words = alloc(SLOTS * 8).view(torch.int32)
        self.words.zero_()
        self.handle = self.words.untyped_storage()._share_filename_cpu_()[1]
        self.free = list(range(SLOTS - 1, -1, -1))
        self.gens = [0] * SLOTS
        self.live = True            # False once its pool closed: no slot goes back to it


class Slot:
    """One payload's words: ``state`` (a 1-element int32 view, the tag's ``"state"``) and ``gen``."""

    __slots__ = ("page", "index", "gen", "state")

    def __init__(self, page: _Page, index: int, gen: int) -> None:
        self.page, self.index, self.gen = page, index, gen
        self.state = page.words[2 * index:2 * index + 1]


class _Pool:
    def __init__(self) -> None:
        self.pages: list[_Page] = []

    def take(self, alloc: Callable[[int], torch.Tensor]) -> Slot:
        page = next((p for p in self.pages if p.free), None)
        if page is None:
            page = _Page(alloc)
            self.pages.append(page)
        i = page.free.pop()
        gen = page.gens[i] = page.gens[i] % _MAX_GEN + 1
        slot = Slot(page, i, gen)
        with refcount_lock(page.handle):   # against an old payload's open reading the words
            page.words[2 * i + 1] = gen
            page.words[2 * i] = 0           # handles.FRESH
        return slot

    def close(self) -> None:
        for p in self.pages:
            p.live = False
        self.pages = []


_lock = threading.Lock()
_depth = 0
_pool: _Pool | None = None


@contextlib.contextmanager
def pooled() -> Iterator[None]:
    """Within it (re-entrant, process-wide), tagged payloads take their state words from shared
    pages (`take`); the pages go when the outermost block ends and their payloads are released."""
    global _depth, _pool
    with _lock:
        _depth += 1
        if _pool is None:
            _pool = _Pool()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _pool is not None:
                _pool.close()
                _pool = None


def take(alloc: Callable[[int], torch.Tensor]) -> Slot | None:
    """A fresh slot (state ``FRESH``, a new generation), or None outside `pooled()`. ``alloc``:
    `handles.empty_shared` (a page must be shareable without a copy)."""
    with _lock:
        return _pool.take(alloc) if _pool is not None else None


def give_back(slot: Slot) -> None:
    """After the payload's release: the slot goes back to its page if its state is final and
    the page's pool is still open; otherwise it is never handed out again."""
    with _lock:
        if slot.page.live and int(slot.state[0]) in _FINAL:
            slot.page.free.append(slot.index)


def words_of(state: torch.Tensor) -> torch.Tensor:
    """A received state word and the generation beside it (2 int32 words); refused if the
    storage does not hold both."""
    storage, offset = state.untyped_storage(), state.storage_offset()
    if (offset + 2) * 4 > storage.nbytes():
        raise HandleError(f"payload's state word at {offset} has no generation beside it "
                          f"({storage.nbytes()}-byte segment)")
    return torch.empty(0, dtype=torch.int32).set_(storage, offset, (2,), (1,))


def generation_matches(words: torch.Tensor, gen: int) -> bool:
    """Whether the slot still belongs to the payload that names generation ``gen`` (read under
    the page's lock)."""
    return int(words[1]) == gen

