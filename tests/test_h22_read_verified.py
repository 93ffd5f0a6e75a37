"""`hf_checkpoint.read_verified`: a safetensors file read once, its header checked before any tensor
is handed out. A header whose tensors overlap, or whose span does not hold its shape, is refused
naming the file (one tensor's bytes would be another's, or a view would read past its own);
a well-formed file reads back bit for bit with its byte count. In process, small files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.weights.hf_checkpoint import CheckpointError, read_verified, sha256_file


def _file(path, header: dict, data: bytes) -> str:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def test_a_well_formed_file_reads_back_bit_for_bit(tmp_path):
    want = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.tensor([1.5, -2.25], dtype=torch.bfloat16)}
    path = str(tmp_path / "ok.safetensors")
    save_file(want, path)
    digest, size = sha256_file(path)
    got, n = read_verified(path, digest)
    assert n == size and set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("header,words", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlap"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "'a'"),
    ({"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 16]}}, "'a'"),
])
def test_a_header_that_does_not_describe_its_bytes_is_refused(tmp_path, header, words):
    path = _file(tmp_path / "bad.safetensors", header, bytes(16))
    with pytest.raises(CheckpointError, match="not a well-formed safetensors file") as e:
        read_verified(path, None)
    assert words in str(e.value) and "bad.safetensors" in str(e.value)
