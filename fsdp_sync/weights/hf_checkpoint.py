"""The on-disk checkpoint the disk method writes and the engines read: names, manifest, checks.

A version is a directory in the Hugging Face layout that ``AutoModelForCausalLM.from_pretrained``
and SGLang's ``update_weights_from_disk`` both read unchanged:

    model-00001-of-0000K.safetensors ...   the tensors (safetensors), HF names
    config.json                            when the trained module has an HF config
    fsdp_sync_manifest.json                the digest and size of every file above, and the
                                           hash that made the digests (``"hash"``)
    model.safetensors.index.json           tensor name -> file; written last

Digests: ``"hash": "xxh3_128"`` (the default, `DEFAULT_HASH`: XXH3-128 from ``xxhash``, ~7x
sha256 on this machine, against torn files and flipped bits) or ``"sha256"`` (a cryptographic
digest, ``SyncConfig.disk_hash="sha256"``); each file's entry holds its digest under the hash's
name (``{"xxh3_128": "...", "bytes": N}``). A manifest without ``"hash"`` (written before there
was a choice) is sha256. `new_hash` makes one; `digest_file` hashes a file.

Helpers here: durable writes (`fsync_file`, `fsync_dir`, `write_json`), `digest_file`, and
`resolve` / `verify_file`, the reader's side with SGLang 0.5.23's rules (an index, when present,
decides the files; a missing indexed file fails before anything loads) plus the manifest check,
and `SliceReader`, which reads slices of a file's tensors (`safetensors_read`, re-exported here
with `CheckpointError` and `SAFETENSORS_DTYPES`).

A per-rank version (``SyncConfig.layout="engine"``) holds, instead, one set of files per engine TP
rank, each with only that rank's shard under the engine's own parameter names (`fsdp_sync.weights.layout`:
fused ``qkv_proj`` / ``gate_up_proj``, vocab rows with padding, ...; a tied model's embedding as
``lm_head.weight``: `rank_tensor_name`), files and tensors named as SGLang's ``ShardedStateLoader``
names them:

    model-rank-{rank}-part-{part}.safetensors   rank's shard, part = bucket number
    config.json                                 when the trained module has an HF config
    fsdp_sync_manifest.json                     written last: ``layout: "engine"``, tp size, the
                                                model's layout spec, per rank its files, and every
                                                file's digest, size and tensor names

There is no ``model.safetensors.index.json`` (tensor names repeat across ranks). `resolve_ranked`
checks such a directory before anything loads; `read_verified` reads one file once, hashing each
chunk as it is read and returns zero-copy tensor views of them (one read per engine rank of
just its own bytes). SGLang 0.5.23 cannot load these through ``update_weights_from_disk`` (see
`transport.disk`).

Not here: who writes which file, publishing and pruning (`transport.disk`), or loading tensors into
a model (the engines).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .safetensors_read import SAFETENSORS_DTYPES, CheckpointError, SliceReader, header_entries

__all__ = [
    "INDEX_FILE", "MANIFEST_FILE", "CONFIG_FILE", "MANIFEST_FORMAT", "SAFETENSORS_DTYPES",
    "HASHES", "DEFAULT_HASH", "new_hash", "digest_file", "manifest_hash",
    "CheckpointError", "ReadPlan", "shard_file_name", "sha256_file", "fsync_file", "fsync_dir",
    "write_json", "write_safetensors", "safetensors_file_bytes", "start_writeback", "read_hashed", "resolve", "verify_file", "SliceReader", "RANK_FILE_PATTERN", "rank_file_name",
    "RankPlan", "is_ranked", "resolve_ranked", "read_verified", "rank_tensor_name", "engine_name_of",
    "ROTARY_CACHES", "is_rotary_cache",
]

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "fsdp_sync_manifest.json"
CONFIG_FILE = "config.json"
MANIFEST_FORMAT = "fsdp_sync.disk/1"
LOAD_FORMATS = (None, "auto", "safetensors")
ROTARY_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Rotary tables some Hub checkpoints carry (older transformers saved ``inv_freq``): derived from
the config, not weights. SGLang's ``load_weights`` skips names holding these; so do the engines
(the trainer's export drops them: `export.NON_WEIGHT_BUFFERS`)."""


