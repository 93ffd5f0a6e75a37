"""Hostile and bad input: each kind is refused with an error naming what was wrong, and the engine
keeps serving its previous weights bit-exact (its ``weights_checksum`` is unchanged). NaN, Inf and
-0.0 weights are data: they arrive bit-exact through every path.

One ReferenceEngine (tiny, TP 1) serves every case. A case is a function that makes the bad input
and hands it to the engine (or to a constructor); the table says what the error must name. The
docs/reliability.md "Bad input" lists the same kinds.
"""

from __future__ import annotations

import json
import os
import pickle
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions as red

from fsdp_sync.weights import handles
from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets, sglang_metadata
from fsdp_sync.config import SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import SerializedPerRank, WeightUpdateError
from fsdp_sync.weights.hf_checkpoint import INDEX_FILE, MANIFEST_FILE, sha256_file

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine(model_config="tiny", tp_size=1, kv_cache_tokens=64) as e:
        yield e


@pytest.fixture(scope="module")
def current(engine):
    return dict(engine.named_full_tensors())


def _target(current) -> str:
    """A 2-D layer weight (not the tied embedding): the tensor the cases try to overwrite."""
    return next(n for n, t in current.items() if t.dim() == 2 and ".layers." in n)


# --------------------------------------------------------------------------- payload makers

