"""`SliceReader` over bytes already in memory (``data=``, what `read_hashed` read and checked)
checks the header itself: no ``safe_open`` validates it on that path.

A header entry whose data offsets reach past the data, run backwards, or hold another number of
bytes than its dtype and shape need is refused as a `CheckpointError` naming the file, the tensor,
its dtype and shape and its offsets, before any slice is read (a slice of such an entry would read
another tensor's bytes, or fail inside torch with nothing named). A well-formed buffer reads back
its values.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from fsdp_sync.weights.hf_checkpoint import CheckpointError, SliceReader


def _buffer(header: dict, data: bytes) -> torch.Tensor:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    raw = struct.pack("<Q", len(text)) + text + data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


_DATA = torch.arange(4, dtype=torch.float32).numpy().tobytes() + torch.tensor([7, 8], dtype=torch.int16).numpy().tobytes()


def test_a_well_formed_buffer_reads_back_its_tensors():
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "I16", "shape": [2], "data_offsets": [16, 20]}}
    with SliceReader("mem.safetensors", data=_buffer(header, _DATA)) as r:
        assert r.in_memory and sorted(r.keys()) == ["b", "w"]
        assert r.read("w").tolist() == [[0.0, 1.0], [2.0, 3.0]]
        assert r.read("w", (slice(1, 2),)).tolist() == [[2.0, 3.0]]
        assert r.read("b").tolist() == [7, 8] and r.read("b").dtype == torch.int16


@pytest.mark.parametrize("entry, shown", [
    ({"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}, "(F32, shape (8,)) has data offsets [0, 32)"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}, "(F32, shape (4,)) has data offsets [8, 24)"),
    ({"dtype": "F32", "shape": [0], "data_offsets": [16, 12]}, "(F32, shape (0,)) has data offsets [16, 12)"),
    # inside the data, but not the bytes its dtype and shape need
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "(F32, shape (4,)) has data offsets [0, 8)"),
    ({"dtype": "I16", "shape": [2, 2], "data_offsets": [16, 20]}, "(I16, shape (2, 2)) has data offsets [16, 20)"),
])
def test_an_entry_that_does_not_describe_its_bytes_is_refused_naming_it(entry, shown):
    header = {"b": {"dtype": "I16", "shape": [2], "data_offsets": [16, 20]}, "w": entry}
    with pytest.raises(CheckpointError) as info:
        with SliceReader("mem.safetensors", data=_buffer(header, _DATA)):
            pass
    assert str(info.value) == (f"mem.safetensors: tensor 'w' {shown} that do not fit the file's "
                               f"20 data bytes")
