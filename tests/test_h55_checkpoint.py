"""H55 audit (mutation pass): the checkpoint helpers' refusals and the trainer-side float32 and
tied-head rules, in process (no engine, no ranks; a few milliseconds each).

- `write_safetensors` refuses two tensors under one name in a file (after ``rename``), naming it,
  before the file is opened (dropping the check survived: a reader keeps one of the two).
- `verify_file` refuses a file whose digest is not the manifest's (nothing called it in a test).
- `read_hashed` without a digest to check refuses a read that came up short instead of returning
  the buffer's uninitialised tail as tensor bytes (dropping the check survived).
- `resolve_ranked` refuses a manifest that gives engine rank r another rank's file (r loaded that
  shard without a word where the split is even: SGLang's loader takes rank r's files by name), and
  one whose tensor names are not strings (a TypeError from sorting them before, which
  ``update_weights_from_disk`` did not take as a refused checkpoint).
- `resolve` refuses a load format it does not read and a directory without safetensors files;
  `resolve_ranked` a version cut for another TP size; `write_safetensors` a span past the bucket
  (each check survived its removal in the tests before).
- `float32_params.out_dtype`: only a float32 tensor under one of the names is kept; the same name
  in another dtype is cast, and a name merely ending in the same letters is not one of them.
- `tied.head_refusal` compares bits: an equal head holding a NaN is taken, a head whose only
  difference is -0.0 against 0.0 is refused (``torch.equal`` on values says the opposite of both).
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from fsdp_sync.weights import float32_params, tied
from fsdp_sync.weights import hf_checkpoint as ckpt

pytestmark = pytest.mark.timeout(60)


def _entries(*specs):
    """Bucket entries (name, dtype, shape, start, end) laid end to end, and their flat buffer."""
    out, off = [], 0
    for name, dtype, shape in specs:
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(types.SimpleNamespace(name=name, dtype=dtype, shape=tuple(shape), start=off, end=off + n))
        off += n
    return out, torch.arange(off, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("rename", [str, lambda n: "x.weight"])
def test_write_safetensors_refuses_two_tensors_under_one_name(tmp_path, rename):
    entries, flat = _entries(("x.weight", torch.float32, (2, 3)), ("y.weight", torch.float32, (2, 3)))
    if rename is str:
        entries[1].name = "x.weight"
    path = str(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'x.weight' .*a repeated name"):
        ckpt.write_safetensors(path, flat, entries, rename=rename)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="a repeated name"):
        ckpt.safetensors_file_bytes(entries, rename=rename)


def test_verify_file_refuses_a_file_that_is_not_the_manifests(tmp_path):
    entries, flat = _entries(("a", torch.bfloat16, (4, 4)))
    path = str(tmp_path / "model.safetensors")
    for algo in ckpt.HASHES:
        digest, size, _ = ckpt.write_safetensors(path, flat, entries, hash=algo)
        ckpt.verify_file(str(tmp_path), "model.safetensors", digest, algo)
    with open(path, "r+b") as f:
        f.seek(size - 1)
        f.write(bytes([flat[-1].item() ^ 1]))
    with pytest.raises(ckpt.CheckpointError, match=rf"checksum mismatch for {path} \({size} bytes\)"):
        ckpt.verify_file(str(tmp_path), "model.safetensors", digest, ckpt.HASHES[-1])
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        ckpt.verify_file(str(tmp_path), "gone.safetensors", digest, "sha256")


def test_read_hashed_refuses_a_short_read_without_a_digest_to_check(tmp_path, monkeypatch):
    path = tmp_path / "f.safetensors"
    path.write_bytes(bytes(range(100)))
    assert torch.equal(ckpt.read_hashed(str(path), None), torch.arange(100, dtype=torch.uint8))
    real = os.fstat

    def longer(fd):             # the file shrank after its size was taken
        st = real(fd)
        return types.SimpleNamespace(st_size=st.st_size + 64)

    monkeypatch.setattr(ckpt.os, "fstat", longer)
    with pytest.raises(ckpt.CheckpointError, match=r"shrank while being read \(100 of 164 bytes\)"):
        ckpt.read_hashed(str(path), None)


_NAMES = ["model.embed_tokens.weight", "model.norm.weight"]


def _ranked(tmp_path, ranks, names=_NAMES, sub="v") -> str:
    d = tmp_path / sub
    d.mkdir()
    listed = {}
    for fs in ranks:
        for f in fs:
            listed[f] = {"sha256": "00" * 32, "bytes": 8, "names": list(names)}
            (d / f).write_bytes(b"\0" * 8)
    doc = {"format": ckpt.MANIFEST_FORMAT, "hash": "sha256", "layout": "engine", "tp_size": len(ranks),
           "model": {"model_type": "qwen2"}, "dtype": "BF16", "ranks": ranks, "files": listed}
    (d / ckpt.MANIFEST_FILE).write_text(json.dumps(doc))
    return str(d)


@pytest.mark.parametrize("ranks, rank, file", [
    ([["model-rank-1-part-0.safetensors"], ["model-rank-1-part-0.safetensors"]], 0, "model-rank-1-part-0.safetensors"),
    ([["model-rank-1-part-0.safetensors"], ["model-rank-0-part-0.safetensors"]], 0, "model-rank-1-part-0.safetensors"),
    ([["model-rank-0-part-0.safetensors"], ["shard-b.safetensors"]], 1, "shard-b.safetensors"),
])
def test_a_rank_given_another_ranks_file_is_refused(tmp_path, ranks, rank, file):
    d = _ranked(tmp_path, ranks)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.resolve_ranked(d, 2)
    assert (f"lists {file!r} for engine rank {rank}: rank {rank}'s files are named "
            f"'model-rank-{rank}-part-0.safetensors'") in str(info.value)
    assert "nothing was loaded" in str(info.value)
    ok = ckpt.resolve_ranked(_ranked(tmp_path, [
        ["model-rank-0-part-0.safetensors", "model-rank-0-part-1.safetensors"],
        ["model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors"]], sub="ok"), 2)
    assert ok.files[1] == ["model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors"]


def test_tensor_names_that_are_not_strings_are_refused(tmp_path):
    d = _ranked(tmp_path, [["model-rank-0-part-0.safetensors"]], names=["model.norm.weight", 7])
    with pytest.raises(ckpt.CheckpointError, match=r"rank 0's file 'model-rank-0-part-0.safetensors' is "
                                                   r"not listed with a sha256 digest and its tensor names"):
        ckpt.resolve_ranked(d, 1)


def test_only_float32_tensors_under_the_names_stay_float32():
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    for name in ("model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.0.linear_attn.A_log",
                 "model.layers.1.mlp.expert_bias", "model.layers.2.mlp.router_bias"):
        assert float32_params.out_dtype(name, f32, bf16) == f32, name
        assert float32_params.out_dtype(name, f16, bf16) == bf16, name      # held in another dtype: cast
        assert float32_params.out_dtype(name, f32, None) == f32, name
    for name in ("model.layers.0.mlp.my_router_bias", "model.layers.0.A_log.weight", "expert_bias_scale"):
        assert float32_params.out_dtype(name, f32, bf16) == bf16, name


def _whole(name, t):
    return types.SimpleNamespace(name=name, shape=tuple(t.shape), src_dtype=t.dtype, full=t,
                                 dtensor=None, pieces=None)


def test_the_tied_head_check_compares_bits_not_values():
    emb = torch.arange(24, dtype=torch.float32).view(6, 4) - 3.0
    emb[2, 1] = float("nan")
    head = emb.clone()                   # the same bits, a NaN among them: taken
    assert tied.head_refusal([_whole(tied.EMBED, emb), _whole(tied.HEAD, head)], tied=True) is None
    emb[3, 3], head[3, 3] = 0.0, -0.0     # equal values, other bits: the engine would refuse it
    why = tied.head_refusal([_whole(tied.EMBED, emb), _whole(tied.HEAD, head)], tied=True)
    assert why is not None and "first difference at [3, 3]: -0 against 0" in why, why


def test_write_safetensors_refuses_a_tensor_outside_the_bucket(tmp_path):
    """A span past the flattened bucket's end would be cut short by the memoryview (a file whose
    header promises bytes it does not hold): refused naming the tensor, nothing written."""
    entries, flat = _entries(("a", torch.float32, (2, 2)), ("b", torch.float32, (2, 2)))
    path = str(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'b' .*bytes \[16, 32\) of 24\) cannot be written"):
        ckpt.write_safetensors(path, flat[:24], entries)
    assert not os.path.exists(path)


def test_resolve_refuses_a_load_format_it_does_not_read(tmp_path):
    entries, flat = _entries(("a", torch.float32, (2, 2)))
    ckpt.write_safetensors(str(tmp_path / "model.safetensors"), flat, entries)
    assert ckpt.resolve(str(tmp_path), "safetensors").files == ["model.safetensors"]
    for fmt in ("pt", "sharded_state", "dummy"):
        with pytest.raises(ckpt.CheckpointError, match=rf"load_format {fmt!r} is not supported for a disk update"):
            ckpt.resolve(str(tmp_path), fmt)


@pytest.mark.parametrize("engine_tp", [1, 4])
def test_a_per_rank_version_for_another_tp_size_is_refused(tmp_path, engine_tp):
    d = _ranked(tmp_path, [["model-rank-0-part-0.safetensors"], ["model-rank-1-part-0.safetensors"]])
    with pytest.raises(ckpt.CheckpointError, match=rf"holds shards for 2 engine TP ranks, this engine has "
                                                   rf"{engine_tp}: write it with the engine's TP size"):
        ckpt.resolve_ranked(d, engine_tp)


def test_resolve_refuses_a_directory_without_safetensors_files(tmp_path):
    """Loading nothing would be an update that changed no weight yet took its version."""
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ckpt.CheckpointError, match=r"no \*\.safetensors files in .*\*\.bin / \*\.pt "
                                                   r"checkpoints are not supported"):
        ckpt.resolve(str(tmp_path))
