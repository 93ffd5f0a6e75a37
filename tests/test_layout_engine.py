"""``SyncConfig.layout="engine"`` end to end: the tensor and distributed methods hand each engine TP
rank only its own shard (per-rank buckets; distributed: one point-to-point send per engine rank
over the update group), and the engine's weights equal the trainer's bit for bit
(``weights_checksum``) with logits equal to the trainer's forward.

One 4-rank job covers FSDP1 and FSDP2, TP 1, 2 and 4 (dp 4 x tp 1, dp 2 x tp 2, dp 1 x tp 4), tied
and untied, a padded vocab, GQA with fewer KV heads than TP ranks (tiny has 2 KV heads: TP 4),
the one-host (shared memory) and the all-to-all path, pipelined (the default) and not; "auto" picks per-rank buckets for the
reference engine and full tensors for an engine that does not accept them; "engine" there is
refused on every rank, naming why, before anything moves. The distributed cases run in the same
job (engine TP 4, 2 and 1 on trainer rank 0 of the 4 trainer ranks).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]


CASES = [
    # (fsdp, recipe, overrides, dp, tp, [SyncConfig overrides per sync])
    (2, "tiny", {"vocab_size": 999}, 1, 4,
     [{"layout": "engine"}, {"layout": "engine", "share_host_memory": False, "pipelined": False}]),
    (1, "tiny-tied", {}, 2, 2,
     [{"layout": "engine", "fsdp1_state_dict": "local", "pipelined": False},
      {"layout": "auto", "fsdp1_state_dict": "sharded", "share_host_memory": False},
      {"layout": "engine", "fsdp1_state_dict": "full"},
      {"layout": "auto", "engine": "no-rank-buckets"}, {"layout": "engine", "engine": "no-rank-buckets"}]),
    (2, "tiny-tied", {}, 4, 1, [{"layout": "engine"}]),
    # method distributed: trainer rank 0 holds an engine of TP `tp` (dp unused: no mesh) and sends
    # each engine TP rank only its shard over the update group
    (2, "tiny", {"vocab_size": 999}, None, 4,
     [{"method": "distributed", "layout": "engine"},
      {"method": "distributed", "layout": "engine", "share_host_memory": False, "pipelined": False}]),
    (1, "tiny-tied", {}, None, 2,
     [{"method": "distributed", "layout": "engine", "fsdp1_state_dict": "local"},
      {"method": "distributed", "layout": "auto", "fsdp1_state_dict": "sharded", "share_host_memory": False},
      {"method": "distributed", "layout": "engine", "fsdp1_state_dict": "full", "pipelined": False},
      {"method": "distributed", "layout": "auto", "engine": "no-rank-buckets"},
      {"method": "distributed", "layout": "engine", "engine": "no-rank-buckets"}]),
    (2, "tiny-tied", {}, None, 1, [{"method": "distributed", "layout": "engine"}]),
]


def _job(rank, world):
    from _util import run_syncs

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    out = []
    for c, (fsdp, recipe, ov, dp, tp, syncs) in enumerate(CASES):
        cfg = load_config(recipe, **ov)
        module = wrap_fsdp(build_model(cfg, seed=c), fsdp)
        opt = torch.optim.SGD(module.parameters(), lr=1e-1)
        if dp is None:        # distributed: no mesh, the engine on trainer rank 0
            mesh, holder = None, rank == 0
        else:
            mesh = make_mesh(dp, tp)
            holder = SyncTopology.from_mesh(mesh).is_tp_src
        engine = ReferenceEngine(model_config=cfg, tp_size=tp, dtype=torch.float32) if holder else None

        def make_manager(wrapped, step, kw):     # called within this case only
            return FSDPShardingManager(module, wrapped, mesh=mesh, config=SyncConfig(
                dtype=torch.float32, bucket_bytes=24 << 10, free_cache_engine=False,
                dist_timeout_s=60, **kw))

        out += run_syncs(rank, c, module, opt, cfg, engine, syncs, prompts=PROMPTS,
                         # as SGLang without fsdp_sync's loader; over the update group, as SGLang always
                         refuses=("accepts_rank_buckets", "accepts_distributed_rank_buckets"),
                         make_manager=make_manager)
        del module, opt
    return out


@pytest.mark.timeout(330)
def test_layout_engine_is_bit_exact_across_fsdp_tp_tied_gqa():
    results = run_ranks(_job, 4, timeout_s=320, env=spawn_env())
    n = sum(len(s) for *_, s in CASES)
    for rank, recs in enumerate(results):
        assert len(recs) == n, rank
        for rec in recs:
            fsdp, recipe, ov, dp, tp, syncs = CASES[rec["case"]]
            distributed = rec["kw"].get("method") == "distributed"
            holder = rank == 0 if distributed else rank % tp == 0
            refused = rec["kw"]["layout"] == "engine" and syncs[rec["step"]].get("engine")
            if refused:
                # refused on every rank, before anything moved: the engine keeps its weights
                flag = "accepts_distributed_rank_buckets" if distributed else "accepts_rank_buckets"
                assert flag in rec["error"] and "layout='engine'" in rec["error"], rec
                assert "layout='full'" in rec["error"], rec      # says what to use instead
                if holder:
                    assert rec["kept"], rec
                continue
            assert "error" not in rec, rec["error"]
            want = "full" if syncs[rec["step"]].get("engine") else "engine"
            assert rec["extra"]["layout"] == want, rec
            assert rec["extra"]["pipelined"] == (want == "engine" and rec["kw"].get("pipelined", True)), rec
            if want == "engine":
                share = rec["kw"].get("share_host_memory", True)
                path = "host-shared" if share else "all-to-all"
                if rec["kw"].get("fsdp1_state_dict") == "full":
                    path = "local"      # every rank holds full tensors: no exchange at all
                assert rec["extra"]["reshard_path"] == path, rec
                # each engine rank is handed its own shard (plus bucket alignment), never the model
                assert rec["extra"]["engine_rank_bytes_in"] <= 1.05 * rec["extra"]["engine_rank_shard_bytes"], rec
            if holder:
                assert rec["exact"], rec                 # every engine weight, bit for bit
                assert rec["diff"] <= 1e-5, rec
            if not distributed:
                _check_call_times(rec, holder, reference=holder and not rec["kw"].get("engine"))


def _check_call_times(rec: dict, holder: bool, reference: bool = False) -> None:
    """Where each engine call's time went (`transport.call_times`, issue 35's profile per bucket):
    a row per call, full layout or per-rank buckets, pipelined or not, on every rank; its phases
    add up to the sums and stay within the sync; the engine's own seconds on the rank that
    called it, and with the reference engine (``reference``) where they went in its workers:
    opening the payloads within staging, the copies and the acknowledgement making up the
    commit, both within the call; per-rank buckets come in buffers the workers keep open, so
    every call after the first one or two (pipelined: two buffers take turns) finds its buffer
    open, and full-layout calls never do."""
    calls, sums = rec["extra"]["calls"], rec["extra"]["call_seconds"]
    assert len(calls) >= 2 and (not holder or len(calls) == rec["engine_calls"]), (len(calls), rec["engine_calls"])
    phases = ("make_s", "gather_s", "engine_s", "agree_s", "release_s")
    for row in calls:
        assert row["what"] and all(row[p] >= 0 for p in phases), row
        assert ("engine_call_s" in row) == holder and (not holder or row["engine_call_s"] > 0), row
        if reference:
            w = {k[len("worker_"):]: v for k, v in row.items() if k.startswith("worker_")}
            assert set(w) == {"stage_s", "open_s", "commit_s", "apply_s", "ack_s", "kept"}, row
            assert 0 < w["open_s"] <= w["stage_s"] and 0 < w["apply_s"] and 0 < w["ack_s"], row
            # each the slowest rank's: on each rank apply + ack is its commit
            assert max(w["apply_s"], w["ack_s"]) <= w["commit_s"] <= w["apply_s"] + w["ack_s"] + 1e-9, row
            assert w["stage_s"] + w["commit_s"] < row["engine_call_s"], row
        else:
            assert not any(k.startswith("worker_") for k in row), row
    if reference:
        kept = sum(row["worker_kept"] for row in calls)
        assert kept >= len(calls) - 2 if rec["extra"]["layout"] == "engine" else kept == 0, calls
    for p in phases:
        assert sums[p] == pytest.approx(sum(row[p] for row in calls), abs=1e-9), p
    assert 0 < sum(sums.values()) <= rec["seconds"], (sums, rec["seconds"])


@pytest.mark.timeout(30)
def test_layout_config_is_validated_naming_the_field():
    from fsdp_sync.config import SyncConfig

    assert SyncConfig().layout == "auto"
    assert SyncConfig.from_dict({"layout": "engine"}).layout == "engine"
    with pytest.raises(ValueError, match=r"layout must be one of .*'rank'"):
        SyncConfig(layout="rank")
    for kw in ({"method": "distributed", "dist_format": "per_tensor"},   # disk: tests/test_disk_layout.py
               {"strategy": "bucketed"}):
        with pytest.raises(ValueError, match="layout='engine'.*use layout='full' or 'auto'"):
            SyncConfig(layout="engine", **kw)
        assert SyncConfig(layout="auto", **kw).layout == "auto"      # falls back to full tensors there
    assert SyncConfig(layout="engine", method="distributed").layout == "engine"   # per-rank sends


@pytest.mark.timeout(30)
def test_sglang_adapter_accepts_rank_buckets_only_when_told():
    from fsdp_sync.engines.sglang import SGLangEngine, SGLangError

    class _Fake:
        def __init__(self):
            self.calls = []

        def update_weights_from_tensor(self, **kw):
            self.calls.append(kw)
            return True, "ok"

    fake = _Fake()
    plain = SGLangEngine(fake, tp_size=2)
    assert plain.accepts_rank_buckets is False
    # its update_weights_from_distributed broadcasts full tensors: never per-rank, loader or not
    assert SGLangEngine(fake, tp_size=2, rank_bucket_loader=True).accepts_distributed_rank_buckets is False
    with pytest.raises(SGLangError, match="--custom-weight-loader"):
        plain.load_rank_bucket(None, [b"a", b"b"])
    assert fake.calls == []


def test_a_vocab_that_does_not_split_evenly_is_padded_as_sglang_pads_it():
    """SGLang's VocabParallelEmbedding pads the vocabulary to 64 and splits it evenly; where that
    does not split (999 -> 1024 over TP 3) it pads to 64 x tp instead (0.5.23; 0.5.12 on CPU):
    1152 rows, 384 a rank. The sglang tier checks this against SGLang's own model at TP 3."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    cfg = load_config("tiny", vocab_size=999, hidden_size=96, intermediate_size=192,
                      num_attention_heads=6, num_key_value_heads=3)
    assert [layout_for(cfg, tp).vocab_shard for tp in (1, 3)] == [1024, 384]   # not 342
    three = layout_for(cfg, 3)
    assert three.engine_shapes()["model.embed_tokens.weight"] == (384, 96)
