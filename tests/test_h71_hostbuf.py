"""`hostbuf.HostShared` where one rank fails. Part-way through mapping group rank 0's buffers:
every segment goes once nobody holds it (none is given back twice and left in /dev/shm until the
process exits). In its write of a bucket: every rank's `fill` raises the same `SyncError` naming
it (its peers waited in the barrier until the group's timeout). In one process: two threads are
the group's two ranks over a stand-in for the collectives (thread barriers), so rank 1 maps rank
0's segments through torch's own cache, whose reference arithmetic is a separate process's (open
+1, the pickling's reference -1, close -1)."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from torch.multiprocessing import reductions as _red

from fsdp_sync.topology import SyncError
from fsdp_sync.weights import handles, hostbuf, unpickle

pytestmark = pytest.mark.timeout(120)


class _TwoThreads:
    """The collectives `hostbuf` calls, for two threads that are group ranks 0 and 1."""

    class ReduceOp:
        MAX = "max"

    def __init__(self) -> None:
        self.local = threading.local()
        self.meet = threading.Barrier(2, timeout=60)
        self.box: dict[int, object] = {}

    def get_world_size(self, group=None) -> int:
        return 2

    def get_rank(self, group=None) -> int:
        return self.local.rank

    def get_global_rank(self, group, rank: int) -> int:
        return rank

    def _exchange(self, value):
        self.meet.wait()
        self.box[self.local.rank] = value
        self.meet.wait()
        out = [self.box[0], self.box[1]]
        self.meet.wait()
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
    returns their results, the names of every segment rank 0 made and the collectives."""
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
    results = _on_two_ranks(fake, lambda r: hostbuf.HostShared.create(object(), 3, 4096))
    for r in (0, 1):
        if isinstance(results[r], BaseException):
            raise results[r]
    return results, made, fake


def _on_two_ranks(fake: _TwoThreads, body) -> dict:
    """``body(rank)`` on two threads as group ranks 0 and 1: what each returned or raised."""
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        fake.local.rank = r
        try:
            results[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - returned: the test looks at it
            results[r] = exc
            if not isinstance(exc, SyncError):    # (raised on every rank: none waits for this one)
                fake.meet.abort()     # a peer left in a collective sees it broken, not a hang

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return results


def _in_dev_shm(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists("/dev/shm" + n)]


def test_a_rank_failing_part_way_through_mapping_leaves_no_segment(monkeypatch, caplog):
    results, made, _ = _create(monkeypatch, 2)     # rank 1 maps the first buffer, not the second
    assert results == {0: None, 1: None}                      # both ranks gather instead
    assert "group ranks [1] could not open" in caplog.text and "injected" in caplog.text
    assert len(made) >= 3
    del results
    gc.collect()
    # before: the buffers rank 1 had mapped were given back twice (their count -1), so no close
    # unlinked them: they stayed in /dev/shm until the process exited
    assert _in_dev_shm(made) == []


def test_a_rank_whose_write_fails_fails_every_ranks_fill_naming_it(monkeypatch):
    results, made, fake = _create(monkeypatch, None)
    hosts = [results[0], results[1]]

    def write(r: int) -> None:
        hosts[r].bufs[0][r] = 7
        if r == 1:
            raise MemoryError("cannot cast the shard (injected)")

    got = _on_two_ranks(fake, lambda r: hosts[r].fill(lambda: write(r)))
    # before: rank 0 waited in the barrier after the write (here: broken by rank 1's exit)
    for r in (0, 1):
        assert isinstance(got[r], SyncError), (r, got[r])
        assert "failed on group rank 1: MemoryError: cannot cast the shard (injected)" in str(got[r])
        assert set(got[r].failures) == {1}
    assert isinstance(got[1].__cause__, MemoryError)
    assert _on_two_ranks(fake, lambda r: hosts[r].fill(lambda: write(0))) == {0: None, 1: None}
    # the group still works after it, and both ranks' bytes are in the one memory
    assert hosts[0].bufs[0][:2].tolist() == hosts[1].bufs[0][:2].tolist() == [7, 7]
    del hosts, results, got
    gc.collect()
    assert _in_dev_shm(made) == []
