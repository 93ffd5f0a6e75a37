"""H57's audit of the reference engine's ``init_weights_update_group`` (`engines.reference.
group_calls`), in process on the mixin (no workers): a call the engine cannot join is refused
before any worker is asked, naming the parameter and value (no test checked these refusals of
the reference engine: mutants ``rank_offset >= 0``, ``world_size + 1``); a join that failed on one
worker is undone on the others (the undo: no test named it); a group of the same name is left
before it is joined again. Within an update (``update_weights_from_distributed``) a refused call aborts the
transaction before any worker receives, and a receive that failed drops the group (mutants: either
dropped survived the reference engine's group tests)."""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest

from fsdp_sync.engines import EngineError, WeightUpdateError
from fsdp_sync.engines.reference.group_calls import UpdateGroupCalls


class _Engine(UpdateGroupCalls):
    device, tp_size = "cpu", 2

    def __init__(self, fail_join_on: tuple = ()) -> None:
        self._update_groups: dict = {}
        self._lock, self.fail_join_on, self.rounds = threading.Lock(), fail_join_on, []

    @contextlib.contextmanager
    def _gate(self, what: str, exclusive: bool = True):
        yield

    def _check_usable(self) -> None:
        pass

    def _responsive(self) -> list[int]:
        return [0, 1]

    def _round(self, cmd, args=None, ranks=None, per_rank=None, what=""):
        self.rounds.append((cmd, [a["rank"] for a in per_rank] if per_rank else args["group_name"]))
        return {r: ("error", "update", "connect refused", "tb", None) if cmd == "join_group" and
                r in self.fail_join_on else ("ok", None) for r in range(self.tp_size)}

    def _raise_errors(self, replies, what) -> None:
        bad = sorted(r for r, rep in replies.items() if rep[0] != "ok")
        if bad:
            raise EngineError(f"{what}: failed on TP ranks {bad}")


GOOD = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=3)


@pytest.mark.parametrize("change, says", [
    (dict(group_name=""), "the group name must not be empty"),
    (dict(backend="nccl"), "backend 'nccl' is not one this cpu engine joins; expected one of \\['gloo'\\]"),
    (dict(master_port=0), "got '127.0.0.1':0"),
    (dict(master_port=True), "got '127.0.0.1':True"),
    (dict(master_port=65536), "master_port in 1..65535"),
    (dict(master_address=""), "master_address must be a host name"),
    (dict(rank_offset=0), r"ranks 0..1 \(rank_offset 0, tp 2\) do not fit a group of world_size 3 whose rank 0"),
    (dict(world_size=2), r"ranks 1..2 \(rank_offset 1, tp 2\) do not fit a group of world_size 2"),
    (dict(rank_offset=True), r"\(rank_offset True, tp 2\) do not fit"),
])
def test_a_group_the_engine_cannot_join_is_refused_naming_the_value(change, says):
    e = _Engine()
    with pytest.raises(WeightUpdateError, match=says):
        e.init_weights_update_group(**{**GOOD, "backend": "gloo", **change})
    assert e.rounds == [] and e._update_groups == {}


def test_a_join_failed_on_one_worker_is_undone_and_a_same_name_group_left_first():
    e = _Engine()
    e.init_weights_update_group(**GOOD, backend="gloo", group_name="g")
    assert e.rounds == [("join_group", [1, 2])] and set(e._update_groups) == {"g"}
    e.rounds.clear()
    e.init_weights_update_group(**GOOD, backend="gloo", group_name="g")
    assert e.rounds == [("leave_group", "g"), ("join_group", [1, 2])]
    bad = _Engine(fail_join_on=(1,))
    with pytest.raises(EngineError, match=r"failed on TP ranks \[1\]"):
        bad.init_weights_update_group(**GOOD, backend="gloo", group_name="g")
    assert bad.rounds == [("join_group", [1, 2]), ("leave_group", "g")] and bad._update_groups == {}


class _Txn(_Engine):
    """`_Engine` inside a transaction, recording aborts and two-phase rounds."""

    _in_txn, _broken, layout, dtype = True, None, None, None

    def __init__(self, receive_fails: bool = False) -> None:
        super().__init__()
        self.aborts, self.receive_fails = [], receive_fails
        self._w = type("W", (), {"procs": [type("P", (), {"is_alive": lambda self: True})()] * 2})()

    def _check_not_aborted(self, what: str) -> None:
        pass

    def _abort_all(self, what: str, why: str) -> None:
        self.aborts.append(why)

    def _two_phase(self, specs, what, cmd=""):
        self.rounds.append((cmd, specs[0]["group_name"]))
        if self.receive_fails:
            raise WeightUpdateError(f"{what}: receive timed out on TP rank 1")

    def _after_update(self, version, flush) -> None:
        self.rounds.append(("after", version))


def test_a_refused_distributed_update_aborts_the_transaction_and_a_failed_receive_drops_the_group(monkeypatch):
    monkeypatch.setattr(sys.modules[UpdateGroupCalls.__module__], "check_entries", lambda *a: None)    # (no model layout here)
    e = _Txn()
    with pytest.raises(WeightUpdateError, match="unknown weight-update group 'nope'"):
        e.update_weights_from_distributed(["a"], ["float32"], [[2]], group_name="nope")
    assert len(e.aborts) == 1 and e.rounds == []          # nothing half-applied: the update is off
    e = _Txn(receive_fails=True)
    e.init_weights_update_group(**GOOD, backend="gloo")
    e.rounds.clear()
    with pytest.raises(WeightUpdateError, match="receive timed out on TP rank 1"):
        e.update_weights_from_distributed(["a"], ["float32"], [[2]])
    assert e.rounds[-1] == ("leave_group", "weight_update_group") and e._update_groups == {}
