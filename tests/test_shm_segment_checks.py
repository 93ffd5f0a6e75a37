"""A consumer's side of a torch shared-memory segment (`weights.shm`), each check on its own: the
give-back of the last reference unlinks the segment's name, and a payload's size is checked twice
against what the segment holds past its 64-byte header, by name before it is opened
(`check_segment`) and on the opened file (`map_segment`), so that neither check hides a gap in the
other.
"""

from __future__ import annotations

import os

import pytest

from fsdp_sync.weights import handles, shm
from test_shm_refcount import _count

pytestmark = pytest.mark.timeout(60)


def test_the_consumers_give_back_of_the_last_reference_unlinks_the_segment():
    """The producer dropped its buffer while a payload (pickling's reference) was in flight: the
    consumer maps it and gives that reference back, the last one, and the name leaves /dev/shm then
    (a count left at 0 with the name kept is a segment no one ever unlinks)."""
    buf = handles.empty_shared(256)
    storage = buf.untyped_storage()
    handle = storage._share_filename_cpu_()[1]
    shm.add_torch_reference(storage, +1)            # what pickling a payload takes
    del buf, storage                                # the producer's last tensor goes
    assert _count(handle) == 1
    mapped = shm.map_segment(handle, 256)           # the consumer opens it and gives back: 0
    assert _count(handle) is None, "the segment stayed in /dev/shm after its last reference"
    assert mapped.nbytes() == 256                   # the mapping outlives the name
    del mapped


def test_a_size_reaching_into_the_header_padding_is_refused_by_the_check():
    """The segment's file is the data plus the 64-byte header: a size up to the file's (but past
    the data) would read past the mapping's end; `check_segment` compares with the data alone."""
    buf = handles.empty_shared(256)
    manager, handle, size = buf.untyped_storage()._share_filename_cpu_()
    assert os.stat(shm.segment_path(handle)).st_size == size + 64
    shm.check_segment(manager, handle, size)        # the whole data: taken
    with pytest.raises(shm.HandleError, match=rf"asks for {size + 1} bytes .* which holds {size}: a forged size"):
        shm.check_segment(manager, handle, size + 1)


def test_mapping_more_than_the_segment_holds_is_refused_as_a_handle_error():
    """`map_segment` checks the opened file again (what was checked by name may have changed):
    a size past the data is refused as the payload's error, the reference kept for the caller."""
    buf = handles.empty_shared(256)
    storage = buf.untyped_storage()
    handle, size = storage._share_filename_cpu_()[1:]
    shm.add_torch_reference(storage, +1)            # the reference a payload would hold
    try:
        with pytest.raises(shm.HandleError, match="changed after it was checked"):
            shm.map_segment(handle, size + 1)
        assert _count(handle) == 2                  # nothing given back by a refused open
    finally:
        shm.add_torch_reference(storage, -1)
