"""The disk method's load step and writer thread (mutation pass, H7).

`disk_load.load_version` with one engine that applies a disk load at once (SGLang: no session) and
fails: that replica is named as kept and torn (it may hold part of the version, or the new weights
under the old name), so the manager takes it out of service; one that stages the load (a session)
holds nothing of it. `OneWriter.drive`: a stream that yields fewer buckets than planned is an error,
never a version published with files missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


class _AppliesAtOnce:
    def update_weights_from_disk(self, path, load_format=None, weight_version=None):
        raise RuntimeError("failed partway (injected)")


class _Stages(_AppliesAtOnce):
    def begin_weight_update(self):
        pass

    def end_weight_update(self, *, abort=False, weight_version=None):
        return True


@pytest.mark.parametrize("staged", [False, True])
def test_one_engine_failing_its_load_is_named_torn_only_where_it_applies_loads_at_once(staged):
    from fsdp_sync import fleet
    from fsdp_sync.transport.disk_load import load_version

    engine = _Stages() if staged else _AppliesAtOnce()
    ctx = SimpleNamespace(engines=[engine], config=SimpleNamespace(pause_mode=None), version="v1")
    out = load_version(ctx, "/nowhere/step_1")
    assert out.err is not None and "injected" in str(out.err)
    want = [] if staged else [fleet.describe(engine, 0)]
    assert out.kept == want and out.torn == want


def test_a_stream_short_of_the_planned_buckets_is_an_error(tmp_path):
    from fsdp_sync.transport.disk_writer import OneWriter

    w = OneWriter("the bucket stream", 3, str(tmp_path))
    records, err = w.drive(iter([1, 2]), lambda item: None)
    assert isinstance(err, RuntimeError) and "yielded 2 buckets, 3 were planned" in str(err)
    w = OneWriter("the bucket stream", 2, str(tmp_path))
    assert w.drive(iter([1, 2]), lambda item: None) == ([], None)
