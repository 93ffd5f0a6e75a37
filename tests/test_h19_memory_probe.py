"""`memory.probe`'s USS (audit H19's mutation pass of memory.py): what the bench and the
timeline report as a process's own memory."""

from __future__ import annotations


def test_a_probes_uss_counts_private_clean_pages(tmp_path):
    """`memory.probe`'s USS is every page only this process maps: private dirty and private
    clean (a file it alone maps and has read), as psutil counts it. Killed: USS read as
    Private_Dirty alone (8 MiB of a file mapped and read here went uncounted)."""
    import mmap

    import psutil

    from fsdp_sync.memory import probe

    import os

    path = tmp_path / "pages"
    with open(path, "wb") as f:      # written back: its pages are clean once mapped and read
        f.write(b"\1" * (8 << 20))
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == (8 << 20) // 4096    # every page read
        for _ in range(3):      # memory may move between the two reads: the closest of three
            ours, theirs = probe()["uss"], psutil.Process().memory_full_info().uss
            if abs(ours - theirs) < 1 << 20:
                break
    assert abs(ours - theirs) < 1 << 20, (ours, theirs)
