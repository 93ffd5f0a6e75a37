"""A segment's reference count stays exact while this library and torch change it at once.

torch changes the count in a segment's header with atomic instructions and no lock (a storage's
creation, the mapping its rebuild makes, a storage's last close); `shm.add_reference` (what
`map_segment` does as a consumer opens a payload) changed it with a read and a write. A relay
rank's mapping of a host-shared buffer (`hostbuf`) closing while an engine worker opened another
rank's payload of that buffer lost the close's decrement: the segment was never unlinked, one
``torch_<pid>_*`` left in /dev/shm until the trainer exited (`fsdp-sync soak`, tensor method:
one at a random sync, 55 to 476, of runs of 133 to 1300 syncs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fsdp_sync.weights import handles, shm

pytestmark = pytest.mark.timeout(60)


def _count(handle: bytes) -> int | None:
    """The count in the segment's header; None once unlinked."""
    try:
        with open(shm.segment_path(handle), "rb") as f:
            return int.from_bytes(f.read(4), sys.byteorder, signed=True)
    except FileNotFoundError:
        return None


def test_add_reference_loses_no_change_torch_makes_at_the_same_time():
    buf = handles.empty_shared(64)
    storage = buf.untyped_storage()
    handle = storage._share_filename_cpu_()[1]
    before = _count(handle)
    # another process gives references and takes them back with add_reference, as consumers
    # opening payloads (and take_back) do, while this one changes the count through torch
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from fsdp_sync.weights import shm
        h = {handle!r}
        print("ready", flush=True)
        for _ in range(3000):
            shm.add_reference(h, +1)
            shm.add_reference(h, -1)
        """)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))})
    try:
        assert child.stdout.readline().strip() == "ready"
        while child.poll() is None:
            for _ in range(200):
                storage._shared_incref()      # torch's own atomic add, without the file lock
                storage._shared_decref()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # a lost decrement leaves the count high (the segment is never unlinked); a lost increment
    # brings it to zero early (unlinked while the buffer is still in use: None here)
    assert _count(handle) == before, "a change to the segment's reference count was lost"
    del buf, storage
    assert not os.path.exists(shm.segment_path(handle)), "the segment outlived its last reference"
