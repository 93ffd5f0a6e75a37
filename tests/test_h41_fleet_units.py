"""`fleet` and `topology` cases H41's mutation pass found unpinned (in process, stub engines, no
ranks): each mutant named survived every test of its module before.

- `end_all` leaves an engine in ``skip`` alone (its request still runs), commit or abort, and
  keeps every engine's index in what it raises (mutant: ``skip`` ignored);
- an engine without ``end_weight_update`` is told the committed version (mutant: not told: it
  would serve the new weights under the old name) and, on an abort, said to keep what it took;
- `Fleet.blame` keeps the rejoiners out only where nothing else is to blame and not every target
  rejoined (mutants: the two conditions dropped), `Fleet.keep_out` holds them (mutant: not held:
  probed and refused again at every sync) and keeps the time they first went out;
- `problem(once=True)` probes without the client's retries (mutant: full backoff on every sync for
  a dead replica);
- `restate` keeps the error's notes (the replicas that kept part of the update) and attributes;
- `agree` refuses a digest outside [0, 2**62) (it would set the "failed" bit of the all-reduce);
  `let_go_of_frames` clears the frames of the error's causes too (a bucket held there stays
  mapped); `released_by_backend` waits for the backend's own reference, not one more.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from fsdp_sync import topology
from fsdp_sync.fleet import CommitError, Fleet, end_all, problem, restate


class Engine:
    """Takes ``weight_version`` and ``abort`` (the reference engine's signature)."""

    def __init__(self, fail_commit: bool = False, dead: str | None = None):
        self.calls: list = []
        self.fail_commit, self.dead = fail_commit, dead

    def end_weight_update(self, *, abort: bool = False, weight_version=None):
        self.calls.append(("abort",) if abort else ("commit", weight_version))
        if self.fail_commit and not abort:
            raise RuntimeError("commit refused")
        return True

    def dead_reason(self):
        return self.dead


def test_end_all_leaves_skipped_engines_alone_and_keeps_every_index():
    a, stuck, bad, d = Engine(), Engine(), Engine(fail_commit=True), Engine()
    with pytest.raises(CommitError) as info:
        end_all([a, stuck, bad, d], commit=True, version="v1", skip={1})
    assert stuck.calls == [], stuck.calls               # its request still runs: not called
    assert info.value.committed == [0, 3] and list(info.value.failed) == [2], info.value
    assert str(info.value).startswith("engine 2 failed while committing version 'v1'"), info.value
    a2, stuck2 = Engine(), Engine()
    assert end_all([a2, stuck2], commit=False, skip=[1]) == []
    assert a2.calls == [("abort",)] and stuck2.calls == []


def test_an_engine_without_end_weight_update_is_told_the_committed_version():
    class NoEnd:                        # a duck-typed engine: no session calls, a version route
        base_url = "http://h:1"

        def __init__(self):
            self.versions: list = []

        def update_weight_version(self, version, abort_all_requests=True):
            self.versions.append((version, abort_all_requests))

    e = NoEnd()
    assert end_all([Engine(), e], commit=True, version="v7") == []
    assert e.versions == [("v7", False)]
    # an abort cannot drop what it applied: said, and its version left alone
    assert end_all([Engine(), e], commit=False) == ["replica 1 (http://h:1)"]
    assert e.versions == [("v7", False)]


def _fleet(n, rejoining=(), dead=()):
    engines = [Engine(dead="worker 0 died" if i in dead else None) for i in range(n)]
    fleet = Fleet(engines)
    for i in rejoining:
        fleet.quarantine(fleet.replicas[i], "failed while committing (simulated)")
    return fleet


def test_blame_keeps_rejoiners_out_only_where_nothing_else_is_to_blame():
    fleet = _fleet(3, rejoining=[2])
    assert fleet.blame(fleet.replicas, None, "5") == {"failed": {}, "committed": None, "refused": [2]}
    # a dead replica is what failed: it is quarantined, the rejoiner is not blamed with it
    fleet = _fleet(3, rejoining=[2], dead=[0])
    assert fleet.blame(fleet.replicas, None, "5") == {
        "failed": {0: "worker 0 died"}, "committed": None, "refused": []}
    # every target rejoined: keeping them all out would leave nothing to sync: the error is raised
    fleet = _fleet(2, rejoining=[0, 1])
    assert fleet.blame(fleet.replicas, None, "5")["refused"] == []


def test_keep_out_holds_the_rejoiners_until_recover_and_keeps_when_they_went_out():
    fleet = _fleet(3, rejoining=[1])
    rep = fleet.replicas[1]
    since = rep.quarantined_at
    rep.rejoin = True
    left = fleet.keep_out(fleet.replicas, [1], RuntimeError("begin refused"), "5")
    assert left == [fleet.replicas[0], fleet.replicas[2]]
    assert (rep.serving, rep.held, rep.rejoin, rep.quarantined_at) == (False, True, False, since)
    assert "rejoining at version '5' failed (RuntimeError: begin refused)" in rep.reason, rep.reason
    assert "recover()" in rep.reason, rep.reason


def test_a_probe_made_once_asks_without_the_clients_retries():
    seen: list = []

    class Http:
        def get_weight_version(self, retries=5):
            seen.append(retries)
            raise ConnectionError("refused")

    class Plain:
        def get_weight_version(self):
            seen.append("plain")
            return "3"

    assert problem(Http(), once=True) == "ConnectionError: refused"
    assert problem(Http()) == "ConnectionError: refused"
    assert problem(Plain(), once=True) is None
    assert seen == [0, 5, "plain"], seen


def test_restate_keeps_the_notes_and_attributes():
    err = topology.SyncError("sync failed on rank 0: boom")
    err.failures = {0: "boom"}
    err.add_note("replica 1 could not drop any calls it took before the failure")
    new = restate(err, f"{err}; quarantined: replica 1")
    assert type(new) is topology.SyncError and str(new).endswith("quarantined: replica 1")
    assert new.failures == {0: "boom"}
    assert new.__notes__ == err.__notes__ and new.__notes__ is not err.__notes__


@pytest.mark.parametrize("digest", [-1, 1 << 62, 1 << 63])
def test_agree_refuses_a_digest_outside_its_range(digest):
    with pytest.raises(ValueError, match=r"agree's digest must be an int in \[0, 2\*\*62\)"):
        topology.agree(None, digest=digest)
    topology.agree(None, digest=(1 << 62) - 1)          # the largest that fits: no group, no error


def test_let_go_of_frames_clears_the_frames_of_the_errors_causes():
    class Bucket:
        pass

    refs: list = []

    def send():
        bucket = Bucket()        # noqa: F841 - held by this frame, as a transport's buffer is
        refs.append(weakref.ref(bucket))
        raise OSError("engine refused the bucket")

    def sync():
        try:
            send()
        except OSError as exc:
            raise topology.SyncError("sync failed") from exc

    gc.disable()                 # only the frames may let go of it, not a collection
    try:
        try:
            sync()
        except topology.SyncError as exc:
            err = exc
        assert refs[0]() is not None           # the cause's traceback keeps send()'s frame
        topology.let_go_of_frames(err)
        assert refs[0]() is None
        assert "send" in "".join(__import__("traceback").format_exception(err))   # still said
    finally:
        gc.enable()


def test_released_by_backend_waits_for_the_backends_reference(monkeypatch):
    """A reference the "backend" (here autograd's saved tensor, taken inside the block as gloo
    takes one inside the collective) still holds at the block's end is waited for: the block is
    left only once it is dropped. The dropping thread starts only once the wait is polling."""
    flag = torch.tensor([3.0])
    polling = threading.Event()
    real_sleep = topology.time.sleep

    def sleep(s):
        polling.set()
        real_sleep(s)

    monkeypatch.setattr(topology.time, "sleep", sleep)
    held: dict = {}

    def drop():
        polling.wait(60)
        held.clear()

    with topology.released_by_backend(flag, timeout_s=120):
        held["work"] = torch.ones(1, requires_grad=True) * flag    # saves ``flag``: one more use
        assert flag._use_count() == 2
        dropper = threading.Thread(target=drop, daemon=True)
        dropper.start()
    assert flag._use_count() == 1 and polling.is_set()
    dropper.join(60)


def test_an_engine_whose_abort_fails_is_said_to_keep_part_of_the_update():
    """Its abort call raised (a 5xx, a timeout): whether it dropped what it took is unknown, and an
    engine that applies calls as they arrive (SGLang) holds them either way. It was only logged:
    not in the sync's note, no generation paused on it, partly new weights served as whole."""
    class AbortFails(Engine):
        base_url = "http://h:2"

        def end_weight_update(self, *, abort: bool = False, weight_version=None):
            super().end_weight_update(abort=abort, weight_version=weight_version)
            raise ConnectionError("abort timed out")

    fine, failing = Engine(), AbortFails()
    assert end_all([fine, failing], commit=False) == ["replica 1 (http://h:2)"]
    assert failing.calls == [("abort",)] and fine.calls == [("abort",)]


def test_agree_after_rank0_fails_every_rank_when_the_work_ends_by_a_base_exception(monkeypatch):
    """Rank 0's work runs in a thread: one ended by a BaseException that is no Exception (a
    SystemExit from an engine's code, a cancellation) left no error, and every rank went on as if
    the work (the engines' rendezvous) had succeeded: into the weights' broadcast, to wait there
    until the timeout. Two ranks stubbed: this is group rank 0; the peer passed no error."""
    gathered: list = []

    def all_gather_object(out, obj, group=None):
        gathered.append(obj)
        out[:] = [obj, (None, None)]

    monkeypatch.setattr(topology, "cpu_group", lambda group=None: group)
    for name, fn in {"is_initialized": lambda: True, "get_world_size": lambda group=None: 2,
                     "get_rank": lambda group=None: 0, "broadcast": lambda t, src, group=None: None,
                     "all_reduce": lambda t, op=None, group=None: None,
                     "all_gather_object": all_gather_object}.items():
        monkeypatch.setattr(topology.dist, name, fn)

    def work():
        raise SystemExit("the engine's launcher exited")

    with pytest.raises(topology.SyncError, match=r"^open failed on rank 0: SystemExit: the engine's "
                                                 r"launcher exited$"):
        topology.agree_after_rank0(work, what="open", round_s=0.01)
