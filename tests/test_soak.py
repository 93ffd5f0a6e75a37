"""`fsdp-sync soak`'s report (`soak.summarise`, `soak._meets`), on synthetic samples: a process
that leaks grows over the second half as before; one that settled does not; the target check
uses the growth from the warm-up sample on; fds, threads and segments must not grow at all.
(The soak itself is a command, measured in README "Soak", not a test.)"""

from __future__ import annotations

from fsdp_sync.cli.soak import _meets, summarise

MiB = 2**20


def _series(rss_of_sync, *, fds=lambda s: 10, shm=lambda s: 0):
    return [{"sync": s, "p": {"rss": int(rss_of_sync(s)), "fds": fds(s), "threads": 4}, "shm": shm(s)}
            for s in range(1, 1001, 5)] + [
            {"sync": 1000, "p": {"rss": int(rss_of_sync(1000)), "fds": fds(1000), "threads": 4},
             "shm": shm(1000)}]


def test_summary_tells_a_leak_from_settling():
    leak = _series(lambda s: 200 * MiB + s * 2048)                       # 2 KiB per sync, for ever
    settles = _series(lambda s: 200 * MiB + min(s, 200) * 16384)         # +3.1 MiB, then flat
    flat = _series(lambda s: 200 * MiB + (4096 if s % 2 else 0))
    rows = {r["method"]: r for r in summarise({"leak": leak, "settles": settles, "flat": flat}, ["p"], 100)
            if r["process"] == "p"}
    assert abs(rows["leak"]["rss_growth_mib_per_1000"] - 1.953) < 0.01
    assert abs(rows["leak"]["rss_growth_mib_second_half_per_1000"] - 1.953) < 0.01
    assert not _meets(rows["leak"])
    assert rows["settles"]["rss_growth_mib"] > 1.5 and rows["settles"]["rss_growth_mib_second_half_per_1000"] == 0
    assert not _meets(rows["settles"])        # the target counts from the warm-up, not from the settling
    assert _meets(rows["flat"]) and rows["flat"]["second_half_from_sync"] == 551   # halfway from 101


def test_fds_and_segments_must_not_grow():
    fds = summarise({"m": _series(lambda s: 200 * MiB, fds=lambda s: 10 + s // 500)}, ["p"], 100)
    shm = summarise({"m": _series(lambda s: 200 * MiB, shm=lambda s: s // 900)}, ["p"], 100)
    assert not _meets(fds[0]) and fds[0]["fds_growth"] == 2
    assert not _meets(shm[1]) and shm[1]["shm_growth"] == 1
