"""SGLang's memory calls through `SGLangEngine`: release and resume by tag. A mixin of
`adapter.SGLangEngine` (it provides ``_http``, ``_local``, ``_check_open``, ``where``,
``allocator`` (`allocator.ExpandableSegments`, whose ``held`` is the set of tags SGLang holds),
``track_memory`` and ``memory_skipped``).

SGLang's scheduler (0.5.12 and 0.5.23 alike) keeps the released tags in a set: release adds each,
resume ``remove``s each, so a resume of a tag SGLang holds raises KeyError there and the server
quits. With ``track_memory`` (the default) only the tags whose state changes are sent, never None
(SGLang's "all"), and a call with none left is not made; without it (another client also
releases and resumes that SGLang, as verl's replicas do) the tags go as given.

Not here: the allocator switch itself (`allocator`), the weight-update calls (`adapter`).
"""

from __future__ import annotations

from typing import Sequence

from ..base import RELEASE_ORDER, RESUME_ORDER, ordered_tags
from .client import NotFound, check_answer

__all__ = ["MemoryCalls"]


class MemoryCalls:
    """`SGLangEngine`'s memory methods (see the module docstring)."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free SGLang's GPU memory by tag (None: all), in SGLang's order kv_cache → weights →
        cuda_graph. Expandable segments are restored once SGLang holds neither weights nor KV."""
        self._memory_call("release_memory_occupation", tags, RELEASE_ORDER)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take SGLang's GPU memory back by tag (None: all), in SGLang's order cuda_graph →
        weights → kv_cache. Expandable segments are turned off first."""
        self._memory_call("resume_memory_occupation", tags, RESUME_ORDER)

    def _memory_call(self, name: str, tags: Sequence[str] | None, order: Sequence[str]) -> None:
        self._check_open(name)
        ordered = ordered_tags(tags, order)
        resume = name.startswith("resume")
        held = self.allocator.held
        if not self.track_memory:
            wire: list[str] | None = None if tags is None else ordered
        else:
            # only tags whose state changes: SGLang's scheduler raises on (and quits for) a resume
            # of a tag it holds, and would pause a released region again; never None (all)
            wire = [t for t in ordered if (t not in held) == resume]
            if len(wire) < len(ordered):
                self.memory_skipped.append((name, [t for t in ordered if t not in wire]))
        if resume:
            # before SGLang maps its memory again, so the trainer's allocator stops growing segments
            self.allocator.resumed(ordered)
        if wire == []:
            return
        try:
            if self._http:
                try:
                    answer = self._http.json("POST", f"/{name}", {"tags": wire})
                except NotFound as e:
                    raise e.error from None
            else:
                answer = self._local.call(name, tags=wire)
            check_answer(f"{name}(tags={wire})", answer, where=self.where)
        except BaseException:
            if resume:      # not taken back: a later resume asks for them again
                self.allocator.held -= set(ordered if wire is None else wire)
            raise
        if not resume:
            self.allocator.released(ordered)
