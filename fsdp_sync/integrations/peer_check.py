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

`absent_ranks` is the same idea over every rank of the world, every sync, for the module export
(`module_stream.calls`, whose all-reduce spans the world: a rank that runs verl's adapter is then
in verl's per-tensor all-gathers and never meets it). Each rank marks its arrival for the round in
the store and waits for the others; a rank that never said it runs fsdp_sync's adapter
(`announce`, at the adapter's construction and at each round) is waited for only ``grace_s``
(once: a later round does not wait for a rank found absent before), one that did up to
``timeout_s``. The first rank to decide writes the answer once (``compare_set``) and every rank
takes that one, so a rank that arrives late follows the ranks that did not wait for it.

Not here: the sync (`fsdp_sync.integrations.verl.adapter`). Imports only torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Sequence

import torch.distributed as dist

__all__ = ["PROTOCOL", "ENV_HINT", "GRACE_S", "check_group", "announce", "absent_ranks"]

PROTOCOL = "fsdp_sync.verl.SGLangAdapter/1"
"""The protocol this check vouches for: part of the store keys, so another protocol's ranks do
not count either."""

ENV_HINT = ("set VERL_USE_EXTERNAL_MODULES=fsdp_sync.integrations.verl on every node (verl then "
            "imports the plug-in itself and fails loudly where it cannot), or drop "
            "rollout.custom.fsdp_sync.enable")


GRACE_S = 5.0
"""How long `absent_ranks` waits for a rank that never said it runs fsdp_sync's adapter: verl builds
every rank's adapter (``init_model``) before the first sync, so such a rank runs another one."""


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


def _present_key(rank: int) -> str:
    return f"fsdp_sync/present/{PROTOCOL}/{rank}"


def announce() -> None:
    """Say in the store that this rank runs fsdp_sync's adapter (once per process and world is
    enough; idempotent). A no-op without a process group."""
    if dist.is_available() and dist.is_initialized():
        _store().set(_present_key(dist.get_rank()), "1")


def absent_ranks(ranks: Sequence[int], timeout_s: float, *, grace_s: float = GRACE_S,
                 what: str = "module_export") -> list[int]:
    """Collective over the ranks of ``ranks`` (global, this process among them) that call it, by
    the store only: [] when every rank of ``ranks`` arrived at this round (its n-th call), else the
    global ranks that did not (see the module docstring for how long each is waited for). Every
    rank that calls it for a round gets the same answer, whenever it arrives. ``what`` keeps one
    use's rounds apart from another's."""
    ranks = [int(r) for r in ranks]
    me = dist.get_rank()
    if len(ranks) < 2:
        return []
    store = _store()
    announce()
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    prefix = f"fsdp_sync/arrived/{PROTOCOL}/{what}/{digest}"
    n = store.add(f"{prefix}/round/{me}", 1)

    def here(r: int, k: int = n) -> str:
        return f"{prefix}/{k}/{r}"

    store.set(here(me), "1")
    before: list[int] = []
    if n > 1:
        store.delete_key(here(me, n - 1))    # every rank reads a round's decision before its own
        before = json.loads(store.get(f"{prefix}/{n - 1}/decision"))   # this rank read it last round
    decision = f"{prefix}/{n}/decision"
    waited = [here(r) for r in ranks if r not in before]     # a rank absent before: not waited for
    t0 = time.monotonic()
    pause = 0.001
    while not store.check([decision]):
        answer = None
        if store.check(waited):
            answer = [r for r in before if not store.check([here(r)])]
        elif time.monotonic() - t0 > min(grace_s, timeout_s):
            missing = [r for r in ranks if not store.check([here(r)])]
            if (time.monotonic() - t0 > timeout_s
                    or any(not store.check([_present_key(r)]) for r in missing)):
                answer = missing
        if answer is not None:
            store.compare_set(decision, "", json.dumps(sorted(answer)))
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return json.loads(store.get(decision))
