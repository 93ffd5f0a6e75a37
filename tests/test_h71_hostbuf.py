"""`hostbuf.HostShared.create` where a rank fails part-way through mapping group rank 0's buffers:
every segment goes once nobody holds it (none is given back twice and left in /dev/shm until the
process exits). In one process: two threads are the group's two ranks over a stand-in for the
collectives (thread barriers), so rank 1 maps rank 0's segments through torch's own cache, whose
reference arithmetic is a separate process's (open +1, the pickling's reference -1, close -1)."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from torch.multiprocessing import reductions as _red

from fsdp_sync.weights import handles, hostbuf, unpickle

pytestmark = pytest.mark.timeout(120)


class _TwoThreads:
    """The collectives `hostbuf` calls, for two threads that are group ranks 0 and 1."""

    class ReduceOp:
        MAX = "max"

    def __init__(self) -> None:
        self.local = threading.local()
        self.barrier = threading.Barrier(2, timeout=60)
        self.box: dict[int, object] = {}

    def get_world_size(self, group=None) -> int:
        return 2

    def get_rank(self, group=None) -> int:
        return self.local.rank

    def get_global_rank(self, group, rank: int) -> int:
        return rank

    def _exchange(self, value):
        self.barrier.wait()
        self.box[self.local.rank] = value
        self.barrier.wait()
        out = [self.box[0], self.box[1]]
        self.barrier.wait()
        return out

    def all_gather_object(self, out, obj, group=None) -> None:
        out[:] = self._exchange(obj)

    def scatter_object_list(self, out, objs, src=0, group=None) -> None:
        out[0] = self._exchange(objs)[src][self.local.rank]

    def all_reduce(self, t, op=None, group=None) -> None:
        t.fill_(max(self._exchange(int(t.item()))))

    def barrier(self, group=None) -> None:
        self._exchange(None)


def _create(monkeypatch, fail_at: int | None):
    """Both ranks' `HostShared.create(group, 3, 4096)`, rank 1's ``fail_at``-th mapping raising;
    returns their results and the names of every segment rank 0 made."""
    fake = _TwoThreads()
    monkeypatch.setattr(hostbuf, "dist", fake)
    monkeypatch.setattr(hostbuf, "cpu_group", lambda g: g)
    made: list[str] = []
    empty_shared = handles.empty_shared

    def recorded(nbytes, *a, **k):
        t = empty_shared(nbytes, *a, **k)
        made.append(t.untyped_storage()._share_filename_cpu_()[1].decode())
        return t

    monkeypatch.setattr(handles, "empty_shared", recorded)
    calls = [0]

    class Red:        # torch's reductions, but rank 1's fail_at-th mapping raises
        def __getattr__(self, name):
            return getattr(_red, name)

        @staticmethod
        def rebuild_storage_filename(*a, **k):
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError("cannot map (injected)")
            return _red.rebuild_storage_filename(*a, **k)

    monkeypatch.setattr(unpickle, "_red", Red())
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        fake.local.rank = r
        try:
            results[r] = hostbuf.HostShared.create(object(), 3, 4096)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            results[r] = exc
            fake.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for r in (0, 1):
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return results, made


def _in_dev_shm(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists("/dev/shm" + n)]


def test_a_rank_failing_part_way_through_mapping_leaves_no_segment(monkeypatch, caplog):
    results, made = _create(monkeypatch, 2)     # rank 1 maps the first buffer, not the second
    assert results == {0: None, 1: None}                      # both ranks gather instead
    assert "group ranks [1] could not open" in caplog.text and "injected" in caplog.text
    assert len(made) >= 3
    del results
    gc.collect()
    # before: the buffers rank 1 had mapped were given back twice (their count -1), so no close
    # unlinked them: they stayed in /dev/shm until the process exited
    assert _in_dev_shm(made) == []


def test_the_buffers_are_shared_and_go_with_their_last_holder(monkeypatch):
    results, made = _create(monkeypatch, None)
    a, b = results[0], results[1]
    assert a.me == 0 and b.me == 1 and len(a.bufs) == len(b.bufs) == 3
    b.bufs[2][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert a.bufs[2][:4].tolist() == [1, 2, 3, 4]
    del a, b, results
    gc.collect()
    assert _in_dev_shm(made) == []
