"""Keep-N, and the files of a dropped version reused (issue 39).

The versions a disk sync drops are removed on trainer rank 0 while the engines load the new one (a
thread deletes them; the sync waits for it before returning), not after the load on the sync's
critical path. The newest dropped version is kept, hidden, as the pool ``.recycle``: the next sync
moves each file of the same name out of it and overwrites it in place (its pages reused, not
allocated anew), and `DiskTransport.close` removes it.

Checked with a real reference engine: the dropped version is gone from view before the engine
loads; nothing hidden is left when the sync returns but the pool; the new files are the very files
(inodes) of the pool, cut to size and hashed anew even where the pool's file was longer, shorter
or garbage; the weights are the trainer's; a file corrupted after its in-place write is refused
naming it, with the old weights serving; a refused load keeps the version the engine serves; with
``disk_keep=1`` the version served before goes once the load succeeded; close removes the pool.
"""

from __future__ import annotations

import os

import pytest
import torch

POOL = ".recycle"


class _Watch:
    """The real engine, with what the disk directory held when each load began, and a refusal or a
    corruption of one file of the version before it loads."""

    def __init__(self, engine, d):
        self.engine, self.d, self.seen, self.refuse, self.corrupt = engine, d, [], False, None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights_from_disk(self, path, **kw):
        # the versions in view (a dropped one may be under its hidden name, being deleted)
        self.seen.append((os.path.basename(path), _versions(self.d)))
        if self.refuse:
            raise RuntimeError(f"engine refused {os.path.basename(path)} (injected)")
        if self.corrupt:
            with open(os.path.join(path, self.corrupt), "r+b") as f:
                f.seek(-5, os.SEEK_END)
                b = f.read(1)
                f.seek(-5, os.SEEK_END)
                f.write(bytes([b[0] ^ 0xFF]))
        return self.engine.update_weights_from_disk(path, **kw)


def _versions(d):
    return sorted(f for f in os.listdir(d) if not f.startswith("."))


def _weight_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _sync(transport, module, engines, step):
    from fsdp_sync.transport import SyncContext, SyncStats

    ctx = SyncContext(module=module, config=transport.config, topo=None, group=None,
                      engines=engines, step=step, stats=SyncStats())
    transport.sync(ctx)
    return ctx.stats


def _setup(tmp_path, layout, keep=2):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport.disk import DiskTransport

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    d = str(tmp_path / "v")
    sc = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=256 << 10,
                    disk_keep=keep, layout=layout)
    return cfg, build_model(cfg, seed=5), d, DiskTransport(sc)


def _step(module, f):
    with torch.no_grad():
        for p in module.parameters():
            f(p)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["full", "engine"])
def test_dropped_versions_are_removed_while_the_engine_loads(tmp_path, layout):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.topology import SyncError

    cfg, module, d, t = _setup(tmp_path, layout)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as real:
        engine = _Watch(real, d)
        try:
            for step in range(4):
                _step(module, lambda p: p.add_(0.25))
                stats = _sync(t, module, [engine], step)
                want = [f"step_{j}" for j in range(max(0, step - 1), step + 1)]
                # the load of step_N began with step_{N-2} already out of view
                assert engine.seen[-1] == (f"step_{step}", want)
                assert sorted(os.listdir(d)) == ([POOL] if step >= 2 else []) + want
                assert stats.extra["pruned"] == ([os.path.join(d, f"step_{step - 2}")] if step >= 2 else [])
                assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
            served = real.weights_checksum()
            # a refused load: step_2 goes (beyond the newest two), step_3 (served) stays, and so do
            # its weights
            engine.refuse = True
            _step(module, lambda p: p.mul_(-1))
            with pytest.raises(SyncError, match="engine refused step_4"):
                _sync(t, module, [engine], 4)
            assert _versions(d) == ["step_3", "step_4"]
            assert real.weights_checksum() == served
            # disk_keep=1: the version served before goes once the new one is loaded
            engine.refuse = False
            t.keep = 1
            stats = _sync(t, module, [engine], 5)
            assert engine.seen[-1] == ("step_5", ["step_3", "step_5"])      # step_3 still served
            assert sorted(os.listdir(d)) == [POOL, "step_5"]
            assert sorted(stats.extra["pruned"]) == [os.path.join(d, "step_3"), os.path.join(d, "step_4")]
            assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        finally:
            t.close()
    assert sorted(os.listdir(d)) == ["step_5"]          # close removed the pool


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["full", "engine"])
def test_a_dropped_versions_files_are_overwritten_in_place_and_checked(tmp_path, layout):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import hf_checkpoint as ckpt

    cfg, module, d, t = _setup(tmp_path, layout)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as real:
        engine = _Watch(real, d)
        try:
            for step in range(3):
                _step(module, lambda p: p.add_(0.5))
                _sync(t, module, [engine], step)
            pool = os.path.join(d, POOL)
            files = _weight_files(pool)                    # step_0's, dropped by step_2
            assert len(files) >= 2 and files == _weight_files(os.path.join(d, "step_2"))
            inodes = {f: os.stat(os.path.join(pool, f)).st_ino for f in files}
            # the pool's files need not be what they were: longer, shorter, garbage
            with open(os.path.join(pool, files[0]), "ab") as f:
                f.write(os.urandom(1 << 16))
            os.truncate(os.path.join(pool, files[1]), 100)
            with open(os.path.join(pool, files[-1]), "r+b") as f:
                f.write(os.urandom(4096))
            _step(module, lambda p: p.mul_(-0.5))
            _sync(t, module, [engine], 3)
            new = os.path.join(d, "step_3")
            assert {f: os.stat(os.path.join(new, f)).st_ino for f in files} == inodes   # reused
            plan = ckpt.resolve_ranked(new, 1) if layout == "engine" else ckpt.resolve(new)
            for f in files:                                # every byte written and hashed anew
                assert ckpt.digest_file(os.path.join(new, f), plan.hash)[0] == plan.digests[f], f
            assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
            assert _weight_files(pool) == files            # step_1's now
            # a file corrupted after its in-place write: refused naming it, the old weights serve
            served = real.weights_checksum()
            engine.corrupt = files[1]
            _step(module, lambda p: p.add_(1.0))
            with pytest.raises(SyncError, match=f"checksum mismatch for .*{files[1]}"):
                _sync(t, module, [engine], 4)
            assert real.weights_checksum() == served
            engine.corrupt = None
            _sync(t, module, [engine], 5)
            assert real.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        finally:
            t.close()
    assert POOL not in os.listdir(d)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["full", "engine"])
