"""SGLang's memory calls through `SGLangEngine`: release and resume by tag. A mixin of
`adapter.SGLangEngine` (it provides ``_http``, ``_local``, ``_check_open``, ``where``,
``allocator`` (`allocator.ExpandableSegments`, whose ``held`` is the set of tags SGLang holds),
``track_memory`` and ``memory_skipped``).

SGLang's scheduler (0.5.12 and 0.5.23 alike) keeps the released tags in a set: release adds each,
resume ``remove``s each, so a resume of a tag SGLang holds raises KeyError there and the server
quits. With ``track_memory`` (the default) only the tags whose state changes are sent, never None
(SGLang's "all"), and a call with none left is not made; without it (another client also
releases and resumes that SGLang, as verl's replicas do) the tags go as given.

A memory call that fails other than by a refused connection or a 4xx refusal (a timeout, a 5xx,
an interrupt) leaves SGLang's tags unknown: it may have applied the call. With ``track_memory``
every later memory call of that engine is then refused, naming the call: sending it again could
resume a tag SGLang holds (the server quits) or update weights in memory it released.

Not here: the allocator switch itself (`allocator`), the weight-update calls (`adapter`).
"""

from __future__ import annotations

from typing import Sequence

from ..base import RELEASE_ORDER, RESUME_ORDER, ordered_tags
from .client import NotFound, SGLangError, check_answer

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
        unknown = self.__dict__.get("_memory_unknown")
        if unknown is not None and self.track_memory:
            raise SGLangError(f"{name}{self.where} refused: an earlier {unknown}, so whether SGLang "
                              f"holds or released those tags is unknown (SGLang quits on a resume of a "
                              f"tag it holds, and an update into released memory is lost): restart "
                              f"the SGLang server and make a new SGLangEngine", call=name)
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
        except BaseException as exc:
            if resume:      # not taken back (where SGLang certainly did not run it: asked again)
                self.allocator.held -= set(ordered if wire is None else wire)
            if not _unapplied(exc):
                self.__dict__["_memory_unknown"] = (f"{name}(tags={wire}) failed without saying it "
                                                    f"changed nothing ({type(exc).__name__}: "
                                                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
            raise
        if not resume:
            self.allocator.released(ordered)


def _unapplied(exc: BaseException) -> bool:
    """Whether a failed memory call certainly changed nothing in SGLang: the connection was
    refused (the request never reached it) or it answered with a 4xx (refused the request before
    running it). A timeout, a 5xx, an answer of ``success=False`` or an interrupt may come after
    some of the tags were released or resumed."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return 400 <= status < 500
    cause = exc.__cause__ or exc.__context__
    return isinstance(getattr(cause, "reason", cause), ConnectionRefusedError)
