"""Whether every rank of a group runs fsdp_sync's adapter: checked once, before the first sync.

verl loads plug-ins on ``import verl`` and logs one that fails to load at DEBUG only; that process
then runs verl's own rollout adapter. Ranks of one infer-TP group would disagree on the protocol
(verl's per-tensor handles against fsdp_sync's flattened buckets) and hang, or hand the engine
what it cannot read. `check_group` turns that into an error naming the ranks, before any weight
moves.

The check uses no collective: a rank that runs verl's adapter would meet a collective in another
order (it pulls a bucket of verl's export, an all-gather per tensor on the trainer group, before
its first gather on the infer-TP group) and both would hang. Instead each rank counts its checks
under its own key in the default process group's store (the rendezvous store every rank of the
world already shares) and waits, at most ``timeout_s``, until every other rank of the group has
counted as many: a rank that runs another adapter never does, and every fsdp_sync rank of the
group raises, naming it. Ranks that run fsdp_sync's adapter pay a store round trip per peer, once.
(The ranks that run verl's adapter wait in their own collectives until the run, failed by this
error, is torn down.)

Not here: the sync (`fsdp_sync.integrations.verl.adapter`). Imports only torch.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch.distributed as dist

__all__ = ["PROTOCOL", "ENV_HINT", "check_group"]

PROTOCOL = "fsdp_sync.verl.SGLangAdapter/1"
"""The protocol this check vouches for: part of the store keys, so another protocol's ranks do
not count either."""

ENV_HINT = ("set VERL_USE_EXTERNAL_MODULES=fsdp_sync.integrations.verl on every node (verl then "
            "imports the plug-in itself and fails loudly where it cannot), or drop "
            "rollout.custom.fsdp_sync.enable")


def _store():
    # the default group's rendezvous store: torch has no public accessor for it
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def check_group(ranks: Sequence[int], timeout_s: float, *, what: str = "infer-TP") -> None:
    """Every rank of the group (global ``ranks``, in group order; this process among them) calls
    this once per adapter: returns when every other rank did as often, raises `RuntimeError`
    naming the ranks that did not within ``timeout_s``."""
    ranks = [int(r) for r in ranks]
    me = dist.get_rank()
    if len(ranks) < 2:
        return
    store = _store()
    prefix = f"fsdp_sync/peer_check/{PROTOCOL}/{','.join(map(str, ranks))}"
    mine = store.add(f"{prefix}/{me}", 1)
    deadline = time.monotonic() + timeout_s
    waiting = [r for r in ranks if r != me]
    pause = 0.005
    while waiting:
        waiting = [r for r in waiting if store.add(f"{prefix}/{r}", 0) < mine]
        if not waiting:
            return
        if time.monotonic() > deadline:
            where = ", ".join(f"{what} rank {ranks.index(r)} (global rank {r})" for r in waiting)
            raise RuntimeError(
                f"fsdp_sync's verl adapter on {what} rank {ranks.index(me)} (global rank {me}): "
                f"{where} did not start fsdp_sync's adapter within {timeout_s:g} s of this rank: "
                f"{'they run' if len(waiting) > 1 else 'it runs'} another rollout adapter (verl's "
                f"own, if the fsdp_sync plug-in failed to load there: verl logs that at DEBUG "
                f"only) or never reached the sync; {ENV_HINT}")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
