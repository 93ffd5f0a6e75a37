"""A trainer whose model config ties lm_head to embed_tokens (``tie_word_embeddings=True``, like
Qwen2.5-0.5B) but whose ``lm_head`` the user gave a Parameter of its own: the engine's head is its
embedding, so a sent or written ``lm_head.weight`` would be dropped and the engine would serve other
logits than the trainer's. Every method and layout refuses it on every rank, naming both tensors,
with the engine's weights unchanged and (disk) no version published; a head that equals the
embedding bit for bit (two Parameters) or IS it (one Parameter) syncs on every path and serves the
trainer's logits (`fsdp_sync.weights.tied`).

One 1-process job (every method and layout against one engine), and 2-rank jobs without an engine
for FSDP2 (shards split alike: compared in place), FSDP1 (flat parameters at other offsets: the
chunked gather) and FSDP1 ``"full"`` (whole tensors), plus one FSDP2 manager with a TP-2 engine.

The engine's own check (`engines.reference.tied_head`) compares a sent head with the embedding the
update leaves, bit for bit: it used to compare at the head, with the embedding loaded then, so a
consistent update was refused as "untied" where the head came first (sorted names, as a sorted
dict or a safetensors file gives them; or an earlier call of the transaction) or where the
embedding held a NaN (``torch.equal`` is False for NaN). Tested straight against TP-1 and TP-2
engines."""

from __future__ import annotations

import os

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.engines import ReferenceEngine, WeightUpdateError
from fsdp_sync.models import build_model, load_config

PROMPTS = [[1, 2, 3, 4, 5]]
METHODS = ("tensor", "distributed", "disk")


def _untie(model, scale: float = 1.0):
    """Give ``model`` an lm_head Parameter of its own: ``scale`` 1 keeps its values bit for bit."""
    emb = model.model.embed_tokens.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(emb.clone() if scale == 1.0 else emb * scale)
    return model


def _one_process(rank, world, disk_root):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny-tied")
    out = {}

    def sync(model, engine, method, layout, key):
        d = os.path.join(disk_root, key)
        kw = dict(method=method, layout=layout, dtype=torch.float32, free_cache_engine=False)
        if method == "disk":
            kw["disk_dir"] = d
        before = engine.weights_checksum()
        m = FSDPShardingManager(model, engine, mesh=make_mesh(1, 1) if method == "tensor" else None,
                                config=SyncConfig(**kw))
        res = {}
        try:
            with m:
                with torch.no_grad():
                    ref = model(input_ids=torch.tensor(PROMPTS)).logits[0, -1]
                got = engine.forward_logits(PROMPTS)[0].float()
                res["logit_diff"] = float((got - ref).abs().max())
                res["layout"] = m.stats.extra.get("layout")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            res["raised"] = f"{type(exc).__name__}: {exc}"
        finally:
            m.close()
        res["engine_kept"] = engine.weights_checksum() == before
        res["published"] = sorted(os.listdir(d)) if os.path.isdir(d) else []
        out[key] = res

    with ReferenceEngine(model_config=cfg, tp_size=1) as engine:
        for method in METHODS:
            for layout in ("auto", "engine", "full"):
                sync(_untie(build_model(cfg, seed=0), 2.0), engine, method, layout, f"differs-{method}-{layout}")
            for layout in ("engine", "full"):
                sync(_untie(build_model(cfg, seed=1)), engine, method, layout, f"equal-{method}-{layout}")
                sync(build_model(cfg, seed=2), engine, method, layout, f"one-{method}-{layout}")
    return out


@pytest.mark.timeout(300)
def test_every_method_and_layout_refuses_a_head_the_tied_engine_would_drop(tmp_path):
    (r,) = run_ranks(_one_process, 1, str(tmp_path), timeout_s=280, env=spawn_env())
    for method in METHODS:
        for layout in ("auto", "engine", "full"):
            res = r[f"differs-{method}-{layout}"]
            msg = res.get("raised", "")
            assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in msg, (method, layout, res)
            assert "tie_word_embeddings=True" in msg, (method, layout, msg)
            assert res["engine_kept"], (method, layout, res)
            assert not [p for p in res["published"] if p.startswith("step_")], (method, layout, res)
            # refused by the trainer (the manager's check, every method and layout), before
            # anything moved; the full layout used to reach the engine, which refused after bucket 0
            # (and SGLang, which skips a tied model's lm_head, took it silently)
            assert "nothing was sent or written" in msg and "tie_weights()" in msg, (method, layout, msg)
            assert "first difference at [0, 0]" in msg, msg
        for layout in ("engine", "full"):
            for kind in ("equal", "one"):
                res = r[f"{kind}-{method}-{layout}"]
                assert "raised" not in res, (kind, method, layout, res)
                assert res["layout"] == layout and res["logit_diff"] < 1e-4, (kind, method, layout, res)


