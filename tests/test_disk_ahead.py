"""Per-rank disk files hashed ahead: the engine hashes each file while the trainer writes the next.

The trainer (rank 0, which holds the engines) tells a reference engine which files of the version
being written are complete (`transport.disk_ranked.HashAhead`); its workers hash them meanwhile
(`UpdateStager.hash_ahead`) and the load takes a file as checked only while it is the very file
hashed (inode, size, mtime) with the manifest's digest. Checked here: every file told is taken as
hashed and the weights are the trainer's bit for bit; a file corrupted while the engine hashes the
early ones (or after it hashed it) is refused naming the file, nothing is applied and the old
weights serve, no file stays open in a worker; a file told before it was complete, or one of
another directory, is hashed again at the load and loads right; files told under a temp name that
is published meanwhile are still found and taken; files of a version never loaded are closed by
the next update of any kind; a file that is the very file hashed ahead but hashed to another
digest than its manifest's is refused, not taken.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from _util import fds_under


def _sync(module, engines, d, step, bucket_bytes=4 << 20, **kw):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    sc = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=bucket_bytes, **kw)
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=engines, step=step,
                      stats=SyncStats())
    DiskTransport(sc).sync(ctx)
    return ctx.stats


def _flip(path: str) -> None:
    """One byte of the data flipped in place (same size, same inode)."""
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


class _Spy:
    """An engine whose ``hash_files_ahead`` calls ``then(directory, files)`` after passing them on."""

    def __init__(self, engine, then=None):
        self._engine, self._then, self.told = engine, then, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hash_files_ahead(self, directory, files, hash, published=None):
        self._engine.hash_files_ahead(directory, files, hash, published=published)
        self.told.append(list(files))
        if self._then is not None:
            self._then(directory, files)


class _NotAhead:
    """An engine that does not hash ahead (as `SGLangEngine`, or an HTTP client)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name == "hash_files_ahead":
            raise AttributeError(name)
        return getattr(self._engine, name)


def _scale(module, by):
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(by)


@pytest.mark.timeout(180)
def test_files_told_ahead_are_hashed_once_and_load_bit_exact(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("small")
    module = build_model(cfg, seed=5)
    d = str(tmp_path / "v")
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        spy = _Spy(engine)
        for step in range(2):
            _scale(module, -0.5)
            stats = _sync(module, [spy], d, step)
            assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
            x = stats.extra
            assert x["layout"] == "engine" and x["files"] >= 4, x
            # one trainer rank writes every file: each is told once it is written (the last
            # ones before the fsync), and the engine takes every one as hashed
            assert x["files_told_ahead"] == x["files"] == sum(len(t) for t in spy.told), (x, spy.told)
            assert x["files_hashed_ahead"] == x["files"], x
            assert len(spy.told) > 1                     # told as the stream went, not all at once
            spy.told.clear()
        for pid in engine.worker_pids:                   # nothing hashed ahead stays open
            assert fds_under(pid, str(tmp_path)) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("when", ["while the engine hashes the early files", "after the engine hashed it"])
def test_a_file_corrupted_meanwhile_is_refused_and_the_old_weights_serve(tmp_path, when):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    cfg = load_config("small")
    module = build_model(cfg, seed=6)
    d = str(tmp_path / "v")
    victims: list[str] = []

    def corrupt_early(directory, files):
        # the first files told: corrupted at once, as the engine starts hashing them (it may hash
        # the file before or after the flip: either way the load must refuse it)
        if not victims:
            time.sleep(0.05)                             # a later mtime than the file's write
            victims.append(os.path.basename(sorted(files)[0]))
            _flip(os.path.join(directory, victims[0]))

    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        _sync(module, [engine], d, 0)
        served = engine.weights_checksum()
        assert served == checksum_named_tensors(module.state_dict().items())
        _scale(module, 3.0)
        if when.startswith("while"):
            spy = _Spy(engine, corrupt_early)
        else:
            spy = _Spy(engine)
            real = engine.update_weights_from_disk

            def load(path, *a, **kw):                    # every file was hashed ahead by now
                victims.append(sorted(f for f in os.listdir(path) if f.startswith("model-rank-1-"))[0])
                time.sleep(0.05)
                _flip(os.path.join(path, victims[0]))
                return real(path, *a, **kw)

            spy.update_weights_from_disk = load
        with pytest.raises(SyncError, match="checksum mismatch") as info:
            _sync(module, [spy], d, 1)
        assert victims and victims[0] in str(info.value), (victims, str(info.value))
        assert engine.weights_checksum() == served       # nothing applied: the old weights serve
        for pid in engine.worker_pids:
            assert fds_under(pid, str(tmp_path)) == []
        _sync(module, [engine], d, 2)                    # and the next good version loads
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())