def _bucket_obj(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    metas = [TensorMeta.of(n, t) for n, t in named]
    (b,) = plan_buckets(metas, sum(m.nbytes for m in metas) + 64 * (len(metas) + 1))
    flat = handles.empty_shared(b.nbytes)
    flatten(b, [t for _, t in named], out=flat)
    return flat, sglang_metadata(b)


def _send_bucket(engine, flat, meta, **make) -> None:
    """A genuine payload (made by make_payloads) of a bucket with the given, maybe forged, metadata."""
    with handles.make_payloads({"flattened_tensor": flat, "metadata": meta}, **make) as ps:
        try:
            engine.update_weights_from_tensor(ps.payloads, load_format="flattened_bucket")
        finally:
            ps.release(require_ack=False)


def _forged_meta(engine, current, edit) -> None:
    """A bucket of the engine's own current weights whose metadata ``edit`` forges."""
    name = _target(current)
    other = next(n for n, t in current.items() if n != name and ".layers." in n)
    flat, meta = _bucket_obj([(name, current[name]), (other, current[other])])
    edit(meta)
    _send_bucket(engine, flat, meta, num_consumers=1)


def _shift(entry, by: int) -> None:
    entry.start_idx += by
    entry.end_idx += by


class _Storage:      # pickles as torch's rebuild_storage_filename(UntypedStorage, manager, handle, size)
    def __init__(self, manager: bytes, handle: bytes, size: int):
        self.args = (torch.UntypedStorage, manager, handle, size)

    def __reduce__(self):
        return (red.rebuild_storage_filename, self.args)


class _Typed:
    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce__(self):
        return (red.rebuild_typed_storage, (self.storage, torch.uint8))


class _Tensor:       # pickles as torch's rebuild_tensor(Tensor, storage, (offset, size, stride, grad))
    def __init__(self, storage: _Storage, n: int, offset: int = 0):
        self.storage, self.n, self.offset = storage, n, offset

    def __reduce__(self):
        return (red.rebuild_tensor, (torch.Tensor, _Typed(self.storage), (self.offset, (self.n,), (1,), False)))


def _send_forged_storage(engine, current, *, handle=None, size=None, manager=None, n=None,
                         chown=None) -> None:
    """An untagged bucket payload (SGLang's form) whose storage handle is forged; the buffer it
    would otherwise point at is a genuine segment of this process holding the current weights.
    Only a forged view (``n``) gets as far as mapping the segment: like make_payloads, take the
    reference that the receiver's mapping gives back."""
    name = _target(current)
    flat, meta = _bucket_obj([(name, current[name])])
    m, h, s = flat.untyped_storage()._share_filename_cpu_()
    path = "/dev/shm" + h.decode()
    before = os.stat(path).st_size
    if chown is not None:
        os.chown(path, chown, chown)
    if n is not None:
        flat.untyped_storage()._shared_incref()
    tensor = _Tensor(_Storage(manager or m, handle or h, s if size is None else size),
                     s if n is None else n)
    data = pickle.dumps({"flattened_tensor": tensor, "metadata": meta}, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        engine.update_weights_from_tensor([data], load_format="flattened_bucket")
    finally:
        if chown is not None:
            os.chown(path, 0, 0)
        assert os.stat(path).st_size == before, "a forged payload grew the producer's segment"
        del flat


def _per_tensor(engine, pairs) -> None:
    engine.update_weights_from_tensor([(n, SerializedPerRank([p])) for n, p in pairs])


def _opened_twice(engine, current):
    name = _target(current)
    other = next(n for n, t in current.items() if n != name and t.shape == current[name].shape)
    with handles.make_payloads(current[name].clone(), 1) as ps:
        try:
            _per_tensor(engine, [(name, ps.payloads[0]), (other, ps.payloads[0])])
        finally:
            ps.release(require_ack=False)


def _wrong_rank(engine, current):
    name = _target(current)
    with handles.make_payloads(current[name].clone(), 2, ranks=[1]) as ps:   # made for rank 1 of 2
        try:
            _per_tensor(engine, [(name, ps.payloads[0])])
        finally:
            ps.release(require_ack=False)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def _malformed_tag(engine, current):
    name = _target(current)
    with handles.make_payloads({"tensor": current[name].clone(), handles.TAG: "rank 0, trust me"}, 1,
                               tagged=False) as ps:
        try:
            _per_tensor(engine, [(name, ps.payloads[0])])
        finally:
            ps.release(require_ack=False)


# --------------------------------------------------------------------------- disk makers

def _ckpt(d, tensors: dict[str, torch.Tensor], *, file="model.safetensors", index=None, manifest=True,
          manifest_extra=None) -> str:
    os.makedirs(d, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(d, file))
    if index is not None:
        with open(os.path.join(d, INDEX_FILE), "w") as f:
            json.dump({"weight_map": index}, f)
    if manifest:
        files = {file: {"sha256": sha256_file(os.path.join(d, file))[0]}}
        files.update(manifest_extra or {})
        with open(os.path.join(d, MANIFEST_FILE), "w") as f:
            json.dump({"format": "fsdp_sync.disk/1", "files": files}, f)
    return str(d)


def _one(current) -> dict[str, torch.Tensor]:
    name = _target(current)
    return {name: current[name]}


def _changed(current) -> dict[str, torch.Tensor]:
    name = _target(current)
    return {name: current[name] + 1}


def _disk_index_outside(engine, current, tmp, path):
    outside = _ckpt(tmp / "elsewhere", _changed(current), manifest=False)
    d = _ckpt(tmp / "ck", {}, manifest=False, index={_target(current): path.format(outside=outside)})
    engine.update_weights_from_disk(d)


def _disk_manifest_outside(engine, current, tmp):
    d = _ckpt(tmp / "ck", _changed(current), manifest_extra={"../model.safetensors": {"sha256": "0" * 64}})
    engine.update_weights_from_disk(d)


def _disk_symlink(engine, current, tmp):
    outside = _ckpt(tmp / "elsewhere", _changed(current), manifest=False)
    os.makedirs(tmp / "ck")
    os.symlink(os.path.join(outside, "model.safetensors"), tmp / "ck" / "model.safetensors")
    engine.update_weights_from_disk(str(tmp / "ck"))


def _disk_swapped(engine, current, tmp):
    d = _ckpt(tmp / "ck", _one(current))                  # manifest: the current weights' digest
    save_file({n: t.contiguous() for n, t in _changed(current).items()},
              os.path.join(d, "model.safetensors"))        # swapped before the engine reads it
    engine.update_weights_from_disk(d)


def _disk_torn(engine, current, tmp):
    d = _ckpt(tmp / "ck", _changed(current), manifest=False)
    p = os.path.join(d, "model.safetensors")
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 8)
    engine.update_weights_from_disk(d)


def _disk_missing_shard(engine, current, tmp):
    d = _ckpt(tmp / "ck", _changed(current), manifest=False,
              index={_target(current): "model-00002-of-00002.safetensors"})
    engine.update_weights_from_disk(d)


def _disk_wrong_dtype(engine, current, tmp):
    d = _ckpt(tmp / "ck", {n: t.to(torch.bfloat16) for n, t in _changed(current).items()})
    engine.update_weights_from_disk(d)


def _disk_not_a_dir(engine, current, tmp):
    d = _ckpt(tmp / "ck", _changed(current))
    engine.update_weights_from_disk(os.path.join(d, "model.safetensors"))


# --------------------------------------------------------------------------- the table

E = WeightUpdateError
V = ValueError
UID = 65534

CASES = [
    # --- payloads forged to point outside their buffer or at memory that is not theirs
    ("meta_end_beyond_buffer", E, r"does not fit a buffer",
     lambda e, c, t: _forged_meta(e, c, lambda m: _shift(m[1], 1 << 20))),
    ("meta_negative_start", E, r"is not 0 <= start <= end",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "start_idx", -64))),
    ("tensor_view_beyond_storage", E, r"tensor view \(offset 0, size \(1048576,\), stride \(1,\)\) reaches byte 1048576 of a \d+-byte storage",
     lambda e, c, t: _send_forged_storage(e, c, n=1 << 20)),
    ("storage_size_beyond_segment", E, r"asks for \d+ bytes of segment /torch_.*a forged size",
     lambda e, c, t: _send_forged_storage(e, c, size=1 << 30)),
    ("storage_nonexistent_segment", E, r"/torch_1_2_3, which does not exist",
     lambda e, c, t: _send_forged_storage(e, c, handle=b"/torch_1_2_3")),
    ("storage_proc_path", E, r"'/proc/self/mem'.*not a torch segment name",
     lambda e, c, t: _send_forged_storage(e, c, handle=b"/proc/self/mem")),
    ("storage_absolute_file_path", E, r"'/etc/passwd'.*not a torch segment name",
     lambda e, c, t: _send_forged_storage(e, c, handle=b"/etc/passwd")),
    ("storage_other_program_segment", E, r"'/psm_1234'.*not a torch segment name",
     lambda e, c, t: _send_forged_storage(e, c, handle=b"/psm_1234")),
    ("storage_other_users_segment", E, rf"owned by uid {UID}.*another user's memory",
     lambda e, c, t: _send_forged_storage(e, c, chown=UID)),
    ("storage_forged_manager_socket", E, r"not a torch shm-manager socket",
     lambda e, c, t: _send_forged_storage(e, c, manager=b"/run/docker.sock")),
    # --- payloads reused, misdelivered, or carrying what is not data
    ("payload_opened_twice", E, r"opened twice", lambda e, c, t: _opened_twice(e, c)),
    ("payload_wrong_rank", E, r"payload for infer-TP rank 1 \(of 2\) opened by rank 0",
     lambda e, c, t: _wrong_rank(e, c)),
    ("payload_class_outside_allow_list", E, r"posix.system, which is not on the allow-list",
     lambda e, c, t: _per_tensor(e, [(_target(c), pickle.dumps(_Evil()))])),
    ("payload_malformed_tag", E, r"'fsdp_sync' tag is malformed", lambda e, c, t: _malformed_tag(e, c)),
    ("payload_garbage_bytes", E, r"cannot open payload on rank 0",
     lambda e, c, t: _per_tensor(e, [(_target(c), b"\x80\x04not a pickle")])),
    ("payload_not_bytes", E, r"payload for TP rank 0 must be bytes",
     lambda e, c, t: e.update_weights_from_tensor([12], load_format="flattened_bucket")),
    ("payload_count_not_tp", E, r"takes one payload per TP rank \(1\), got 2",
     lambda e, c, t: e.update_weights_from_tensor([b"x", b"y"], load_format="flattened_bucket")),
    # --- bucket metadata
    ("meta_overlapping_offsets", E, r"overlap",
     lambda e, c, t: _forged_meta(e, c, lambda m: (setattr(m[1], "start_idx", m[0].start_idx),
                                                   setattr(m[1], "end_idx", m[0].start_idx + m[1].numel)))),
    ("meta_negative_shape", E, r"negative shape \(-",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "shape", (-m[0].shape[0], -m[0].shape[1])))),
    ("meta_numel_mismatch", E, r"numel \d+ does not match shape",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "numel", m[0].numel - 4))),
    ("meta_range_shape_mismatch", E, r"is \d+ bytes, but its range",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "shape", (m[0].shape[0] - 1, m[0].shape[1])))),
    ("meta_unknown_dtype", E, r"unknown dtype 'float128'",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "dtype", "float128"))),
    ("meta_duplicate_names", E, r"appears twice in one update",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[1], "name", m[0].name))),
    ("meta_empty_name", E, r"name '' is not a non-empty string",
     lambda e, c, t: _forged_meta(e, c, lambda m: setattr(m[0], "name", ""))),
    ("unknown_parameter_name", E, r"unknown parameter 'model.layers.99.evil'",
     lambda e, c, t: e.update_weights_from_tensor([("model.layers.99.evil", torch.zeros(2))])),
    ("wrong_shape", E, r"expected shape \(64, 64\) for .* got \(3,\)",
     lambda e, c, t: e.update_weights_from_tensor([(_target(c), torch.zeros(3))])),
    ("wrong_dtype", E, r"expected dtype float32 .* got bfloat16",
     lambda e, c, t: e.update_weights_from_tensor([(_target(c), c[_target(c)].to(torch.bfloat16))])),
    ("unknown_load_format", E, r"unknown load_format 'pickle'",
     lambda e, c, t: e.update_weights_from_tensor([(_target(c), c[_target(c)])], load_format="pickle")),
    # --- disk checkpoints
    ("disk_index_parent_path", E, r"names files that are not safetensors files in the directory",
     lambda e, c, t: _disk_index_outside(e, c, t, "../elsewhere/model.safetensors")),
    ("disk_index_absolute_path", E, r"names files that are not safetensors files in the directory",
     lambda e, c, t: _disk_index_outside(e, c, t, "{outside}/model.safetensors")),
    ("disk_manifest_outside_path", E, r"names paths outside .*\['../model.safetensors'\]",
     lambda e, c, t: _disk_manifest_outside(e, c, t)),
    ("disk_shard_symlink", E, r"model.safetensors is a symlink", lambda e, c, t: _disk_symlink(e, c, t)),
    ("disk_file_swapped_after_checksum", E, r"checksum mismatch for .*model.safetensors",
     lambda e, c, t: _disk_swapped(e, c, t)),
    ("disk_torn_shard", E, r"cannot read .*model.safetensors", lambda e, c, t: _disk_torn(e, c, t)),
    ("disk_missing_indexed_shard", E, r"missing shard model-00002-of-00002.safetensors",
     lambda e, c, t: _disk_missing_shard(e, c, t)),
    ("disk_wrong_dtype", E, r"expected dtype float32 .* got bfloat16", lambda e, c, t: _disk_wrong_dtype(e, c, t)),
    ("disk_path_not_a_directory", E, r"is not a directory", lambda e, c, t: _disk_not_a_dir(e, c, t)),
    # --- config values out of range
    ("config_bucket_bytes_zero", V, r"bucket_bytes must be a positive int, got 0",
     lambda e, c, t: SyncConfig(bucket_bytes=0)),
    ("config_disk_keep_zero", V, r"disk_keep must be an int >= 1", lambda e, c, t: SyncConfig(disk_keep=0)),
    ("config_unknown_strategy", V, r"strategy must be one of", lambda e, c, t: SyncConfig(strategy="telepathy")),
    ("config_unknown_key", V, r"unknown SyncConfig keys \['bucket_gb'\]",
     lambda e, c, t: SyncConfig.from_dict({"bucket_gb": 1})),
    ("config_unknown_dtype", V, r"unknown rollout dtype 'float128'",
     lambda e, c, t: SyncConfig.from_dict({"dtype": "float128"})),
    ("engine_tp_size_zero", V, r"tp_size must be an int >= 1, got 0", lambda e, c, t: ReferenceEngine(tp_size=0)),
    ("engine_num_threads_negative", V, r"num_threads must be an int >= 1 .* got -2",
     lambda e, c, t: ReferenceEngine(num_threads=-2)),
    ("engine_timeout_negative", V, r"pg_timeout_s must be a finite number of seconds > 0, got -1",
     lambda e, c, t: ReferenceEngine(pg_timeout_s=-1)),
    ("engine_kv_cache_tokens_zero", V, r"kv_cache_tokens must be >= 1, got 0",
     lambda e, c, t: ReferenceEngine(kv_cache_tokens=0)),
    ("engine_mem_fraction_above_one", V, r"mem_fraction must be in \(0, 1\], got 1.5",
     lambda e, c, t: ReferenceEngine(mem_fraction=1.5)),
    ("engine_dtype_int8", V, r"dtype must be one of", lambda e, c, t: ReferenceEngine(dtype=torch.int8)),
    ("engine_unknown_device", V, r"device must be 'cpu' or 'cuda', got 'tpu'",
     lambda e, c, t: ReferenceEngine(device="tpu")),
    # --- requests
    ("generate_token_outside_vocab", V, r"token ids \[\d+\] outside the vocabulary",
     lambda e, c, t: e.generate([[1, 10 ** 9]], max_new_tokens=1)),
    ("generate_negative_max_new_tokens", V, r"max_new_tokens must be >= 0, got -1",
     lambda e, c, t: e.generate([[1, 2]], max_new_tokens=-1)),
]


