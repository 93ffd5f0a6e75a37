"""Where one sync's time went, engine call by engine call (`CallTimes`): the tensor method's send
loop (`transport.tensor`) marks each phase of each call as it ends, so a sync's stats say which
bucket, and which part of it (making, gathering, the engine, agreeing, releasing), took the time:
the profile per bucket that a GPU sync's 51 ms asked for (issue 35), on any device.

Not here: the send loop itself (`transport.tensor`).
"""

from __future__ import annotations

import time
from typing import Any

from . import SyncStats

__all__ = ["CallTimes"]


class CallTimes:
    """Where this rank's time went, engine call by engine call (bucket by bucket): ``make_s`` (the
    export making the call: gather or reshard, pack, quantize, handles), ``gather_s`` (its payloads
    to infer-TP rank 0), ``engine_s`` (infer-TP rank 0: the engine's call; pipelined: the wait for
    it), ``agree_s`` (every rank hears the outcome: elsewhere, the wait for rank 0), ``release_s``;
    on infer-TP rank 0 also ``engine_call_s``, the engine call itself (on the pipeline's thread, it
    overlaps the next bucket's making). The phases of one rank follow each other, so they add up
    to the loop's time. ``stats.extra["calls"]``: the first `LIMIT` calls;
    ``stats.extra["call_seconds"]``: each phase summed over every call."""

    LIMIT = 512
    PHASES = ("make_s", "gather_s", "engine_s", "agree_s", "release_s")

    def __init__(self, stats: SyncStats) -> None:
        self.rows: list[dict] = []
        self.sums = dict.fromkeys(self.PHASES, 0.0)
        stats.extra["calls"], stats.extra["call_seconds"] = self.rows, self.sums
        self.t = time.perf_counter()

    def made(self, call: Any) -> dict:
        """``call`` just came out of the export: the time since the last phase was its making."""
        row = {"what": call.what}
        if len(self.rows) < self.LIMIT:
            self.rows.append(row)
        self.lap(row, "make_s")
        return row

    def lap(self, row: dict | None, phase: str) -> None:
        now = time.perf_counter()
        if row is not None:
            row[phase] = row.get(phase, 0.0) + now - self.t
            self.sums[phase] += now - self.t
        self.t = now
