"""Infer-TP rank 0's failure to reach its SGLang server before a sync, told to its whole group.

In verl's colocated sync every rank of the infer-TP group calls the adapter's ``resume(["weights"])``
and ``update_weights``, and only rank 0 talks to SGLang: it looks up verl's server actor
(`SGLangAdapter._client`) and resumes the server's memory. A failure there was raised on rank 0
alone; the other ranks went on into the sync and waited in its first collective, which rank 0
never reached, for the process group's timeout, then failed with a message that did not say what
happened (at the first sync: ``dist_timeout_s`` in `peer_check`, "did not start fsdp_sync's
adapter").

Where the group has other ranks, rank 0 now keeps the error (`SGLangAdapter._unreached`), goes on
into the sync with `Unreached` as its engine, and the sync's first agreement raises it on every
rank as one `fsdp_sync.topology.SyncError`: ``before`` where the sync has one (the first sync, or
``verify``), else the update bracket's ``begin_weight_update``, which is agreed at every sync. No
collective is added. A group of one rank raises at once, as before.

Not here: ranks of other infer-TP groups (other replicas) in verl's export, whose collectives span
the whole trainer: they still wait in them for the process group's timeout.
"""

from __future__ import annotations

__all__ = ["Unreached", "EngineUnreached"]


class EngineUnreached(RuntimeError):
    """Infer-TP rank 0 could not reach its SGLang server before the sync (the kept error)."""


class Unreached:
    """Rank 0's engine for a sync whose server could not be reached: ``begin_weight_update``
    raises the kept error (the transport agrees it with every rank, `TensorTransport.send`); any
    other attribute is absent (``getattr`` with a default gets the default, as for an engine
    without that call), so nothing else on rank 0 fails before that agreement."""

    def __init__(self, why: str) -> None:
        self.why = why

    def begin_weight_update(self, *args, **kwargs) -> None:
        raise EngineUnreached(self.why)

    def __getattr__(self, name: str):
        raise AttributeError(f"{name}: {self.__dict__.get('why', 'no engine')}")

    def __repr__(self) -> str:
        return "<SGLang server not reached>"
