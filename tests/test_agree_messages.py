"""`topology.agree`'s message: what failed, on which rank first, which others failed too.

Every rank raises the same `SyncError`: ``"<what> failed on rank <first>[ (ranks [...] failed
too)]: <text>"``, where ``<what>`` is the failure's own name when a rank passed ``(what, text)``
(the manager's stages agreed together) and the caller's ``what`` otherwise; without a process group
``"<what> failed: <text>"``. ``failures`` holds each failing rank's text. Run on 3 gloo ranks.
`agree_after_rank0` over a group whose rank 0 is not global rank 0 raises on its members alike.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fsdp_sync.topology import SyncError, agree


def test_without_a_process_group_the_failures_own_name_leads():
    assert not dist.is_initialized()
    agree(None, what="sync")                     # nothing failed: nothing raised
    with pytest.raises(SyncError) as info:
        agree(("restore_rng", "RuntimeError: boom"), what="exit")
    assert str(info.value) == "restore_rng failed: RuntimeError: boom"
    assert info.value.failures == {0: "RuntimeError: boom"}
    with pytest.raises(SyncError) as info:
        agree(ValueError("bad batch"), what="preprocess_data")
    assert str(info.value) == "preprocess_data failed: ValueError: bad batch"


# what each of 3 ranks passes to `agree`, per case
_CASES = {
    "two_fail": [None, "ValueError: rank 1's", "OSError: rank 2's"],
    "one_fails": ["disk full", None, None],
    "stages": [("restore_module", "RuntimeError: mine"), ("restore_module", "RuntimeError: boom"), None],
    "none": [None, None, None],
}


def _agree_on_ranks(rank, world):
    import torch.distributed as dist

    from fsdp_sync.topology import SyncError, agree

    assert dist.is_initialized() and dist.get_world_size() == world
    out = {}
    for label, errors in _CASES.items():
        try:
            agree(errors[rank], what="exit" if label == "stages" else "sync")
            out[label] = None
        except SyncError as exc:
            out[label] = (str(exc), dict(exc.failures))
    # agree_after_rank0 over a group whose rank 0 is global rank 1 (verl's second infer-TP group):
    # rank 1's work fails, and ranks 1 and 2 both raise it (the broadcasts' source is group rank 0)
    from fsdp_sync.topology import agree_after_rank0

    group = dist.new_group([1, 2])
    if rank > 0:
        try:
            agree_after_rank0(lambda: "boom on group rank 0", group, what="lora", round_s=0.01)
            out["after_rank0"] = None
        except SyncError as exc:
            out["after_rank0"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_the_first_failing_rank_leads_and_only_the_others_are_listed():
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    results = run_ranks(_agree_on_ranks, 3, timeout_s=100, pg_timeout_s=60, env=spawn_env())
    said = "lora failed on group rank 0: boom on group rank 0"     # on the group's members only
    assert [r.pop("after_rank0", None) for r in results] == [None, said, said], results
    assert results[0] == results[1] == results[2]          # the same error on every rank
    got = results[0]
    assert got["none"] is None
    assert got["two_fail"] == ("sync failed on rank 1 (ranks [2] failed too): ValueError: rank 1's",
                               {1: "ValueError: rank 1's", 2: "OSError: rank 2's"})
    assert got["one_fails"] == ("sync failed on rank 0: disk full", {0: "disk full"})
    # a stage's own name leads, not the caller's ``what``
    assert got["stages"] == ("restore_module failed on rank 0 (ranks [1] failed too): RuntimeError: mine",
                             {0: "RuntimeError: mine", 1: "RuntimeError: boom"})


@pytest.mark.parametrize("one_rank_group", [False, True], ids=["no-group", "one-rank-gloo"])
def test_a_raised_agreement_keeps_no_callers_frame_alive(one_rank_group):
    """`agree` held the SyncError it raised in a local: a cycle (its frame -> the error -> the
    traceback -> its frame) that kept every caller's frame of a failed sync, and what they held
    (the tensor method's bucket buffer: bucket_bytes of /dev/shm or CUDA memory), alive until a
    gen-2 collection. Checked with the collector off: the caller's object must go with the error."""
    import gc
    import weakref

    class Held:        # stands in for a failed sync's bucket buffer
        pass

    refs: list = []

    def failing_sync() -> None:
        held = Held()
        refs.append(weakref.ref(held))
        agree("RuntimeError: refused", what="sync")

    if one_rank_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    was = gc.isenabled()
    gc.disable()
    try:
        try:
            failing_sync()
        except SyncError as exc:
            assert "sync failed" in str(exc) and "RuntimeError: refused" in str(exc)
        assert refs and refs[0]() is None, "the failed caller's frame outlived its error"
    finally:
        if was:
            gc.enable()
        if one_rank_group:
            dist.destroy_process_group()
