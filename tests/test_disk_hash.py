"""The disk method's manifest digest (``SyncConfig.disk_hash``, issue 27): each file is hashed while
it is written (`hf_checkpoint.write_safetensors`) and while the engine reads it, under the hash the
manifest names (XXH3-128 by default, sha256 on request, sha256 for a manifest that names none);
a flipped byte is refused naming the file and the tensors in it; an unknown hash is refused naming
the field. One process, reference engines at TP 2 (both the Hugging Face and the per-rank layout).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fsdp_sync.config import DISK_HASHES, SyncConfig
from fsdp_sync.weights import bucket as _bucket
from fsdp_sync.weights import hf_checkpoint as ckpt


def _sync(module, engine, directory, *, layout, disk_hash, step=0):
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    sc = SyncConfig(disk_dir=directory, bucket_bytes=48 << 10, layout=layout, disk_hash=disk_hash)
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=[engine], step=step,
                      stats=SyncStats())
    DiskTransport(sc).sync(ctx)
    return ctx.stats.extra["path"]


def _manifest(path):
    with open(os.path.join(path, ckpt.MANIFEST_FILE)) as f:
        return json.load(f)


def _flip_last_data_byte(path):
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_unknown_disk_hash_is_refused_naming_the_field():
    assert SyncConfig().disk_hash == "xxh3_128" and DISK_HASHES == ("xxh3_128", "sha256")
    assert SyncConfig(disk_hash="sha256").disk_hash == "sha256"
    with pytest.raises(ValueError, match=r"disk_hash must be one of \['xxh3_128', 'sha256'\].*got 'bogus'"):
        SyncConfig(disk_hash="bogus")
    with pytest.raises(ValueError, match="disk_hash"):
        SyncConfig.from_dict({"disk_hash": "md5"})


def test_write_safetensors_is_what_safetensors_reads_and_hashes_as_written(tmp_path):
    """Mixed dtypes with alignment padding between them, in the bucket's order: safetensors reads
    the file back bit for bit, and the digest is the file's under either hash."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(3, generator=g).bfloat16(), "b.i64": torch.arange(5),
               "c.f32": torch.randn(7, 3, generator=g), "d.bool": torch.tensor([True, False, True]),
               "e.f16": torch.randn(2, 5, generator=g).half(), "f.empty": torch.empty(0, 4)}
    bkt = _bucket.plan_buckets([_bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)[0]
    flat = _bucket.flatten(bkt, tensors)
    for algo in DISK_HASHES:
        path = str(tmp_path / f"{algo}.safetensors")
        digest, size, names = ckpt.write_safetensors(path, flat, bkt.entries, hash=algo,
                                                     rename=lambda n: "x." + n)
        assert sorted(names) == sorted("x." + n for n in tensors) and size == os.path.getsize(path)
        assert digest == ckpt.digest_file(path, algo)[0]
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for n, t in tensors.items():
                assert torch.equal(f.get_tensor("x." + n), t), n
        got, n_read = ckpt.read_verified(path, digest, algo)
        assert n_read == size and all(torch.equal(got["x." + n], t) for n, t in tensors.items())
    other = ckpt.digest_file(str(tmp_path / "sha256.safetensors"), "xxh3_128")[0]
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch .* the manifest says sha256"):
        ckpt.read_verified(str(tmp_path / "sha256.safetensors"), other, "sha256")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["full", "engine"])