def is_rotary_cache(name: str) -> bool:
    """``name`` is a rotary table a checkpoint may carry (`ROTARY_CACHES`), not a weight."""
    return any(p in name for p in ROTARY_CACHES)

WRITE_CHUNK = 512 << 10   # `write_safetensors` writes, then hashes, this much: still in L2 (issue 39)
HASH_CHUNK = 4 << 20
"""Bytes read then hashed per step (`digest_file`, the engines' checks)."""
HASHES = ("xxh3_128", "sha256")
"""The digests a manifest may hold (``SyncConfig.disk_hash``)."""
DEFAULT_HASH = "xxh3_128"


def new_hash(name: str) -> Any:
    """A fresh hash object (``update(buffer)``, ``hexdigest()``) for ``name``, one of `HASHES`.
    XXH3-128 (``xxhash``) and sha256 both take any buffer (a memoryview of a tensor's bytes) and
    let other threads run while they hash."""
    if name == "sha256":
        return hashlib.sha256()
    if name == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:   # a core dependency; say what to do where it is missing
            raise CheckpointError("disk_hash 'xxh3_128' needs the xxhash package (pip install "
                                  "xxhash), or use disk_hash='sha256'") from exc
        return xxhash.xxh3_128()
    raise CheckpointError(f"unknown hash {name!r}: expected one of {list(HASHES)}")


def digest_file(path: str, hash: str = "sha256") -> tuple[str, int]:
    """(hex digest, size in bytes) of a file under ``hash``, read in chunks into one small buffer."""
    h = new_hash(hash)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def manifest_hash(doc: dict, where: str) -> str:
    """The hash a manifest's digests were made with: its ``"hash"``, or sha256 where it has none
    (manifests written before the choice). Raises `CheckpointError` for any other value."""
    name = doc.get("hash", "sha256")
    if name not in HASHES:
        raise CheckpointError(f"{where} says hash {name!r}, expected one of {list(HASHES)}; "
                              f"nothing was loaded")
    return name


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's shard name: ``model-00001-of-00003.safetensors`` for ``index`` 0 of 3."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def sha256_file(path: str) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file: `digest_file` with sha256."""
    return digest_file(path, "sha256")


