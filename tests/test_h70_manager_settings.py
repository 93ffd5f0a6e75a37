"""Trainer ranks whose `SyncConfig` differs in a setting that decides the manager's stages
(`manager.STAGE_SETTINGS`: ``pause_mode``, ``multi_stage_wake_up``, ``offload_params`` ...), or
whose manager's ``global_steps`` differs, are refused at the first stage's agree, naming the setting, each value and its ranks, on every rank
alike, at no round trip of its own. Before (H70's audit, 2 gloo ranks of the tiny model,
``method="tensor"``, a reference engine): under ``pause_mode`` 'abort' on rank 0 and None on rank
1 both ranks blocked until the 15 s group timeout, then raised raw gloo errors ("Application
timeout caused pair closure"); with ``multi_stage_wake_up`` or ``offload_params`` differing each
rank ran its own stages and the sync "succeeded"; ``global_steps`` set on rank 0 alone under
``verify="sample"`` (FSDP2) made the ranks gather other tensors: gloo aborted rank 0 ("collective
mismatch", SIGABRT). After: the same `SyncError` on both within 1 s.

In process: two threads as the two ranks, `agree`'s all-reduce and the values' all-gather answered
as for a two-rank group (the weight sync itself stubbed: the stages around it are under test)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from fsdp_sync import FSDPShardingManager, SyncConfig, SyncError, manager as manager_mod, topology
from fsdp_sync.fleet import Fleet
from fsdp_sync.topology import RanksDiffer

pytestmark = pytest.mark.timeout(60)


class _Engine:
    base_url = "http://127.0.0.1:39990"

    def dead_reason(self):
        return None


def _two_ranks(monkeypatch, configs, fail_resume_on=None, steps=(None, None), base_done=(False, False)):
    """A ``with`` block on two threads as trainer ranks 0 and 1: what each raised (or None), and
    the digests each passed to its agrees, in order."""
    passed, digests, lists = [None, None], [None, None], [None, None]
    seen: list = [[], []]
    barrier = threading.Barrier(2, timeout=20)
    me = threading.local()

    def agree(error, group=None, *, what, digest=None):
        own = error if isinstance(error, tuple) else (None, error)   # (what failed, text)
        passed[me.rank], digests[me.rank] = (None if own[1] is None else own), digest
        seen[me.rank].append(digest)
        barrier.wait()
        failed = [r for r in (0, 1) if passed[r] is not None]
        err = None
        if failed:
            first = passed[failed[0]]
            err = SyncError(f"{first[0] or what} failed on rank {failed[0]}: {first[1]}")
            err.failures = {r: str(passed[r][1]) for r in failed}
        barrier.wait()           # both read before either writes again
        if None not in digests and digests[0] != digests[1]:
            diff = RanksDiffer(f"{what}: the ranks' digests differ")
            diff.error, diff.failures = err, (err.failures if err is not None else {})
            raise diff
        if err is not None:
            raise err

    def all_gather_object(out, obj, group=None):
        lists[me.rank] = obj
        barrier.wait()
        out[:] = list(lists)
        barrier.wait()

    monkeypatch.setattr(topology, "agree", agree)
    monkeypatch.setattr(manager_mod, "agree", agree)
    monkeypatch.setattr(topology, "cpu_group", lambda group=None: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    managers = []
    for r, cfg in enumerate(configs):
        m = FSDPShardingManager(torch.nn.Linear(2, 2), _Engine(), config=cfg)
        if r == 1:
            m.rank, m.fleet = 1, Fleet([])       # trainer rank 1 holds no replica
        m._sync_weights = lambda: None
        m.global_steps, m.base_sync_done = steps[r], base_done[r]
        if r == fail_resume_on:
            def boom(tags):
                raise OSError("resume failed (injected)")
            m._resume = boom
        managers.append(m)
    got: list = [None, None]

    def rank(r):
        me.rank = r
        try:
            with managers[r]:
                pass
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    for m in managers:
        m.close()
    return got, seen


def _cfg(**kw):
    return SyncConfig(method="distributed", memory_probe="off", **kw)


@pytest.mark.parametrize("field, a, b", [("pause_mode", "abort", None), ("multi_stage_wake_up", True, False),
                                         ("offload_params", False, True), ("free_cache_engine", True, False),
                                         ("on_replica_failure", "abort", "quarantine")])
def test_a_rank_with_other_stage_settings_is_refused_naming_setting_ranks_and_values(monkeypatch, field, a, b):
    got, seen = _two_ranks(monkeypatch, [_cfg(**{field: a}), _cfg(**{field: b})])
    assert all(isinstance(e, SyncError) for e in got), got
    assert str(got[0]) == str(got[1])
    text = str(got[0])
    assert f"SyncConfig.{field} is {a!r} on rank 0, {b!r} on rank 1" in text, text
    assert "nothing was sent" in text and "same SyncConfig" in text, text
    assert [len(s) for s in seen] == [1, 1], seen      # refused at the first agree, before the sync


def test_equal_settings_cost_no_agree_of_their_own(monkeypatch):
    """The block's agrees are the four it ran before (the first stage's, sync_weights', swap_rng's,
    the exit's): the settings ride in the first one's digest, the same on both ranks."""
    for multi in (True, False):
        got, seen = _two_ranks(monkeypatch, [_cfg(multi_stage_wake_up=multi)] * 2)
        assert got == [None, None]
        assert [len(s) for s in seen] == [4, 4], seen
        assert seen[0][0] is not None and seen[0][0] == seen[1][0] and seen[0][1:] == [None] * 3


def test_a_stage_failure_beside_a_difference_is_said_too(monkeypatch):
    got, _ = _two_ranks(monkeypatch, [_cfg(pause_mode="abort"), _cfg()], fail_resume_on=1)
    text = str(got[0])
    assert str(got[1]) == text and "SyncConfig.pause_mode is 'abort' on rank 0, None on rank 1" in text, text
    assert text.endswith("; besides, stage 'resume_weights' failed on rank 1: OSError: resume failed "
                         "(injected)"), text


def test_global_steps_set_on_one_rank_only_is_refused_naming_it(monkeypatch):
    got, seen = _two_ranks(monkeypatch, [_cfg(verify="sample")] * 2, steps=(5, None))
    assert all(isinstance(e, SyncError) for e in got) and str(got[0]) == str(got[1]), got
    assert "FSDPShardingManager.global_steps is '5' on rank 0, None on rank 1" in str(got[0]), got[0]
    assert "set global_steps and base_sync_done alike on every rank" in str(got[0]), got[0]
    got, _ = _two_ranks(monkeypatch, [_cfg()] * 2, steps=(5, 5))
    assert got == [None, None]


def test_base_sync_done_set_on_one_rank_only_is_refused_naming_it(monkeypatch):
    """lora="adapter": base_sync_done decides whether the base goes (with its own checks' agree)
    or the adapter alone (the model digest's agree first): ranks that differ ran other agrees."""
    got, _ = _two_ranks(monkeypatch, [_cfg(lora="adapter")] * 2, base_done=(False, True))
    assert all(isinstance(e, SyncError) for e in got) and str(got[0]) == str(got[1]), got
    assert "FSDPShardingManager.base_sync_done is False on rank 0, True on rank 1" in str(got[0]), got[0]
    assert _two_ranks(monkeypatch, [_cfg()] * 2, base_done=(False, True))[0] == [None, None]   # no LoRA: unused


def test_a_setting_only_one_rank_lists_is_named_alike_on_every_rank(monkeypatch):
    """lora differing: only the adapter rank lists base_sync_done; both ranks name it the same."""
    got, _ = _two_ranks(monkeypatch, [_cfg(), _cfg(lora="adapter")])
    assert str(got[0]) == str(got[1]), got
    assert "SyncConfig.lora is 'off' on rank 0, 'adapter' on rank 1; FSDPShardingManager.base_sync_done is " \
           "(not set) on rank 0, False on rank 1" in str(got[0]), got[0]