@pytest.mark.timeout(180)
def test_a_file_told_too_early_or_from_another_directory_is_hashed_at_the_load(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("small")
    module = build_model(cfg, seed=7)
    d = str(tmp_path / "v")
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        stats = _sync(module, [engine], d, 0)
        first = stats.extra["path"]
        early: list[str] = []

        def half(directory, files):
            # the first files told, told again while half written (as a file announced too soon
            # would be), then completed in place: hashed half or whole, the load must come out right
            if early:
                return
            for f in files:
                p = os.path.join(directory, f)
                early.append(f)
                with open(p, "r+b") as fh:
                    data = fh.read()
                    fh.truncate(len(data) // 2)
                engine.hash_files_ahead(directory, [f], "xxh3_128")
                time.sleep(0.05)
                with open(p, "r+b") as fh:
                    fh.seek(len(data) // 2)
                    fh.write(data[len(data) // 2:])

        _scale(module, 0.5)
        stats = _sync(module, [_Spy(engine, half)], d, 1)
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        x = stats.extra
        assert early and x["files"] - len(early) <= x["files_hashed_ahead"] <= x["files"], (early, x)
        # told of the files of an older version, then asked to load another (told nothing): no
        # file of the old one stands for a file of the new one
        _scale(module, 0.5)
        engine.hash_files_ahead(first, os.listdir(first), "xxh3_128")
        stats = _sync(module, [_NotAhead(engine)], d, 2)
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        assert stats.extra["files_told_ahead"] == 0 and stats.extra["files_hashed_ahead"] == 0, stats.extra
        # told of files under a temp name that is then published (renamed) while the worker still
        # works through them: found in the directory it opened, and taken as hashed at the load
        _scale(module, 0.5)
        stats = _sync(module, [_NotAhead(engine)], d, 3)
        src = stats.extra["path"]
        tmp = os.path.join(d, ".step_9.tmp-0123456789ab")
        shutil.copytree(src, tmp)
        files = sorted(f for f in os.listdir(tmp) if f.startswith("model-rank-"))
        early = [f for f in files if f.endswith("-part-0.safetensors")]      # one per worker
        engine.hash_files_ahead(tmp, early, "xxh3_128")
        engine.weights_checksum()                        # a round trip: each worker took its first
        final = os.path.join(d, "step_9")
        os.rename(tmp, final)
        later = [f for f in files if f not in early]
        engine.hash_files_ahead(tmp, later, "xxh3_128")  # the old name, as the trainer told it
        engine.update_weights_from_disk(final)
        assert engine.disk_seconds["files_hashed_ahead"] == len(files), engine.disk_seconds
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        for pid in engine.worker_pids:
            assert fds_under(pid, str(tmp_path)) == []
        # a worker that comes to the first files only after the version was published (a loaded
        # machine; the trainer told them before its rename): found under the published name
        tmp2, final2 = os.path.join(d, ".step_11.tmp-0123456789ab"), os.path.join(d, "step_11")
        shutil.copytree(final, tmp2)
        os.rename(tmp2, final2)
        engine.hash_files_ahead(tmp2, files, "xxh3_128", published=final2)
        engine.update_weights_from_disk(final2)
        assert engine.disk_seconds["files_hashed_ahead"] == len(files), engine.disk_seconds
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        shutil.rmtree(final2)
        # told of a version that is never loaded (its sync failed, its temp directory removed):
        # the files stay open only until the next update of any kind
        gone = os.path.join(d, ".step_10.tmp-0123456789ab")
        shutil.copytree(final, gone)
        engine.hash_files_ahead(gone, files, "xxh3_128")
        engine.weights_checksum()
        assert any(fds_under(pid, gone) for pid in engine.worker_pids)
        shutil.rmtree(gone)
        _scale(module, 0.5)
        engine.update_weights_from_tensor(list(module.state_dict().items()))
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        for pid in engine.worker_pids:
            assert fds_under(pid, str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_a_file_hashed_ahead_to_another_digest_than_the_manifests_is_refused(tmp_path):
    """A file told ahead is the very file the load opens (same inode, size, mtime) but hashed to
    a digest other than the manifest's (its bytes changed before the engine hashed it): the load
    hashes nothing more, it refuses the file with a checksum mismatch, nothing is applied."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import EngineError, checksum_named_tensors
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = build_model(cfg, seed=8)
    d = str(tmp_path / "v")
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        kept = str(tmp_path / "kept")
        shutil.copytree(_sync(module, [engine], d, 0, bucket_bytes=64 << 10).extra["path"], kept)
        _scale(module, 0.5)
        _sync(module, [engine], d, 1, bucket_bytes=64 << 10)
        served = engine.weights_checksum()
        assert served == checksum_named_tensors(module.state_dict().items())
        files = sorted(f for f in os.listdir(kept) if f.startswith("model-rank-"))
        for bad in (False, True):                        # the version of step 0, told ahead
            tmp = os.path.join(d, f".step_{8 + bad}.tmp-0123456789ab")
            final = os.path.join(d, f"step_{8 + bad}")
            shutil.copytree(kept, tmp)
            victim = next(f for f in files if f.startswith("model-rank-1-"))
            if bad:
                _flip(os.path.join(tmp, victim))         # before the hash: the stamp is the file's
            engine.hash_files_ahead(tmp, files, "xxh3_128", published=final)
            engine.weights_checksum()                    # a round trip: every worker hashed its files
            os.rename(tmp, final)
            if not bad:
                engine.update_weights_from_disk(final)
                assert engine.disk_seconds["files_hashed_ahead"] == len(files), engine.disk_seconds
                assert engine.weights_checksum() != served
                engine.update_weights_from_tensor(list(module.state_dict().items()))
                assert engine.weights_checksum() == served
                continue
            with pytest.raises(EngineError, match="checksum mismatch") as info:
                engine.update_weights_from_disk(final)
            assert victim in str(info.value), str(info.value)
            assert engine.weights_checksum() == served   # nothing applied: the old weights serve
        for pid in engine.worker_pids:
            assert fds_under(pid, str(tmp_path)) == []
