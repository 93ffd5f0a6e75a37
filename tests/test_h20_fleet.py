"""`fleet` unit cases H20's mutation pass found unpinned: the version an engine without a
``weight_version`` commit argument is told (else it serves new weights under the old name), the
refusal of replicas in service on two versions, and a reinstated replica whose partial update is
over. In-process stubs, no engines started."""

from __future__ import annotations

import pytest

from fsdp_sync.fleet import CommitError, Fleet, end_all


class OldEngine:
    """Commits without naming the version (no ``weight_version`` argument); names it apart."""

    def __init__(self, fail_version: bool = False):
        self.calls: list = []
        self.version = "v0"
        self.fail_version = fail_version

    def end_weight_update(self):
        self.calls.append("end")

    def update_weight_version(self, version, abort_all_requests=True):
        self.calls.append(("version", version, abort_all_requests))
        if self.fail_version:
            raise RuntimeError("version route down")
        self.version = version


class NewEngine:
    def __init__(self):
        self.version = "v0"

    def end_weight_update(self, weight_version=None):
        self.version = weight_version


def test_a_commit_tells_every_engine_the_version_it_now_serves():
    old, new = OldEngine(), NewEngine()
    assert end_all([old, new], commit=True, version="v1") == []
    assert (old.version, new.version) == ("v1", "v1")
    assert old.calls == ["end", ("version", "v1", False)]     # after the commit, requests kept
    bad = OldEngine(fail_version=True)
    with pytest.raises(CommitError) as info:                  # one that cannot be named is no commit
        end_all([NewEngine(), bad], commit=True, version="v2")
    assert info.value.committed == [0] and list(info.value.failed) == [1]


def test_an_engine_whose_version_call_fails_after_its_commit_is_said_to_hold_the_new_weights():
    """Its weights are the new version's (end_weight_update returned); only the name failed. Said
    as 'did not' commit before, which sent a reader looking for old weights that were gone."""
    refuses = OldEngine()
    refuses.end_weight_update = lambda: (_ for _ in ()).throw(RuntimeError("commit refused"))
    with pytest.raises(CommitError) as info:
        end_all([NewEngine(), OldEngine(fail_version=True), refuses], commit=True, version="v2")
    said = str(info.value)
    assert "engines [0] committed it, engines [2] did not" in said, said
    assert ("engines [1] committed its weights but still name them by their old version" in said
            and "version route down" in said), said
    assert sorted(info.value.failed) == [1, 2]     # both still quarantined as before


def test_replicas_in_service_on_two_versions_are_refused_before_a_bring_in():
    fleet = Fleet([NewEngine(), NewEngine(), NewEngine()])
    for rep, v in zip(fleet.replicas, ("v3", "v3", None)):
        rep.version = v
    assert fleet.held("v2") == "v3"
    fleet.replicas[1].version = "v4"
    with pytest.raises(RuntimeError, match="hold different versions"):
        fleet.held("v2")
    fleet.quarantine(fleet.replicas[1], "test")               # out of service: not counted
    assert fleet.held("v2") == "v3"


def test_a_reinstated_replica_holds_a_whole_version():
    fleet = Fleet([NewEngine()])
    rep = fleet.replicas[0]
    fleet.quarantine(rep, "died")
    rep.partial, rep.held, rep.rejoin = True, True, True
    fleet.reinstate(rep, "v5")
    assert (rep.serving, rep.version, rep.partial, rep.held, rep.rejoin, rep.reason) == (
        True, "v5", False, False, False, None)


def test_an_engine_that_cannot_name_its_weights_commits_unnamed():
    class Unnamed:
        takes_weight_version = False          # an in-process sglang.Engine (SGLangEngine says so)

        def __init__(self):
            self.calls = []

        def end_weight_update(self, weight_version=None):
            if weight_version is not None:
                raise TypeError("this engine cannot name its weights")
            self.calls.append("end")

    e = Unnamed()
    assert end_all([e], commit=True, version="v1") == [] and e.calls == ["end"]


def test_only_the_torn_replicas_are_kept_paused_and_every_partial_one_is_said():
    from fsdp_sync.fleet import note_partial, take_noted

    take_noted()
    try:
        try:
            raise RuntimeError("sync failed")
        except RuntimeError:
            note_partial(["replica 0", "replica 1"], torn=["replica 1"])
            raise
    except RuntimeError as exc:
        assert "replica 0, replica 1 could not drop" in " ".join(exc.__notes__)
    assert take_noted() == ["replica 1"] and take_noted() == []


def test_an_sglang_server_whose_version_route_fails_after_its_commit_is_said_to_hold_the_new_weights():
    """SGLang 0.5.23's /end_weight_update takes no weight_version: `SGLangEngine` names the weights
    with /update_weight_version after the commit. When that call fails, the commit stands; the
    error says so (`VersionNotNamed`) instead of 'did not commit'."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import fake_sglang as fake

    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.fleet import VersionNotNamed

    with fake.FakeSGLangServer(tp_size=1) as srv:
        eng = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        eng.begin_weight_update()
        srv.script["/update_weight_version"] = [(400, "version route down")]
        with pytest.raises(CommitError) as info:
            end_all([eng], commit=True, version="v2")
    assert isinstance(info.value.failed[0], VersionNotNamed), info.value.failed
    assert "engines [0] committed its weights but still name them by their old version" in str(info.value)
    assert "version route down" in str(info.value)
    assert [p for _, p, _ in srv.requests][-2:] == ["/end_weight_update", "/update_weight_version"]