def test_a_dropped_version_linked_elsewhere_is_not_overwritten(tmp_path, layout):
    """A user keeping a version by hard links (`cp -al`, `rsync --link-dest`) kept the files the
    pool would later write in place: after two more syncs at disk_keep=1 the archived step_0 held
    step 2's bytes under step_0's manifest (its digests failed), which loaders that do not check
    digests read as step_0. A pool file with another link is now unlinked and written fresh."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.weights import hf_checkpoint as ckpt

    cfg, module, d, t = _setup(tmp_path, layout, keep=1)
    archive = tmp_path / "archive"
    archive.mkdir()
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as real:
        engine = _Watch(real, d)
        try:
            _sync(t, module, [engine], 0)
            v0 = os.path.join(d, "step_0")
            plan = ckpt.resolve_ranked(v0, 1) if layout == "engine" else ckpt.resolve(v0)
            files = _weight_files(v0)
            for f in files:
                os.link(os.path.join(v0, f), archive / f)
            for step in (1, 2):                 # step_0 dropped at 1, its files reused at 2
                _step(module, lambda p: p.add_(0.5))
                _sync(t, module, [engine], step)
            assert _weight_files(os.path.join(d, POOL))          # the pool is in use
            for f in files:
                assert ckpt.digest_file(str(archive / f), plan.hash)[0] == plan.digests[f], f
        finally:
            t.close()


@pytest.mark.timeout(120)
def test_a_new_transport_on_a_dir_with_an_earlier_runs_later_versions_refuses_before_writing(tmp_path):
    """A new manager (after close(), or a trainer restarted) numbers its versions from 0. Before:
    on a disk_dir holding step_1 and step_2 of an earlier run, keep-N took the step_0 it had just
    published for the oldest and hid it, and the engine was told to load a path that was gone
    ('is not a directory'), every sync until the step numbers passed the old ones. Now the first
    sync refuses before anything is written, naming the versions; the earlier run's stay."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.topology import SyncError
    from fsdp_sync.transport.disk import DiskTransport

    cfg, module, d, t = _setup(tmp_path, "full")
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.float32) as real:
        try:
            for step in range(3):
                _sync(t, module, [real], step)
        finally:
            t.close()
        assert _versions(d) == ["step_1", "step_2"]
        served = real.weights_checksum()
        again = DiskTransport(SyncConfig(method="disk", disk_dir=d, dtype=torch.float32,
                                         bucket_bytes=256 << 10, disk_keep=2, layout="full"))
        try:
            _step(module, lambda p: p.add_(1.0))
            with pytest.raises(SyncError, match=r"earlier run at or after this sync's step_0: step_1, step_2"):
                _sync(again, module, [real], 0)
            assert sorted(os.listdir(d)) == ["step_1", "step_2"]        # nothing written, nothing dropped
            assert real.weights_checksum() == served
        finally:
            again.close()