def fsync_file(path: str) -> None:
    """Flush a written file's data to the device (fsync works on any descriptor of the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any, hash: str = "sha256") -> tuple[str, int]:
    """Write ``obj`` as JSON, flushed and fsynced; returns (digest under ``hash``, size) of what
    was written."""
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    h = new_hash(hash)
    h.update(data)
    return h.hexdigest(), len(data)


_ST_CODE = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data):]


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages to the device now, without waiting for
    it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); a no-op where that call is missing.
    Durability still comes from the fsync that follows: this only lets the device work while the
    caller goes on (the next bucket is made and written) instead of all at once in that fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, 2)      # SYNC_FILE_RANGE_WRITE; offset 0, nbytes 0: the whole file


_SFR: list = []


def _sync_file_range() -> Any:
    if not _SFR:
        fn = None
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):     # not Linux (or no libc symbol): fsync alone
            fn = None
        _SFR.append(fn)
    return _SFR[0]


def _file_layout(entries: Any, rename: Any, metadata: dict | None, limit: int | None) -> tuple:
    """(head: u64 size + JSON header; names in file order; runs of bucket bytes after it): one
    code path for what `write_safetensors` writes and `safetensors_file_bytes` counts."""
    order = sorted(entries, key=lambda e: -e.dtype.itemsize)     # stable: bucket order within
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    names, runs, offset = [], [], 0
    for e in order:
        name, code, nbytes = rename(e.name), _ST_CODE.get(e.dtype), e.end - e.start
        if code is None or name in header or not 0 <= e.start <= e.end <= (e.end if limit is None else limit) \
                or nbytes != math.prod(e.shape) * e.dtype.itemsize:
            raise ValueError(f"tensor {name!r} ({e.dtype}, shape {tuple(e.shape)}, bytes "
                             f"[{e.start}, {e.end}) of {limit}) cannot be written: an "
                             f"unsupported dtype, a repeated name or a span outside the bucket")
        header[name] = {"dtype": code, "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        names.append(name)
        offset += nbytes
        if runs and runs[-1][1] == e.start:
            runs[-1][1] = e.end                  # adjacent in the bucket too: one write
        elif nbytes:
            runs.append([e.start, e.end])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)               # the data starts 8-byte aligned (as safetensors)
    return struct.pack("<Q", len(text)) + text, names, runs


def safetensors_file_bytes(entries: Any, *, rename: Any = str, metadata: dict | None = None) -> int:
    """Bytes of the file `write_safetensors` writes for ``entries``, header included (pure)."""
    head, _, runs = _file_layout(entries, rename, metadata, None)
    return len(head) + sum(b - a for a, b in runs)


def write_safetensors(path: str, flat: torch.Tensor, entries: Any, *, hash: str = DEFAULT_HASH,
                      rename: Any = str, metadata: dict | None = None, fsync: bool = True,
                      in_place: bool = False) -> tuple[str, int, list[str]]:
    """Write the tensors of a flattened bucket as one safetensors file straight from ``flat``,
    hashing each chunk as it is written; returns ``(digest, bytes, names)``. ``fsync``: fsynced
    before this returns, or (False) its writeback only started, the caller fsyncs it (`fsync_file`).
    ``in_place``: a file at ``path`` is overwritten without truncation (pages reused), then cut.

    ``flat``: a 1-D contiguous CPU uint8 tensor; ``entries``: its tensors (objects with ``name``,
    ``dtype``, ``shape``, ``start``, ``end``: `bucket.BucketEntry`), each named ``rename(name)``
    in the file. What ``safetensors.torch.save_file`` writes, without its serialized copy of the
    whole file and without a second pass to hash it: the header, then the tensors' bytes written
    from ``flat`` itself (one write per run of adjacent tensors), largest itemsize first (as
    safetensors orders them, so every tensor's offset is a multiple of its itemsize), each chunk
    hashed while it is still in the CPU's cache."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous() or flat.is_cuda:
        raise ValueError(f"a flattened bucket is a 1-D contiguous CPU uint8 tensor, got "
                         f"{flat.dtype} {tuple(flat.shape)} on {flat.device}")
    head, names, runs = _file_layout(entries, rename, metadata, flat.numel())
    head, offset = memoryview(head), sum(b - a for a, b in runs)
    data = memoryview(flat.numpy())
    h = new_hash(hash)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_NOFOLLOW if in_place else os.O_TRUNC), 0o644)
    try:
        _write_all(fd, head)
        h.update(head)
        for a, b in runs:
            for i in range(a, b, WRITE_CHUNK):
                chunk = data[i:min(i + WRITE_CHUNK, b)]
                _write_all(fd, chunk)
                h.update(chunk)                   # just copied to the page cache: still cached
        if in_place:
            os.ftruncate(fd, len(head) + offset)
        if fsync:
            os.fsync(fd)
        else:
            start_writeback(fd)
    finally:
        os.close(fd)
    return h.hexdigest(), len(head) + offset, names


@dataclass
class ReadPlan:
    """What a reader loads from a checkpoint directory."""

    directory: str
    files: list[str]                                   # safetensors files to read, in order
    index: dict[str, str] | None = None                # tensor name -> file, when indexed
    digests: dict[str, str] = field(default_factory=dict)  # file -> digest, from the manifest
    hash: str = "sha256"                                   # what made the digests (`HASHES`)

    def names_in(self, file: str) -> set[str] | None:
        """Tensor names the index places in ``file`` (None without an index)."""
        if self.index is None:
            return None
        return {n for n, f in self.index.items() if f == file}