def test_each_hash_is_written_named_and_verified_on_read(tmp_path, layout):
    """(a) the manifest holds the configured hash and every file's digest under it, and the engine
    verifies with that hash; a manifest without "hash" is read as sha256 (older versions);
    (b) a flipped byte under the fast hash is refused naming the file and its tensors, and the
    old weights keep serving."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import WeightUpdateError, checksum_named_tensors
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=3)
    want = checksum_named_tensors(module.state_dict().items())
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        paths = {}
        for step, algo in enumerate(DISK_HASHES):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.5)
            want = checksum_named_tensors(module.state_dict().items())
            path = _sync(module, engine, str(tmp_path / "v"), layout=layout, disk_hash=algo, step=step)
            assert engine.weights_checksum() == want, algo
            doc = _manifest(path)
            assert doc["hash"] == algo
            for f, entry in doc["files"].items():
                assert set(entry) & set(DISK_HASHES) == {algo}, (f, entry)
                assert entry[algo] == ckpt.digest_file(os.path.join(path, f), algo)[0], f
            paths[algo] = path
        served = engine.weights_checksum()

        # the reader takes the manifest's word for the hash: an xxh3 digest under "sha256" fails
        lie = str(tmp_path / "lie")
        shutil.copytree(paths["xxh3_128"], lie)
        doc = _manifest(lie)
        doc["hash"] = "sha256"
        for entry in doc["files"].values():
            entry["sha256"] = entry.pop("xxh3_128")
        with open(os.path.join(lie, ckpt.MANIFEST_FILE), "w") as f:
            json.dump(doc, f)
        with pytest.raises(WeightUpdateError, match="checksum mismatch .* the manifest says sha256"):
            engine.update_weights_from_disk(lie)
        assert engine.weights_checksum() == served

        # a manifest with no "hash" (written before the choice) is sha256: it loads
        legacy = str(tmp_path / "legacy")
        shutil.copytree(paths["sha256"], legacy)
        doc = _manifest(legacy)
        del doc["hash"]
        with open(os.path.join(legacy, ckpt.MANIFEST_FILE), "w") as f:
            json.dump(doc, f)
        engine.update_weights_from_disk(legacy)
        assert engine.weights_checksum() == served
        doc["hash"] = "md5"
        with open(os.path.join(legacy, ckpt.MANIFEST_FILE), "w") as f:
            json.dump(doc, f)
        with pytest.raises(WeightUpdateError, match=r"says hash 'md5', expected one of \['xxh3_128', 'sha256'\]"):
            engine.update_weights_from_disk(legacy)

        # one flipped bit under the fast hash: refused, naming the file and what it holds
        bad = str(tmp_path / "bad")
        shutil.copytree(paths["xxh3_128"], bad)
        doc = _manifest(bad)
        victim = sorted(f for f in doc["files"] if f.endswith(".safetensors"))[-1]
        _flip_last_data_byte(os.path.join(bad, victim))
        if layout == "engine":
            held = doc["files"][victim]["names"]
        else:
            with open(os.path.join(bad, ckpt.INDEX_FILE)) as f:
                held = [n for n, fl in json.load(f)["weight_map"].items() if fl == victim]
        with pytest.raises(WeightUpdateError) as info:
            engine.update_weights_from_disk(bad)
        msg = str(info.value)
        assert f"checksum mismatch for {os.path.join(bad, victim)}" in msg and "xxh3_128" in msg, msg
        assert repr(held[0]) in msg, msg
        assert engine.weights_checksum() == served         # nothing was applied


def test_slice_reader_over_the_hashed_bytes_matches_the_file(tmp_path):
    """A worker's own files are read once (`read_hashed`) and sliced from those bytes: the same
    slices as from the file, and a flipped byte is refused before any slice is taken."""
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(6, 8, generator=g), "b": torch.randn(8, generator=g).bfloat16()}
    bkt = _bucket.plan_buckets([_bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)[0]
    path = str(tmp_path / "f.safetensors")
    digest, _, _ = ckpt.write_safetensors(path, _bucket.flatten(bkt, tensors), bkt.entries)
    data = ckpt.read_hashed(path, digest, "xxh3_128")
    with ckpt.SliceReader(path) as f, ckpt.SliceReader(path, data=data) as m:
        assert m.in_memory and not f.in_memory and sorted(m.keys()) == sorted(f.keys())
        for index in [(), (slice(2, 4),), (slice(None), slice(1, 5))]:
            assert torch.equal(m.read("w", index), f.read("w", index))
        assert torch.equal(m.read("b"), tensors["b"])
    _flip_last_data_byte(path)
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch .* xxh3_128"):
        ckpt.read_hashed(path, digest, "xxh3_128")