@pytest.mark.parametrize("kind, exc, words, case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(engine, current, tmp_path, kind, exc, words, case):
    before = engine.weights_checksum()
    with pytest.raises(exc, match=words):
        case(engine, current, tmp_path)
    assert engine.weights_checksum() == before, f"{kind}: the refused input changed the weights"
    assert all(torch.equal(v, current[n]) for n, v in engine.named_full_tensors())


@pytest.mark.parametrize("forge", ["overlap", "range", "dtype", "numel"])
def test_a_forged_bucket_after_its_genuine_twin_is_still_refused(engine, current, forge):
    """The worker keeps bucket metadata it checked (`bucket.KnownMetadata`): a bucket sent once
    genuinely, then again with one field forged, is checked in full the second time and refused,
    changing nothing (the metadata cases above each come alone)."""
    name = _target(current)
    other = next(n for n, t in current.items() if n != name and ".layers." in n)
    named = [(name, current[name]), (other, current[other])]
    flat, meta = _bucket_obj(named)
    _send_bucket(engine, flat, meta, num_consumers=1)             # kept by the worker
    before = engine.weights_checksum()
    flat, meta = _bucket_obj(named)
    if forge == "overlap":
        meta[1].start_idx, meta[1].end_idx = meta[0].start_idx, meta[0].start_idx + meta[1].numel
    elif forge == "range":
        _shift(meta[1], 16)
    elif forge == "dtype":
        meta[0].dtype = torch.float16
    else:
        meta[0].numel -= 4
    with pytest.raises(E, match="bad flattened bucket"):
        _send_bucket(engine, flat, meta, num_consumers=1)
    assert engine.weights_checksum() == before
    assert all(torch.equal(v, current[n]) for n, v in engine.named_full_tensors())


def test_there_are_at_least_25_kinds():
    assert len({c[0] for c in CASES}) == len(CASES) >= 25


# --------------------------------------------------------------------------- NaN, Inf, -0.0 are data

def _special(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaNs (two payloads, both signs), +-Inf and -0.0 written over its first elements."""
    out = t.clone().reshape(-1)
    # quiet NaN, NaN with a payload, negative NaN, signalling NaN, +Inf, -Inf, -0.0
    raw = np.array([0x7FC00000, 0x7FC12345, 0xFFC00001, 0x7FA00000, 0x7F800000, 0xFF800000, 0x80000000],
                   dtype=np.uint32).view(np.int32)
    out[: raw.size] = torch.from_numpy(raw.copy()).view(torch.float32)
    return out.view(t.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("path", ["flattened", "per_tensor", "disk"])
def test_nan_inf_and_negative_zero_arrive_bit_exact(engine, current, tmp_path, path):
    name = _target(current)
    sent = _special(current[name] * (3 if path == "flattened" else 5 if path == "per_tensor" else 7))
    assert sent.isnan().sum() == 4 and sent.isinf().sum() == 2 and (_bits(sent) == -0x80000000).any()
    if path == "flattened":
        engine.update_weights_from_tensor([(name, sent)])
    elif path == "per_tensor":
        with handles.make_payloads(sent, 1) as ps:
            _per_tensor(engine, [(name, ps.payloads[0])])
    else:
        engine.update_weights_from_disk(_ckpt(tmp_path / "ck", {name: sent}))
    got = dict(engine.named_full_tensors())
    assert torch.equal(_bits(got[name]), _bits(sent)), f"{path}: special values changed on the way"
    for n, t in current.items():                       # the rest untouched
        if n != name:
            assert torch.equal(_bits(got[n]), _bits(t)), n
    engine.update_weights_from_tensor([(name, current[name])])   # back, for the other cases
    assert torch.equal(_bits(dict(engine.named_full_tensors())[name]), _bits(current[name]))