def _load_json(path: str, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the {what} {path}: {type(exc).__name__}: {exc}") from exc


def resolve(model_path: Any, load_format: str | None = None) -> ReadPlan:
    """The files to load from ``model_path`` by SGLang's rules, checked before anything loads.

    ``model_path`` must be a local directory (SGLang would take anything else as a Hub id; nothing
    is downloaded here). With ``model.safetensors.index.json``: exactly the files its weight map
    names, each of which must exist. Without one: every ``*.safetensors`` file, sorted. With
    ``fsdp_sync_manifest.json``: every file to load must be listed there with a digest under the
    manifest's hash (then checked by `verify_file`), and every ``.safetensors`` file it lists must
    be there (without an index, a copy that lost a shard would load the rest and leave the lost
    tensors' old weights serving). Raises `CheckpointError` naming the directory or file.
    """
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format {load_format!r} is not supported for a disk update; "
                              f"expected one of {list(LOAD_FORMATS)} (safetensors checkpoints)")
    if not isinstance(model_path, (str, os.PathLike)):
        raise CheckpointError(f"model_path must be a directory path, got {type(model_path).__name__}")
    directory = os.path.abspath(os.fspath(model_path))
    if not os.path.isdir(directory):
        raise CheckpointError(f"model_path {directory} is not a directory (missing, or a Hub id: "
                              f"only local checkpoint directories are loaded)")
    index_path = os.path.join(directory, INDEX_FILE)
    index = None
    if os.path.exists(index_path):
        doc = _load_json(index_path, "index")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in wm.items()):
            raise CheckpointError(f"{index_path} has no weight_map of tensor name -> file")
        index = dict(wm)
        files = list(dict.fromkeys(index.values()))
        bad = [f for f in files if os.path.basename(f) != f or not f.endswith(".safetensors")]
        if bad:
            raise CheckpointError(f"{index_path} names files that are not safetensors files in the "
                                  f"directory: {bad[:3]}")
        missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
        if missing:
            raise CheckpointError(f"missing shard {missing[0]} in {directory} (named by "
                                  f"{INDEX_FILE}; {len(missing)} missing in all); nothing was loaded")
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {directory} (*.bin / *.pt "
                                  f"checkpoints are not supported)")
    # A shard is a regular file of this directory: a symlink (to a file elsewhere, or to another
    # shard) would load what no one wrote here, and a reader following it leaves the directory.
    for f in files:
        path = os.path.join(directory, f)
        if os.path.islink(path) or not os.path.isfile(path):
            raise CheckpointError(f"{path} is a symlink or not a regular file: only regular files of "
                                  f"{directory} are loaded; nothing was loaded")
    plan = ReadPlan(directory, files, index)
    manifest_path = os.path.join(directory, MANIFEST_FILE)
    if os.path.exists(manifest_path):
        doc = _load_json(manifest_path, "manifest")
        listed = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(listed, dict):
            raise CheckpointError(f"{manifest_path} has no 'files' table")
        plan.hash = manifest_hash(doc, manifest_path)
        bad = [f for f in listed if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", "..")]
        if bad:
            raise CheckpointError(f"{manifest_path} names paths outside {directory}: {bad[:3]} (a "
                                  f"manifest lists file names of its own directory); nothing was loaded")
        for f in files:
            entry = listed.get(f)
            if not isinstance(entry, dict) or not isinstance(entry.get(plan.hash), str):
                raise CheckpointError(f"{f} in {directory} is not listed with a {plan.hash} digest "
                                      f"in {MANIFEST_FILE}: the checkpoint is not the one the "
                                      f"manifest describes")
            plan.digests[f] = entry[plan.hash]
        gone = sorted(f for f in listed if f.endswith(".safetensors")
                      and not os.path.isfile(os.path.join(directory, f)))
        if gone:
            raise CheckpointError(f"missing shard {gone[0]} in {directory} (listed in {MANIFEST_FILE}; "
                                  f"{len(gone)} missing in all): the checkpoint is not the one the "
                                  f"manifest describes; nothing was loaded")
    return plan


def _mismatch(path: str, size: int, hash: str, expected: str, got: str) -> CheckpointError:
    return CheckpointError(f"checksum mismatch for {path} ({size} bytes): the manifest says {hash} "
                           f"{expected[:16]}..., the file has {got[:16]}... (torn or corrupt file)")


def verify_file(directory: str, file: str, expected: str, hash: str = "sha256") -> None:
    """Raise `CheckpointError` unless ``file``'s digest under ``hash`` is ``expected``."""
    path = os.path.join(directory, file)
    try:
        got, size = digest_file(path, hash)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if got != expected:
        raise _mismatch(path, size, hash, expected, got)


# --------------------------------------------------------------------------- per-rank versions

RANK_FILE_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
"""SGLang's ``ShardedStateLoader.DEFAULT_PATTERN`` (0.5.23)."""

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


_RANK_FILE_RE = re.compile(r"^model-rank-(\d+)-part-\d+\.safetensors$")   # RANK_FILE_PATTERN


def rank_file_name(rank: int, part: int) -> str:
    """``model-rank-1-part-0.safetensors``: engine TP rank ``rank``'s ``part``-th file."""
    return RANK_FILE_PATTERN.format(rank=rank, part=part)


_TIED_EMBED, _TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def rank_tensor_name(engine_name: str, tied: bool) -> str:
    """The name engine parameter ``engine_name`` has in a per-rank file: SGLang's
    ``ShardedStateLoader`` keys. They are the engine's names, except that a model with
    ``tie_word_embeddings`` keeps its one embedding under ``lm_head.weight`` (SGLang's
    ``_filter_subtensors`` keeps the smaller of two aliased keys), as SGLang's own ``save_model``
    writes it and its loader requires it."""
    return _TIED_HEAD if tied and engine_name == _TIED_EMBED else engine_name


def engine_name_of(file_tensor_name: str, tied: bool) -> str:
    """Inverse of `rank_tensor_name`."""
    return _TIED_EMBED if tied and file_tensor_name == _TIED_HEAD else file_tensor_name


@dataclass
class RankPlan:
    """What each engine TP rank loads from a per-rank checkpoint directory."""

    directory: str
    tp_size: int
    files: list[list[str]]              # per rank, its files in part order
    digests: dict[str, str]             # file -> digest
    names: dict[str, list[str]]         # file -> tensor names in it
    model: dict                         # the writer's layout spec (`layout.ModelSpec` fields)
    dtype: str                          # safetensors dtype code of every tensor
    hash: str = "sha256"                # what made the digests (`HASHES`)

    def rank_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s files on disk (what that rank reads)."""
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in self.files[rank])


def _manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    doc = _load_json(path, "manifest")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return doc


def is_ranked(model_path: Any) -> bool:
    """True when ``model_path`` is a per-rank version (its manifest says ``layout: "engine"``)."""
    if not isinstance(model_path, (str, os.PathLike)) or not os.path.isdir(model_path):
        return False
    doc = _manifest(os.fspath(model_path))
    return doc is not None and doc.get("layout") == "engine"


def resolve_ranked(model_path: Any, tp_size: int, ep_size: int = 1) -> RankPlan:
    """Check a per-rank version before anything loads: the manifest names ``tp_size`` ranks, each
    with its files; every file is a regular file of the directory named for its rank
    (`RANK_FILE_PATTERN`, as SGLang's loader picks them), listed with a digest (under the
    manifest's hash) and its tensor names (strings), and every rank lists the same tensor names. Raises `CheckpointError` naming the
    file, rank or value; nothing has been read but the manifest then."""
    directory = os.path.abspath(os.fspath(model_path))
    if not os.path.isdir(directory):
        raise CheckpointError(f"model_path {directory} is not a directory")
    doc = _manifest(directory)
    where = os.path.join(directory, MANIFEST_FILE)
    if doc is None or doc.get("layout") != "engine":
        raise CheckpointError(f"{directory} is not a per-rank checkpoint (no {MANIFEST_FILE} with "
                              f"layout 'engine')")
    tp, ranks, listed = doc.get("tp_size"), doc.get("ranks"), doc.get("files")
    if tp != tp_size:
        raise CheckpointError(f"{directory} holds shards for {tp} engine TP ranks, this engine has "
                              f"{tp_size}: write it with the engine's TP size (or layout='full')")
    if doc.get("ep_size", 1) != ep_size:
        raise CheckpointError(f"{directory} holds shards for expert-parallel size {doc.get('ep_size', 1)}, "
                              f"this engine runs ep_size {ep_size}: write it with the engine's split "
                              f"(or layout='full')")
    if not isinstance(ranks, list) or len(ranks) != tp or not isinstance(listed, dict) \
            or not isinstance(doc.get("model"), dict) or not isinstance(doc.get("dtype"), str):
        raise CheckpointError(f"{where} lacks 'ranks' (one list of files per rank), 'files', "
                              f"'model' or 'dtype'")
    algo = manifest_hash(doc, where)
    sha, names, files = {}, {}, []
    for r, rank_files in enumerate(ranks):
        if not isinstance(rank_files, list) or not rank_files:
            raise CheckpointError(f"{where} lists no files for engine rank {r}")
        for f in rank_files:
            entry = listed.get(f) if isinstance(f, str) else None
            if not isinstance(entry, dict) or not isinstance(entry.get(algo), str) \
                    or not isinstance(entry.get("names"), list) \
                    or not all(isinstance(n, str) for n in entry["names"]):
                raise CheckpointError(f"{where}: rank {r}'s file {f!r} is not listed with a {algo} "
                                      f"digest and its tensor names")
            if os.path.basename(f) != f or f in (".", "..") or not f.endswith(".safetensors"):
                raise CheckpointError(f"{where} names paths outside {directory}: {f!r}; nothing "
                                      f"was loaded")
            m = _RANK_FILE_RE.match(f)
            if m is None or int(m.group(1)) != r:
                # SGLang's loader takes rank r's files by this name: another rank's shard (of the
                # same shape under an even split) would load here without a word
                raise CheckpointError(f"{where} lists {f!r} for engine rank {r}: rank {r}'s files "
                                      f"are named {rank_file_name(r, 0)!r}, ... "
                                      f"({RANK_FILE_PATTERN}); nothing was loaded")
            path = os.path.join(directory, f)
            if os.path.islink(path) or not os.path.isfile(path):
                raise CheckpointError(f"missing shard {f} of engine rank {r} in {directory} (or "
                                      f"not a regular file); nothing was loaded")
            sha[f], names[f] = entry[algo], list(entry["names"])
        files.append(list(rank_files))
    per_rank = [sorted(n for f in fs for n in names[f]) for fs in files]
    for r in range(1, tp):
        if per_rank[r] != per_rank[0]:
            diff = sorted(set(per_rank[r]) ^ set(per_rank[0]))
            raise CheckpointError(f"{where}: engine rank {r} lists other tensors than rank 0 "
                                  f"(e.g. {diff[:2]}); nothing was loaded")
    return RankPlan(directory, tp, files, sha, names, dict(doc["model"]), doc["dtype"], algo)


def read_hashed(path: str, expected: str | None, hash: str = "sha256") -> torch.Tensor:
    """A whole file read ONCE into a new uint8 tensor, each chunk hashed under ``hash`` as it is
    read (while still in the CPU's cache), the digest checked against ``expected`` when given.
    Raises `CheckpointError` for a mismatch or a read that fails or comes up short."""
    h = new_hash(hash) if expected is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = torch.empty(size, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            got = 0
            while got < size:
                n = f.readinto(view[got:min(got + HASH_CHUNK, size)])
                if not n:
                    break
                if h is not None:
                    h.update(view[got:got + n])     # still in the CPU's cache: no second pass
                got += n
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if got != size:
        raise CheckpointError(f"{path} shrank while being read ({got} of {size} bytes)")
    if h is not None:
        digest = h.hexdigest()
        if digest != expected:
            raise _mismatch(path, size, hash, expected, digest)
    return buf


def read_verified(path: str, expected: str | None,
                  hash: str = "sha256") -> tuple[dict[str, torch.Tensor], int]:
    """Read a safetensors file ONCE, hashing each chunk under ``hash`` as it is read, check the
    digest against ``expected`` (when given) and return ``({name: tensor view of those bytes},
    bytes read)``: the tensors are checked and loaded from exactly the bytes that were hashed, with
    no second pass over them and no copy. Raises `CheckpointError` for a checksum mismatch or a
    malformed file (header, dtype, offsets)."""
    buf = read_hashed(path, expected, hash)
    size = buf.numel()
    view = memoryview(buf.numpy())
    # safetensors: u64 little-endian header size, JSON header, then the tensors' bytes
    try:
        n = int.from_bytes(bytes(view[:8]), "little")
        if size < 8 or 8 + n > size:
            raise ValueError(f"header of {n} bytes does not fit a file of {size}")
        header = json.loads(bytes(view[8:8 + n]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        data = buf[8 + n:]
        out, spans = {}, []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            code, shape, (a, b) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(code)
            numel = 1
            for x in shape:
                numel *= x
            if dtype is None or not (0 <= a <= b <= data.numel()) or b - a != numel * _ITEMSIZE[code]:
                raise ValueError(f"tensor {name!r}: dtype {code}, shape {shape}, offsets [{a}, {b})")
            spans.append((a, b))
            out[name] = data[a:b].view(dtype).view(shape) if b > a else torch.empty(shape, dtype=dtype)
        spans.sort()
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise ValueError("tensors overlap")
        header_entries(header, data.numel())   # and the rest of safetensors' rules (as SGLang reads)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{path} is not a well-formed safetensors file: {exc}") from exc
    return out, size