# --------------------------------------------------------------------------- 2 ranks, no engine

def _two_ranks(rank, world, wrap, state_dict):
    import torch.distributed as dist

    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import agree
    from fsdp_sync.weights import reshard, tied
    from fsdp_sync.weights.layout import layout_for

    torch.set_num_threads(1)
    tied.CHUNK_BYTES = 4096           # several chunks on the gather path (the embedding is 64 KiB)
    cfg = load_config("tiny-tied")
    out = {}
    for case in ("equal", "last", "one"):
        model = build_model(cfg, seed=0)
        if case != "one":
            _untie(model)
        if case == "last":            # one element of the last row: found past the first chunks
            with torch.no_grad():
                model.lm_head.weight[-1, -1] += 1.0
        if wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                         device_id=torch.device("cpu"), use_orig_params=True)
        layout = layout_for(cfg, 2)
        res = {}
        for path in ("reshard", "module"):
            try:
                if path == "reshard":
                    n = sum(1 for _ in reshard.iter_rank_buckets(model, layout, 16 << 10, dtype=torch.float32,
                                                                fsdp1_state_dict=state_dict))
                    res[path] = f"ok {n}"
                else:       # as the disk method's full layout calls it: then one status all-reduce
                    agree(tied.module_refusal(model, fsdp1_state_dict=state_dict, dtype=None), what="check")
                    res[path] = "ok"
            except Exception as exc:  # noqa: BLE001 - the test reads it
                res[path] = f"{type(exc).__name__}: {exc}"
        out[case] = res
        dist.barrier()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrap,state_dict", [("fsdp2", "local"), ("fsdp1", "local"), ("fsdp1", "full")])
def test_two_ranks_refuse_on_every_rank_and_take_an_equal_head(wrap, state_dict):
    results = run_ranks(_two_ranks, 2, wrap, state_dict, timeout_s=220, env=spawn_env())
    vocab, hidden = 512, 64           # tiny-tied
    for rank, r in enumerate(results):
        for case in ("equal", "one"):
            assert r[case]["reshard"].startswith("ok ") and r[case]["module"] == "ok", (rank, case, r)
        for path in ("reshard", "module"):
            refused = r["last"][path]
            # FSDP1 "full": every rank holds both whole and refuses alone (no shard group)
            kind = "ValueError: " if (state_dict, path) == ("full", "reshard") else "SyncError: "
            assert refused.startswith(kind), (rank, path, refused)
            assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in refused, (rank, path, refused)
            # the last element (in group rank 1's shard under FSDP2; past the first chunks under FSDP1)
            assert f"first difference at [{vocab - 1}, {hidden - 1}]" in refused, (rank, path, refused)
    for path in ("reshard", "module"):
        assert results[0]["last"][path] == results[1]["last"][path]


