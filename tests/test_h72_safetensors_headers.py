"""The engines' safetensors readers take exactly the headers the safetensors library takes (SGLang
loads through ``safe_open``), and read what `hf_checkpoint.write_safetensors` writes as it does.

Before, `VerifiedFile` (per-rank files), `read_verified` and `SliceReader` over bytes already read
(the reference engine's HF files: no ``safe_open`` on that path) accepted headers that safetensors
refuses: a float offset or dimension (``2.5`` read as 2; float offsets failed only later, inside a
read, with a TypeError), a gap between tensors, trailing data bytes, a non-string metadata value.
The reference engine would load a file SGLang refuses. Now `safetensors_read.header_entries`
applies safetensors' rules in every reader.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

_DATA = torch.arange(6, dtype=torch.float32).numpy().tobytes()
_BAD = {
    "float offsets": {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0.0, 24.0]}},
    "float dimension": {"a": {"dtype": "F32", "shape": [2.5, 3], "data_offsets": [0, 24]}},
    "gap": {"a": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}},
    "trailing bytes": {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
    "metadata value": {"__metadata__": {"format": 1},
                       "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}},
}


def _file(tmp_path, header, data=_DATA):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def _read_all(path):
    """Every reader's tensors of ``path`` (each raises for a refused file)."""
    from fsdp_sync.weights.hf_checkpoint import SliceReader, read_hashed, read_verified
    from fsdp_sync.weights.verified_file import VerifiedFile

    out = {}
    with VerifiedFile(path, None) as vf:
        out["VerifiedFile"] = {n: t.load() for n, t in vf.tensors.items()}
    out["read_verified"] = {n: t.clone() for n, t in read_verified(path, None)[0].items()}
    with SliceReader(path, data=read_hashed(path, None)) as r:
        out["SliceReader(data=)"] = {n: r.read(n) for n in r.keys()}
    with SliceReader(path) as r:
        out["SliceReader"] = {n: r.read(n) for n in r.keys()}
    return out


@pytest.mark.parametrize("case", sorted(_BAD))
def test_a_header_safetensors_refuses_is_refused_by_every_reader(tmp_path, case):
    from safetensors import safe_open

    from fsdp_sync.weights.hf_checkpoint import CheckpointError, SliceReader, read_hashed, read_verified
    from fsdp_sync.weights.verified_file import VerifiedFile

    path = _file(tmp_path, _BAD[case])
    with pytest.raises(Exception):
        with safe_open(path, framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(CheckpointError, match="not a well-formed safetensors file"):
        VerifiedFile(path, None).close()
    with pytest.raises(CheckpointError, match="not a well-formed safetensors file"):
        read_verified(path, None)
    with pytest.raises(CheckpointError, match="not a well-formed safetensors file"):
        with SliceReader(path, data=read_hashed(path, None)):
            pass
    with pytest.raises(CheckpointError, match="not a well-formed safetensors file"):
        with SliceReader(path):
            pass


def test_what_write_safetensors_writes_every_reader_reads_as_safetensors_does(tmp_path):
    from safetensors.torch import load_file

    from fsdp_sync.weights import bucket as _bucket
    from fsdp_sync.weights import hf_checkpoint as ckpt

    g = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(3, 5, generator=g).bfloat16(), "b.f32": torch.randn(7, generator=g),
               "c.scalar": torch.tensor(2.5, dtype=torch.float16), "d.empty": torch.empty(0, 4),
               "e.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
               "f.i64": torch.arange(3), "g.bool": torch.tensor([True, False]),
               "h.e5m2": torch.randn(3, generator=g).to(torch.float8_e5m2)}
    bkt = _bucket.plan_buckets([_bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)[0]
    path = str(tmp_path / "w.safetensors")
    ckpt.write_safetensors(path, _bucket.flatten(bkt, tensors), bkt.entries)
    want = load_file(path)

    def raw(t):
        return t.reshape(-1).view(torch.uint8)

    assert sorted(want) == sorted(tensors)
    assert all(want[n].dtype == t.dtype and want[n].shape == t.shape and torch.equal(raw(want[n]), raw(t))
               for n, t in tensors.items())
    for reader, got in _read_all(path).items():
        assert sorted(got) == sorted(want), reader
        for n, t in want.items():
            assert got[n].dtype == t.dtype and got[n].shape == t.shape, (reader, n)
            assert torch.equal(raw(got[n]), raw(t)), (reader, n)
