"""`hf_checkpoint.resolve_ranked`: a per-rank version is checked before anything loads.

A per-rank version (``layout="engine"``) is a directory of ``model-rank-R-part-K.safetensors``
files and a manifest naming, per engine TP rank, its files with their digests and tensor names.
Before an engine reads a byte, the manifest must match the engine's split (TP and EP size), every
file it names must be a regular file of the directory (no path leading out of it, no symlink to
a file elsewhere), and every rank must list the same tensors. Each refusal names the file, rank
or value. The manifests are written by hand here: only the manifest is read by this check.
"""

from __future__ import annotations

import json
import os

import pytest

from fsdp_sync.weights.hf_checkpoint import MANIFEST_FILE, CheckpointError, resolve_ranked

_NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"]


def _version(tmp_path, *, tp=2, ep=None, files=None, names=None, make=True) -> str:
    """A per-rank version directory with one file per rank (each a few bytes) and its manifest."""
    d = tmp_path / "v"
    d.mkdir()
    ranks = files or [[f"model-rank-{r}-part-0.safetensors"] for r in range(tp)]
    listed = {}
    for r, fs in enumerate(ranks):
        for f in fs:
            listed[f] = {"sha256": "00" * 32, "bytes": 8,
                         "names": list((names or {}).get(r, _NAMES))}
            if make and os.path.basename(f) == f:
                (d / f).write_bytes(b"\0" * 8)
    doc = {"format": "fsdp_sync.disk/1", "step": 3, "hash": "sha256", "layout": "engine",
           "tp_size": tp, "model": {"model_type": "qwen2"}, "dtype": "BF16", "ranks": ranks,
           "files": listed}
    if ep is not None:
        doc["ep_size"] = ep
    (d / MANIFEST_FILE).write_text(json.dumps(doc))
    return str(d)


def test_a_matching_version_resolves_to_each_ranks_files(tmp_path):
    plan = resolve_ranked(_version(tmp_path, ep=1), 2)
    assert plan.tp_size == 2 and plan.hash == "sha256" and plan.dtype == "BF16"
    assert plan.files == [["model-rank-0-part-0.safetensors"], ["model-rank-1-part-0.safetensors"]]
    assert plan.names["model-rank-1-part-0.safetensors"] == _NAMES


@pytest.mark.parametrize("written, engine", [(2, 1), (1, 2), (None, 2)])
def test_a_version_cut_for_another_expert_parallel_size_is_refused(tmp_path, written, engine):
    d = _version(tmp_path, ep=written)
    with pytest.raises(CheckpointError) as info:
        resolve_ranked(d, 2, ep_size=engine)
    assert (f"holds shards for expert-parallel size {written or 1}, this engine runs ep_size "
            f"{engine}") in str(info.value)


@pytest.mark.parametrize("name", ["../model-rank-1-part-0.safetensors", "sub/model-rank-1-part-0.safetensors",
                                  "/etc/model-rank-1-part-0.safetensors", "model-rank-1-part-0.bin"])
def test_a_file_named_outside_the_directory_is_refused_naming_it(tmp_path, name):
    d = _version(tmp_path, files=[["model-rank-0-part-0.safetensors"], [name]])
    if name.startswith("../"):      # it exists: the check is the name, not the file's absence
        (tmp_path / "model-rank-1-part-0.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError) as info:
        resolve_ranked(d, 2)
    assert f"names paths outside {d}: {name!r}; nothing was loaded" in str(info.value)


def test_a_symlinked_rank_file_is_refused(tmp_path):
    d = _version(tmp_path, make=True)
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"\0" * 8)
    victim = os.path.join(d, "model-rank-1-part-0.safetensors")
    os.remove(victim)
    os.symlink(elsewhere, victim)
    with pytest.raises(CheckpointError) as info:
        resolve_ranked(d, 2)
    assert (f"missing shard model-rank-1-part-0.safetensors of engine rank 1 in {d} (or not a "
            f"regular file)") in str(info.value)


def test_ranks_listing_other_tensors_are_refused_naming_the_rank_and_a_tensor(tmp_path):
    d = _version(tmp_path, names={1: _NAMES[:1] + ["model.layers.0.mlp.up_proj.weight"]})
    with pytest.raises(CheckpointError) as info:
        resolve_ranked(d, 2)
    assert ("engine rank 1 lists other tensors than rank 0 (e.g. ['model.layers.0.mlp.down_proj.weight', "
            "'model.layers.0.mlp.up_proj.weight']); nothing was loaded") in str(info.value)