def _fsdp2_manager(rank, world, method, disk_root):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.cli.trainer import synthetic_batch, wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny-tied")
    model = wrap_fsdp(_untie(build_model(cfg, seed=0)), 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = synthetic_batch(cfg.vocab_size, step=0, rank=rank)
    model(input_ids=ids, labels=ids).loss.backward()    # the head trained apart from the embedding
    opt.step()
    engine = ReferenceEngine(model_config=cfg, tp_size=2) if rank == 0 else None
    out = {}
    try:
        before = engine.weights_checksum() if engine is not None else None
        if method == "tensor":      # the default layout ("auto": per-rank buckets), TP 2
            m = FSDPShardingManager(model, engine, mesh=make_mesh(1, 2), config=SyncConfig(free_cache_engine=False))
        else:                       # Hugging Face files, the engine held by trainer rank 0
            m = FSDPShardingManager(model, [engine] if engine is not None else None, config=SyncConfig(
                method="disk", layout="full", disk_dir=disk_root, free_cache_engine=False))
        try:
            with m:
                out["raised"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["raised"] = f"{type(exc).__name__}: {exc}"
        m.close()
        out["engine_kept"] = engine.weights_checksum() == before if engine is not None else True
        out["published"] = sorted(os.listdir(disk_root))
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_fsdp2_refuses_a_head_trained_apart_on_every_rank(method, tmp_path):
    """The audit's cases: FSDP2, one training step; the tensor method with the default layout,
    the disk method writing Hugging Face files."""
    results = run_ranks(_fsdp2_manager, 2, method, str(tmp_path), timeout_s=220, env=spawn_env())
    for rank, r in enumerate(results):
        assert r["raised"] and "'lm_head.weight' differs from 'model.embed_tokens.weight'" in r["raised"], (rank, r)
        assert "tie_word_embeddings=True" in r["raised"] and r["engine_kept"], (rank, r)
        assert "nothing was sent or written" in r["raised"] and r["published"] == [], (rank, r)
    assert results[0]["raised"] == results[1]["raised"]


# --------------------------------------------------------------------------- the engine's own check

EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tied_engine(request):
    with ReferenceEngine(model_config=load_config("tiny-tied"), tp_size=request.param, kv_cache_tokens=64) as e:
        yield e


def _tied_state(seed: int) -> dict:
    """A tied model's tensors (lm_head IS the embedding), each its own copy."""
    sd = build_model(load_config("tiny-tied"), seed=seed).state_dict()
    assert sd[HEAD].data_ptr() == sd[EMB].data_ptr()
    return {n: t.detach().clone() for n, t in sd.items()}


def _emb(engine):
    return engine.get_weights_by_name(EMB)


@pytest.mark.timeout(120)
def test_a_head_before_its_embedding_in_one_call_is_consistent(tied_engine):
    sd = _tied_state(3)
    tied_engine.update_weights_from_tensor(sorted(sd.items()))      # lm_head.weight first
    assert torch.equal(_emb(tied_engine), sd[EMB])
    # a NaN in the embedding (so in the head): the same bits, not "untied"
    sd[EMB][3, 5] = sd[HEAD][3, 5] = float("nan")
    tied_engine.update_weights_from_tensor(list(sd.items()))
    assert torch.isnan(_emb(tied_engine)[3, 5])
    # a head that does differ is still refused, first or last, and changes nothing
    before = tied_engine.weights_checksum()
    for order in (sorted, list):
        bad = dict(_tied_state(4))
        bad[HEAD] = bad[HEAD] * 2
        with pytest.raises(WeightUpdateError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
            tied_engine.update_weights_from_tensor(order(bad.items()))
        assert tied_engine.weights_checksum() == before
    # ... and so is a head whose bits differ though its values equal (-0.0 against 0.0)
    bad = dict(_tied_state(4))
    bad[EMB][0, 0], bad[HEAD] = 0.0, bad[EMB].clone()
    bad[HEAD][0, 0] = -0.0
    with pytest.raises(WeightUpdateError, match="differs"):
        tied_engine.update_weights_from_tensor(list(bad.items()))


@pytest.mark.timeout(120)
def test_a_head_before_its_embedding_across_calls_of_one_transaction(tied_engine):
    sd = _tied_state(5)
    rest = [(n, t) for n, t in sd.items() if n != HEAD]
    tied_engine.begin_weight_update()
    tied_engine.update_weights_from_tensor([(HEAD, sd[HEAD])])       # an earlier bucket
    tied_engine.update_weights_from_tensor(rest)
    assert tied_engine.end_weight_update(weight_version="five") is True
    assert torch.equal(_emb(tied_engine), sd[EMB]) and tied_engine.get_weight_version() == "five"
    # the head alone in a transaction that sends no embedding: compared with the loaded one at
    # the commit, equal here
    tied_engine.begin_weight_update()
    tied_engine.update_weights_from_tensor([(HEAD, sd[HEAD].clone())])
    assert tied_engine.end_weight_update() is True
    # a differing head an earlier call sent: refused when the embedding comes, nothing committed
    before = tied_engine.weights_checksum()
    other = _tied_state(6)
    tied_engine.begin_weight_update()
    tied_engine.update_weights_from_tensor([(HEAD, other[HEAD] + 1)])
    with pytest.raises(WeightUpdateError, match="differs .*an earlier call"):
        tied_engine.update_weights_from_tensor([(n, t) for n, t in other.items() if n != HEAD])
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        tied_engine.end_weight_update()
    assert tied_engine.weights_checksum() == before
    # ... and one no embedding follows: refused at the commit, on every rank, nothing committed
    tied_engine.begin_weight_update()
    tied_engine.update_weights_from_tensor([(HEAD, sd[HEAD] + 1)])
    tied_engine.update_weights_from_tensor([("model.norm.weight", other["model.norm.weight"])])
    with pytest.raises(WeightUpdateError, match="nothing was committed.*differs .*the loaded embedding"):
        tied_engine.end_weight_update(weight_version="bad")
    assert tied_engine.weights_checksum() == before and tied_engine.get_weight_version() == "five"
    assert len(tied_engine.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2     # still serves


@pytest.mark.timeout(120)
def test_a_head_alone_outside_a_transaction_is_compared_with_the_loaded_embedding(tied_engine):
    # (H59: mutant T7, this comparison skipped, survived every test)
    sd = _tied_state(7)
    tied_engine.update_weights_from_tensor(list(sd.items()))
    tied_engine.update_weights_from_tensor([(HEAD, sd[EMB].clone())])      # equal: taken
    before = tied_engine.weights_checksum()
    with pytest.raises(WeightUpdateError, match="'lm_head.weight' differs .*the loaded embedding"):
        tied_engine.update_weights_from_tensor([(HEAD, sd[EMB] + 1)])
    assert tied_engine.weights_checksum() == before
    assert torch.equal(_emb(tied_engine), sd[EMB])
