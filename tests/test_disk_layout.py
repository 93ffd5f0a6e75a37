"""The disk method with ``SyncConfig.layout="engine"``: per-rank checkpoints.

Each version holds one file per engine TP rank and bucket (``model-rank-{r}-part-{k}.safetensors``)
with only that rank's shard in the engine's layout, and each reference-engine worker reads only its
own files. One 4-rank job (a disaggregated engine held by trainer rank 0) covers FSDP1 and FSDP2,
TP 1, 2 and 4, tied and untied, a padded vocab, GQA with fewer KV heads than TP ranks (tiny has 2 KV
heads: TP 4), the one-host (shared memory), all-to-all and full-tensor (FSDP1 "full") paths; after
every sync the engine's weights equal the trainer's bit for bit (``weights_checksum``), its logits
the trainer's forward, and no engine rank read more than 1.05 x its shard. "auto" falls back to a
Hugging Face checkpoint for an engine that does not load per-rank files; "engine" there is refused
on every rank before anything is written. Single-process tests: corrupt and missing per-rank files
are refused with the old weights serving, and the SGLang adapter is refused (engine) or gets a
Hugging Face checkpoint (auto).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]


CASES = [
    # (fsdp, recipe, overrides, engine tp, [SyncConfig overrides per sync])
    (2, "tiny", {"vocab_size": 999}, 4,
     [{"layout": "engine"}, {"layout": "engine", "share_host_memory": False}]),
    (1, "tiny-tied", {}, 2,
     [{"layout": "engine", "fsdp1_state_dict": "local"},
      {"layout": "auto", "fsdp1_state_dict": "sharded", "share_host_memory": False},
      {"layout": "engine", "fsdp1_state_dict": "full"},
      {"layout": "auto", "engine": "no-rank-files"}, {"layout": "engine", "engine": "no-rank-files"}]),
    (2, "tiny-tied", {}, 1, [{"layout": "engine"}]),
]


def _job(rank, world, root):
    from _util import run_syncs

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    out = []
    for c, (fsdp, recipe, ov, tp, syncs) in enumerate(CASES):
        cfg = load_config(recipe, **ov)
        module = wrap_fsdp(build_model(cfg, seed=c), fsdp)
        opt = torch.optim.SGD(module.parameters(), lr=1e-1)
        engine = ReferenceEngine(model_config=cfg, tp_size=tp, dtype=torch.float32) if rank == 0 else None
        disk_dir = os.path.join(root, f"case{c}")

        def make_manager(wrapped, step, kw):     # called within this case only
            manager = FSDPShardingManager(module, [wrapped] if engine is not None else None,
                                          config=SyncConfig(
                method="disk", disk_dir=disk_dir, dtype=torch.float32, bucket_bytes=24 << 10,
                free_cache_engine=False, **kw))
            manager.step = step      # a fresh manager per sync: name the version by the sync
            return manager

        def files(manager, rec):
            path = manager.stats.extra["path"]
            rec["files"] = sorted(os.listdir(path))
            if os.path.exists(os.path.join(path, "fsdp_sync_manifest.json")):
                import json

                with open(os.path.join(path, "fsdp_sync_manifest.json")) as f:
                    rec["keys"] = sorted({n for e in json.load(f)["files"].values() for n in e.get("names", ())})

        out += run_syncs(rank, c, module, opt, cfg, engine, syncs, prompts=PROMPTS,
                         refuses=("accepts_rank_checkpoints",),  # as SGLang 0.5.23
                         make_manager=make_manager,
                         drop_extra=("pruned",), after_sync=files,
                         watch=lambda: sorted(os.listdir(disk_dir)) if os.path.isdir(disk_dir) else [])
        del module, opt
    return out


@pytest.mark.timeout(300)
def test_disk_layout_engine_is_bit_exact_across_fsdp_tp_tied_gqa(tmp_path):
    results = run_ranks(_job, 4, str(tmp_path), timeout_s=290, env=spawn_env())
    n = sum(len(s) for *_, s in CASES)
    for rank, recs in enumerate(results):
        assert len(recs) == n, rank
        for rec in recs:
            fsdp, recipe, ov, tp, syncs = CASES[rec["case"]]
            no_rank_files = syncs[rec["step"]].get("engine")
            if rec["kw"]["layout"] == "engine" and no_rank_files:
                # refused on every rank before anything was written; the engine keeps its weights
                assert "accepts_rank_checkpoints" in rec["error"], rec
                assert "layout='full'" in rec["error"] and "SGLang 0.5.23" in rec["error"], rec
                assert rec["unchanged"], rec
                if rank == 0:
                    assert rec["kept"], rec
                continue
            assert "error" not in rec, rec["error"]
            extra = rec["extra"]
            want = "full" if no_rank_files else "engine"
            assert extra["layout"] == want, rec
            if want == "engine":
                share = rec["kw"].get("share_host_memory", True)
                path = "host-shared" if share else "all-to-all"
                if rec["kw"].get("fsdp1_state_dict") == "full":
                    path = "local"      # every rank holds full tensors: no exchange at all
                assert extra["reshard_path"] == path, rec
                # each engine rank read its own files only: its shard plus the files' headers
                assert 0 < extra["engine_rank_bytes_in"] <= 1.05 * extra["engine_rank_shard_bytes"], rec
                assert extra["files"] % tp == 0 and extra["files"] // tp > 1, rec     # several parts
                if path != "local":
                    # the engine was told of files while the rest were written (every writer's
                    # bucket k-2 once the stream made bucket k). Hashing them ahead is best effort:
                    # a worker that lags behind (two tests at a time on 2 cores) past the publish
                    # hashes the rest at the load, so fewer may be taken as hashed, never more;
                    # tests/test_disk_ahead.py checks that told files are taken when it keeps up
                    assert 0 < extra["files_told_ahead"] <= extra["files"], rec
                    assert 0 <= extra["files_hashed_ahead"] <= extra["files_told_ahead"], rec
                # FSDP1's full / sharded state dict: torch all-gathered every unit on each rank first
                if path == "all-to-all" or (fsdp == 1 and rec["kw"].get("fsdp1_state_dict", "full") != "local"):
                    assert extra["trainer_rank_bytes_in"] > 0, rec
                else:
                    assert extra["trainer_rank_bytes_in"] == 0, rec
            if rank == 0:
                assert rec["exact"], rec                 # every engine weight, bit for bit
                assert rec["diff"] <= 1e-5, rec
                ranked = [f for f in rec["files"] if f.startswith("model-rank-")]
                if want == "engine":
                    assert len(ranked) == extra["files"] and "model.safetensors.index.json" not in rec["files"]
                    assert {f.split("-")[2] for f in ranked} == {str(i) for i in range(tp)}, rec
                    # SGLang's sharded_state keys: a tied embedding is saved as lm_head.weight
                    tied = recipe == "tiny-tied"
                    assert ("lm_head.weight" in rec["keys"]) and (
                        ("model.embed_tokens.weight" in rec["keys"]) != tied), rec["keys"]
                else:
                    assert not ranked and "model.safetensors.index.json" in rec["files"], rec


# --------------------------------------------------------------------------- one process

def _sync(module, engines, d, step, **kw):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    sc = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=48 << 10, **kw)
    ctx = SyncContext(module=module, config=sc, topo=None, group=None, engines=engines, step=step,
                      stats=SyncStats())
    DiskTransport(sc).sync(ctx)
    return ctx.stats


@pytest.mark.timeout(120)
def test_corrupt_or_missing_rank_file_is_refused_and_old_weights_serve(tmp_path):
    from safetensors.torch import load_file

    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import WeightUpdateError, checksum_named_tensors
    from fsdp_sync.weights.hf_checkpoint import MANIFEST_FILE, CheckpointError, resolve_ranked
    from fsdp_sync.weights.layout import layout_for, shard_state_dict
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny", vocab_size=999)
    module = build_model(cfg, seed=5)
    with ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) as engine:
        stats = _sync(module, [engine], str(tmp_path / "v"), 0)
        good = stats.extra["path"]
        assert stats.extra["layout"] == "engine"
        assert engine.weights_checksum() == checksum_named_tensors(module.state_dict().items())
        # rank 1's files hold exactly rank 1's shard, in engine names (vocab padding rows zero)
        shard = shard_state_dict(module.state_dict(), layout_for(cfg, 2), 1)
        got = {}
        for f in sorted(os.listdir(good)):
            if f.startswith("model-rank-1-"):
                got.update(load_file(os.path.join(good, f)))
        assert sorted(got) == sorted(shard) and all(torch.equal(got[k], shard[k]) for k in shard)
        # the manifest was written last
        mtimes = {f: os.stat(os.path.join(good, f)).st_mtime_ns for f in os.listdir(good)}
        assert mtimes[MANIFEST_FILE] == max(mtimes.values())

        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
        served = engine.weights_checksum()
        bad_cases = {}
        for what in ("corrupt", "missing", "torn", "wrong-tp"):
            d = str(tmp_path / what)
            shutil.copytree(good, d)
            victim = os.path.join(d, "model-rank-1-part-2.safetensors")
            if what == "corrupt":             # one data byte flipped: its sha256 differs
                with open(victim, "r+b") as f:
                    f.seek(-3, os.SEEK_END)
                    b = f.read(1)
                    f.seek(-3, os.SEEK_END)
                    f.write(bytes([b[0] ^ 0xFF]))
            elif what == "missing":
                os.remove(victim)
            elif what == "torn":
                with open(victim, "r+b") as f:
                    f.truncate(os.path.getsize(victim) // 2)
            bad_cases[what] = d
        expect = {"corrupt": "checksum mismatch", "missing": "missing shard model-rank-1-part-2",
                  "torn": "checksum mismatch", "wrong-tp": "for 2 engine TP ranks, this engine has 4"}
        for what, d in bad_cases.items():
            if what == "wrong-tp":        # the engine's first check (no TP-4 engine started here)
                with pytest.raises(CheckpointError, match=expect[what]):
                    resolve_ranked(d, 4)
                continue
            with pytest.raises(WeightUpdateError, match=expect[what]):
                engine.update_weights_from_disk(d)
            assert engine.weights_checksum() == served, what      # nothing was applied
        engine.update_weights_from_disk(good)                     # the engine still loads
        assert engine.weights_checksum() == served
        # a rank's bytes read: its own files only (header + shard)
        assert max(engine.disk_bytes_read) <= 1.05 * layout_for(cfg, 2).engine_bytes(4)


@pytest.mark.timeout(120)
def test_sglang_adapter_is_refused_per_rank_files_and_auto_writes_hf(tmp_path):
    import fake_sglang as fake

    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    cfg = load_config("tiny")
    module = build_model(cfg, seed=2)
    eng = fake.FakeSGLangEngine(tp_size=2)
    adapter = SGLangEngine(eng)
    d = str(tmp_path / "v")
    with pytest.raises(SyncError, match=r"layout='engine' with method='disk'.*SGLangEngine.*SGLang "
                                        r"0\.5\.23 cannot load per-rank files.*use layout='full'"):
        _sync(module, [adapter], d, 0, layout="engine")
    assert not os.path.exists(d) or os.listdir(d) == []             # nothing was written
    assert not [c for c in eng.calls if c[0] == "update_weights_from_disk"]
    stats = _sync(module, [adapter], d, 0, layout="auto")
    assert stats.extra["layout"] == "full" and "engine_rank_shard_bytes" not in stats.extra
    assert eng.calls[-1][0] == "update_weights_from_disk"
    assert all(torch.equal(eng.weights[n], t) for n, t in module.state_dict().items())


@pytest.mark.timeout(30)
def test_config_takes_layout_engine_with_disk():
    from fsdp_sync.config import SyncConfig

    assert SyncConfig(layout="engine", method="disk", disk_dir="/tmp/x").layout == "engine"
    assert SyncConfig(layout="engine", method="distributed").layout == "engine"   # per-rank sends
    with pytest.raises(ValueError, match="layout='engine'.*use layout='full' or 'auto'"):
        SyncConfig(layout="engine", method="distributed", dist_format="per_tensor")
