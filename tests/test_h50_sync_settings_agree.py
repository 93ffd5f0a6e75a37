"""Trainer ranks whose `SyncConfig` differs where it decides the sync's collectives are refused by
name before the export's first collective, as ranks holding different models are
(`weights.export_checks`). Before (H50's audit): a rank passing another ``bucket_bytes`` planned
other buckets, and on 2 gloo ranks of the tiny model both blocked in mismatched all-gathers for
65-73 s, then raised raw gloo errors ("Connection closed by peer", "Application timeout caused
pair closure"); after, both raise the same `SyncError` naming ``SyncConfig.bucket_bytes`` and both
values within 3 s (measured with /tmp's two-rank manager script, `method="tensor"`, ``layout="full"``).

In process: two threads as the two ranks, `agree`'s all-reduce and the lists' all-gather
answered as for a two-rank group (the real ones: tests/test_rank_model_mismatch.py)."""

from __future__ import annotations

import threading
import types

import pytest
from torch import nn

from fsdp_sync import SyncConfig, SyncError
from fsdp_sync.topology import RanksDiffer
from fsdp_sync.weights import export_checks


def _model(width: int = 3) -> nn.Module:
    m = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    m.config = types.SimpleNamespace(tie_word_embeddings=False)
    return m


def _two_ranks(monkeypatch, models, configs, errors=(None, None)) -> list:
    """`agree_on_model` on two threads as ranks 0 and 1 (``errors``: what each passes it): what
    each raised (or None)."""
    digests, lists, passed = [None, None], [None, None], [None, None]
    barrier = threading.Barrier(2, timeout=20)
    me = threading.local()

    def agree(error, group=None, *, what, digest=None):
        digests[me.rank], passed[me.rank] = digest, error
        barrier.wait()
        failed = [r for r in (0, 1) if passed[r] is not None]
        err = SyncError(f"{what} failed on rank {failed[0]}: {passed[failed[0]]}") if failed else None
        if digests[0] != digests[1]:
            diff = RanksDiffer(f"{what}: the ranks' digests differ")
            diff.error, diff.failures = err, {r: str(passed[r]) for r in failed}
            raise diff
        if err is not None:
            raise err

    def all_gather_object(out, obj, group=None):
        lists[me.rank] = obj
        barrier.wait()
        out[:] = list(lists)

    monkeypatch.setattr(export_checks, "agree", agree)
    monkeypatch.setattr(export_checks, "cpu_group", lambda: None)
    monkeypatch.setattr(export_checks, "dist", types.SimpleNamespace(
        get_world_size=lambda group=None: 2, all_gather_object=all_gather_object))
    got: list = [None, None]

    def rank(r):
        me.rank = r
        try:
            export_checks.agree_on_model(models[r], configs[r], errors[r], what="weight sync")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.mark.parametrize("field, a, b", [("bucket_bytes", 1 << 20, 4096), ("strategy", "flattened", "bucketed"),
                                         ("fsdp1_state_dict", "full", "local"),
                                         ("share_host_memory", True, False)])
def test_a_rank_with_other_collective_settings_is_refused_naming_the_field(monkeypatch, field, a, b):
    model = _model()
    got = _two_ranks(monkeypatch, [model, model], [SyncConfig(**{field: a}), SyncConfig(**{field: b})])
    assert all(isinstance(e, SyncError) for e in got), got
    assert str(got[0]) == str(got[1])
    text = str(got[0])
    assert f"SyncConfig.{field} is {b!r} on rank 1, {a!r} on rank 0" in text, text
    assert "sync settings differ" in text and "same SyncConfig" in text, text


def test_the_same_settings_agree_and_a_model_difference_is_named_first(monkeypatch):
    model = _model()
    assert _two_ranks(monkeypatch, [model, model], [SyncConfig(memory_probe="off"), SyncConfig()]) == [None, None]
    got = _two_ranks(monkeypatch, [model, _model(5)], [SyncConfig(), SyncConfig(bucket_bytes=4096)])
    text = str(got[1])
    assert "hold different models" in text and "'0.weight' is float32 (5, 4) on rank 1" in text, text


def test_a_ranks_own_error_is_added_and_a_rank_that_cannot_list_its_model_says_why(monkeypatch):
    """Beside a difference, a rank's own error is said too ("besides"); a rank whose model could
    not be listed (no entries to compare) raises its error, not a failure to describe a
    difference (H50 mutation pass: dropping either survived tests/test_rank_model_mismatch.py)."""
    model = _model()
    got = _two_ranks(monkeypatch, [model, model], [SyncConfig(), SyncConfig(bucket_bytes=4096)],
                     errors=(None, "ValueError: rank 1's own finding"))
    text = str(got[0])
    assert str(got[1]) == text and "SyncConfig.bucket_bytes is 4096 on rank 1" in text, text
    assert text.endswith("; besides, weight sync failed on rank 1: ValueError: rank 1's own finding"), text

    real = export_checks.model_entries
    monkeypatch.setattr(export_checks, "model_entries", lambda m, c: real(m, c) if m is model else 1 / 0)
    got = _two_ranks(monkeypatch, [model, _model()], [SyncConfig(), SyncConfig()])
    assert [type(e) for e in got] == [SyncError, SyncError], got
    assert str(got[0]) == str(got[1]) == "weight sync failed on rank 1: ZeroDivisionError: division by zero"
