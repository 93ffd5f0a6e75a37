"""Verify after sync (`SyncConfig.verify`) for every method, and the disk method through the manager.

One 2-rank job (FSDP2 trainer, one TP-2 reference engine on rank 0) runs, per method (tensor with
a mesh, distributed and disk without one): ``verify="full"`` over two syncs with training between
them, ``verify="sample"``, and a sync after which one engine tensor is overwritten with a wrong
value (between the transport's sync and the check): every rank must raise naming that tensor and
its first differing element. The disk method's run doubles as its manager-level test: bit-exact
by checksum after each sync, and ``disk_keep`` versions left on disk. The SGLang adapter's
``/weights_checker`` path runs against `fake_sglang`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.config import SyncConfig
from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.verify import SAMPLE_EVERY, first_difference, select

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import fake_sglang as fake  # noqa: E402

WRONG = "model.layers.0.mlp.down_proj.weight"


def test_select_rotates_and_config_is_checked():
    names = [f"t{i}" for i in range(19)]
    assert select(names, "off", 3) == [] and select(names, "full", 3) == names
    seen: list[str] = []
    for step in range(SAMPLE_EVERY):
        part = select(names, "sample", step)
        assert part == select(names, "sample", step + SAMPLE_EVERY)        # deterministic
        assert 0 < len(part) <= -(-len(names) // SAMPLE_EVERY)
        seen += part
    assert sorted(seen) == sorted(names)                                    # all within 8 syncs
    assert select(names[:3], "sample", 7) == ["t1"]                         # never empty
    assert SyncConfig().verify == "off" and SyncConfig(verify=False).verify == "off"
    assert SyncConfig.from_dict({"verify": "sample"}).verify == "sample"
    for bad in ("on", True, "all", None):
        with pytest.raises(ValueError, match="verify must be one of"):
            SyncConfig(verify=bad)
    a = torch.tensor([1.0, float("nan"), 0.0, 3.0])
    b = a.clone()
    b[2] = -0.0
    assert "flat index 2 of 4" in first_difference(a, b)                    # bits, not ==
    assert "torch.float16" in first_difference(a, b.half())


# --------------------------------------------------------------------------- the 2-rank job

def _listing(d: str) -> list[str]:
    # but the pool of a dropped version's files the next sync reuses (`transport.disk.POOL`)
    return sorted(f for f in os.listdir(d) if f != ".recycle") if os.path.isdir(d) else []


def _verify_job(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from fsdp_sync.weights import export
    from fsdp_sync import make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    dtype = torch.float32
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-1)
    engine = (ReferenceEngine(model_config=cfg, tp_size=2, dtype=dtype, kv_cache_tokens=64)
              if rank == 0 else None)
    mesh = make_mesh(dp=1, infer_tp=2, device_type="cpu")
    n_tensors = len(export.param_metas(module, dtype))
    step = [0]

    def train() -> None:
        step[0] += 1
        train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step[0], rank=rank))

    def exact() -> bool | None:
        mine = checksum_named_tensors(export.iter_params(module, dtype=dtype))   # collective
        return None if engine is None else engine.weights_checksum() == mine

    def manager(method: str, verify: str, tag: str) -> FSDPShardingManager:
        kw: dict = dict(method=method, verify=verify, dtype=dtype, bucket_bytes=32 << 10)
        if method == "tensor":          # the next methods find the engine's weights in place
            kw["free_cache_engine"] = False
        if method == "distributed":
            kw["dist_timeout_s"] = 60
        if method == "disk":
            kw.update(disk_dir=os.path.join(root, f"disk-{tag}"), disk_keep=1)
        eng = engine if method == "tensor" else ([engine] if engine is not None else None)
        return FSDPShardingManager(module, eng, mesh=mesh if method == "tensor" else None,
                                   config=SyncConfig(**kw))

    out: dict = {}
    try:
        for method in ("tensor", "distributed", "disk"):
            rec: dict = {}
            m = manager(method, "full", "full")     # two syncs, training between them
            try:
                for i in range(2):
                    train()
                    with m:
                        pass
                    rec[f"full{i}"] = dict(m.stats.extra, exact=exact())
                rec["listing"] = _listing(os.path.join(root, "disk-full"))
            finally:
                m.close()
            m = manager(method, "sample", "sample")
            try:
                train()
                with m:
                    pass
                rec["sample"] = dict(m.stats.extra, exact=exact())
            finally:
                m.close()
            m = manager(method, "full", "bad")
            real = m.transport.sync

            def corrupt(ctx, real=real):
                real(ctx)
                if engine is not None:      # one engine tensor goes wrong after the sync
                    t = engine.get_weights_by_name(WRONG)
                    t.view(-1)[5] += 1.0
                    engine.update_weights_from_tensor([(WRONG, t)])

            m.transport.sync = corrupt
            try:
                train()
                with m:
                    pass
                rec["bad"] = "no error"
            except SyncError as exc:
                rec["bad"] = str(exc)
            finally:
                m.close()
            out[method] = rec
            dist.barrier()
    finally:
        if engine is not None:
            engine.shutdown()
    out["n_tensors"] = n_tensors
    return out


@pytest.mark.timeout(240)
def test_verify_every_method_and_disk_through_the_manager(tmp_path):
    results = run_ranks(_verify_job, 2, str(tmp_path), timeout_s=230, env=spawn_env())
    n = results[0]["n_tensors"]
    sample = len(select([f"{i}" for i in range(n)], "sample", 0))
    assert 0 < sample < n
    for method in ("tensor", "distributed", "disk"):
        for rank, res in enumerate(results):
            rec = res[method]
            for i in range(2):
                assert rec[f"full{i}"]["verify_tensors"] == n, (method, rank, rec)
                assert rec[f"full{i}"]["verify_s"] > 0
                assert rec[f"full{i}"]["exact"] is (True if rank == 0 else None), (method, rec)
            assert rec["sample"]["verify_tensors"] == sample, (method, rank, rec)
            assert rec["sample"]["exact"] is (True if rank == 0 else None)
            # the wrong tensor is named on every rank, with its first differing element
            assert "verify='full'" in rec["bad"] and repr(WRONG) in rec["bad"], (method, rank, rec)
            assert "flat index 5 of" in rec["bad"], rec["bad"]
            assert "on TP rank 0;" in rec["bad"], rec["bad"]    # column 5 of down_proj: rank 0's
        if method == "disk":     # disk_keep=1: only the newest of the two versions stays
            assert results[0][method]["listing"] == ["step_1"]


def test_rank_digests_match_the_trainers_pieces_and_name_the_rank():
    """`layout.rank_digest`, as a worker computes it from its own parameters and as verify
    recomputes it from a full tensor, agrees on every tensor and rank (tied and untied, TP 1/2/4);
    a wrong replica on one rank only (a norm, which gathering would skip) changes that rank's
    digest only, and so does one wrong element of a sharded tensor."""
    from fsdp_sync.weights.layout import layout_for, rank_digest, shard_state_dict
    from fsdp_sync.models import build_model, load_config

    for tied in (False, True):
        cfg = load_config("tiny")
        cfg.tie_word_embeddings = tied
        full = {n: p.detach() for n, p in build_model(cfg, seed=3).named_parameters()}
        for tp in (1, 2, 4):
            layout = layout_for(cfg, tp)
            shards = [shard_state_dict(full, layout, r) for r in range(tp)]
            names = list(full) + (["lm_head.weight"] if tied else [])

            def engine_side(r, name):
                return rank_digest(layout, name, r, lambda pl: shards[r][pl.engine][pl.dst])

            def trainer_side(r, name):
                t = full.get(name, full["model.embed_tokens.weight"])
                return rank_digest(layout, name, r, lambda pl: t[pl.src])

            for name in names:
                assert [engine_side(r, name) for r in range(tp)] == \
                    [trainer_side(r, name) for r in range(tp)], (tied, tp, name)
            if tp == 2:
                norm = "model.layers.0.input_layernorm.weight"
                shards[1][norm][3] += 1.0           # rank 1's replica only
                assert engine_side(0, norm) == trainer_side(0, norm)
                assert engine_side(1, norm) != trainer_side(1, norm)
                shards[0]["model.layers.1.mlp.down_proj.weight"][0, 2] += 1.0
                name = "model.layers.1.mlp.down_proj.weight"
                assert [engine_side(r, name) == trainer_side(r, name) for r in range(2)] == [False, True]


# --------------------------------------------------------------------------- SGLang

def test_sglang_weights_checker_request_and_unlaid_refusal():
    from fsdp_sync.engines.sglang import SGLangEngine, SGLangError

    with fake.FakeSGLangServer(tp_size=2) as server:
        eng = SGLangEngine(base_url=server.url)
        server.engine.weights = {"model.norm.weight": torch.ones(4)}
        report = eng.weights_checker("checksum")
        assert [r["parallelism_info"]["tp_rank"] for r in report["ranks"]] == [0, 1]
        assert list(report["ranks"][0]["checksums"]) == ["model.norm.weight"]
        assert server.requests[-1][1:] == ("/weights_checker", {"action": "checksum"})
        with pytest.raises(SGLangError, match="hashes each TP rank's own parameters"):
            eng.tensor_checksums(["model.norm.weight"])
        sums = eng.weight_checksums()
        assert (sums["algorithm"], sums["ep_size"]) == ("cpu", 1) and sums["answer"] == eng.weights_checker()
    with fake.FakeSGLangServer(tp_size=1, session_routes=False) as old:
        eng = SGLangEngine(base_url=old.url)
        with pytest.raises(SGLangError, match="has no /weights_checker") as info:
            eng.weights_checker()
        assert info.value.status == 404
        with pytest.raises(SGLangError, match="has no /weights_checker"):
            eng.weight_checksums()
    with pytest.raises(SGLangError, match="in-process sglang.Engine has no weights checker"):
        SGLangEngine(fake.FakeSGLangEngine(tp_size=1)).weights_checker()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe,tp,mode", [("tiny", 2, "full"), ("tiny-qwen3-moe", 2, "sample")])
def test_verify_against_sglangs_weights_checker(tmp_path, recipe, tp, mode):
    """SyncConfig.verify against an SGLang HTTP server: the fake answers /weights_checker as
    SGLang on CPU does (per TP rank, sha256 of each own engine parameter cut by the layout map
    from what it loaded); the trainer recomputes them from its tensors. In sync: no error. An
    engine that kept one stale tensor (a vocab shard, or one expert's gate rows): the error names
    the engine parameter and the TP ranks that hold it."""
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights.layout import layout_for

    cfg = load_config(recipe)
    module = build_model(cfg, seed=0)
    if recipe == "tiny":
        stale, param, ranks = "lm_head.weight", "lm_head.weight", [0, 1]
    else:
        stale, param, ranks = ("model.layers.2.mlp.experts.5.gate_proj.weight",
                               "model.layers.2.mlp.experts.w13_weight", [0, 1])
    with fake.FakeSGLangServer(tp_size=tp, layout=layout_for(cfg, tp)) as server:
        eng = SGLangEngine(base_url=server.url)
        m = FSDPShardingManager(module, eng, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path / "d"), verify=mode))
        syncs = 8 if mode == "sample" else 1      # a sample covers every tensor within 8 syncs
        for _ in range(syncs):
            with m:
                pass
        assert m.stats.extra["verify_tensors"] > 0 and server.hits["/weights_checker"] == syncs
        old = server.engine.weights[stale].clone()
        load = server.engine.update_weights_from_disk

        def keeps_one_stale(*a, **k):           # the engine loads everything but one tensor
            out = load(*a, **k)
            server.engine.weights[stale] = old
            return out

        server.engine.update_weights_from_disk = keeps_one_stale
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)                      # the trainer moves on
        err = None
        for _ in range(syncs):
            try:
                with m:
                    pass
            except SyncError as exc:
                err = str(exc)
                break
        m.close()
    assert err is not None
    assert f"{param!r} on TP rank {ranks[0]}: SGLang hashes" in err, err
    assert f"(and {len(ranks) - 1} more)" in err and "SGLang, /weights_checker" in err, err


def test_streamed_verify_against_served_engine_names_the_stale_tensor():
    """verl's adapter streams its own tensors and checks them after the sync (`check_sent`): over
    HTTP, `fsdp-sync serve` reports the digests (``/fsdp_sync/tensor_checksums``); a tensor the
    engine serves differently is named, one it does not report is named as such."""
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.verify import check_sent, tensor_digest

    with ReferenceEngine("tiny", tp_size=2, seed=3) as engine, EngineServer(engine) as server:
        client = SGLangEngine(base_url=server.url)
        full = dict(engine.named_full_tensors())
        sent = {n: tensor_digest(n, t) for n, t in full.items()}
        err, fig = check_sent(client, sent, "full", 0)
        assert err is None and fig["verify_tensors"] == len(full)
        stale = dict(sent)
        stale[WRONG] = tensor_digest(WRONG, full[WRONG] + 1)
        err, _ = check_sent(client, stale, "full", 0)
        assert err and repr(WRONG) in err and "1 of" in err
        err, fig = check_sent(client, stale, "sample", 1)       # a sample that leaves it out
        names = list(stale)
        assert (WRONG in select(names, "sample", 1)) == (err is not None)
        err, _ = check_sent(client, {**sent, "model.nope": "x"}, "full", 0)
        assert err and "cannot be verified" in err and "model.nope" in err


# --------------------------------------------------------------------------- engines that answer short

def test_tensor_digest_covers_dtype_and_shape_not_only_bytes():
    """Two tensors with the same name and bytes but another shape or dtype are different weights
    (a transposed-shape load, a dtype mix-up): their digests must differ."""
    from fsdp_sync.engines.base import checksum_named_tensors

    t = torch.arange(6, dtype=torch.float32)
    one = checksum_named_tensors([("w", t)])
    assert one == checksum_named_tensors([("w", t.clone())])
    assert one != checksum_named_tensors([("w", t.view(2, 3))])
    assert checksum_named_tensors([("w", t.view(2, 3))]) != checksum_named_tensors([("w", t.view(3, 2))])
    assert one != checksum_named_tensors([("w", t.view(torch.int32))])
    assert one != checksum_named_tensors([("v", t)])


class _ShortChecksums:
    """An engine whose ``tensor_checksums`` silently leaves one requested name out."""

    def __init__(self, full: dict, drop: str):
        self.full, self.drop = full, drop

    def tensor_checksums(self, names):
        from fsdp_sync.verify import tensor_digest

        return {n: tensor_digest(n, self.full[n]) for n in names if n != self.drop}


def test_check_sent_names_a_tensor_the_engine_does_not_report():
    from fsdp_sync.verify import check_sent, tensor_digest

    full = {f"t{i}": torch.full((3,), float(i)) for i in range(4)}
    sent = {n: tensor_digest(n, t) for n, t in full.items()}
    assert check_sent(_ShortChecksums(full, "none"), sent, "full", 0)[0] is None
    err, fig = check_sent(_ShortChecksums(full, "t2"), sent, "full", 5)
    assert err is not None and fig["verify_tensors"] == 4, err
    assert "after sync 5" in err and "1 of 4" in err and "first 't2'" in err, err
    assert "1 not reported at all, e.g. 't2'" in err, err


def test_rank_digests_with_too_few_ranks_fail_verify():
    """A ``rank_digests`` answer with one digest per tensor from a TP-2 engine (one rank's reply
    lost) is not a match, even where that one digest equals rank 0's."""
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.verify import trainer_tensors, verify_engines
    from fsdp_sync.weights.layout import layout_for, rank_digest

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    config = SyncConfig(verify="full", dtype=torch.float32)

    class Stub:
        tp_size = 2
        layout = layout_for(cfg, 2)

        def __init__(self, ranks):
            self.ranks = ranks

        def rank_digests(self, names):
            full = dict(trainer_tensors(module, config, list(names), every=False))
            return {n: [rank_digest(self.layout, n, r, lambda pl: full[n][pl.src]) for r in range(self.ranks)]
                    for n in names}

        def get_weights_by_name(self, name):
            return dict(module.named_parameters())[name].detach()

    err, fig = verify_engines(module, config, [Stub(2)], 0)
    assert err is None and fig["verify_tensors"] > 0, err
    err, _ = verify_engines(module, config, [Stub(1)], 0)
    # said as what it is: too few digests, not a rank whose bytes differ (it named no rank before)
    assert err is not None and ("engine 0 reported 1 per-rank digests of 'model.embed_tokens.weight' "
                                "where its TP 2 needs 2") in err, err
