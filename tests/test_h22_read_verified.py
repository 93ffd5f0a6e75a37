"""`hf_checkpoint.read_verified`: a safetensors file read once, its header checked before any tensor
is handed out. A header whose tensors overlap, or whose span does not hold its shape, is refused
naming the file (one tensor's bytes would be another's, or a view would read past its own);
a well-formed file reads back bit for bit with its byte count. In process, small files."""

from __future__ import annotations

import json
import os
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


def test_a_file_written_in_place_over_a_longer_one_is_exactly_the_new_file(tmp_path):
    """``write_safetensors(in_place=True)`` (keep-N reusing a dropped version's file of the same
    name, `transport.disk_writer`): an old file longer than the new one (another bucket plan: a
    changed dtype, quantization or bucket size) is cut to the new length, so the file is the bytes
    the digest was made of, not those plus the old file's tail."""
    from fsdp_sync.weights import bucket as _bucket
    from fsdp_sync.weights.hf_checkpoint import digest_file, write_safetensors

    path = str(tmp_path / "model-00001-of-00001.safetensors")
    with open(path, "wb") as f:
        f.write(b"\xab" * 4096)
    t = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    bkt = _bucket.plan_buckets([_bucket.TensorMeta.of(n, x) for n, x in t.items()], 1 << 20)[0]
    digest, size, _ = write_safetensors(path, _bucket.flatten(bkt, t), bkt.entries, hash="sha256",
                                        in_place=True)
    assert os.path.getsize(path) == size < 4096
    assert digest_file(path, "sha256") == (digest, size)
    got, _ = read_verified(path, digest)
    assert torch.equal(got["w"], t["w"])
