"""Per-rank buckets (`reshard.iter_rank_buckets`) and the layout map (`layout`) they are cut by.

Every engine rank's buffer must hold, bit for bit, what the engine's own sharding of the full
tensors gives (`layout.shard_state_dict`, the code the reference engine loads HF tensors with), for
FSDP1 and FSDP2 trainer ranks, TP 1/2/4, tied and untied, GQA with fewer KV heads than TP ranks,
padded vocab rows, on the one-host (shared memory) and the cross-host (all-to-all) path; and an
engine fed these buckets must give transformers' logits.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from fsdp_sync.weights import bucket, handles, reshard
from fsdp_sync.engines import ReferenceEngine, checksum_named_tensors
from fsdp_sync.engines.base import EngineStateError, WeightUpdateError
from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.weights.layout import block_of, layout_for, shard_state_dict
from fsdp_sync.models import build_model, load_config

BF16 = torch.bfloat16
# (recipe, overrides): untied with a vocab SGLang pads (999 -> 1024: padding rows on the last TP rank, uneven FSDP2 rows),
# tied, and Llama with every bias (replicated o_proj/down_proj biases, split gate_up biases)
MODELS = [("tiny", {"vocab_size": 999}), ("tiny-tied", {}),
          ("tiny", {"model_type": "llama", "attention_bias": True, "mlp_bias": True})]
TPS = (1, 2, 4)       # tiny has 2 KV heads: TP 4 replicates each one on two ranks
BUCKET = 24 << 10     # several buckets, so reused host buffers must be rewritten in full


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _reference(recipe, overrides, tp):
    cfg = load_config(recipe, **overrides)
    sd = {k: v.to(BF16) for k, v in build_model(cfg, seed=3).state_dict().items()}
    layout = layout_for(cfg, tp)
    return [{k: _digest(v) for k, v in shard_state_dict(sd, layout, r).items()} for r in range(tp)]


# --------------------------------------------------------------------------- the map (no processes)

@pytest.mark.timeout(60)
def test_every_engine_element_is_filled_once():
    """Sources (the reverse map) plus the vocab padding rows cover each engine parameter of each
    rank exactly once, and a block's src/dst sizes agree."""
    for recipe, ov in MODELS:
        cfg = load_config(recipe, **ov)
        for tp in TPS:
            layout = layout_for(cfg, tp)
            for r in range(tp):
                for ename, shape in layout.engine_shapes().items():
                    hits = torch.zeros(shape, dtype=torch.int32)
                    for hf, pl in layout.sources(r)[ename]:
                        hits[pl.dst] += 1
                        r0, r1, c0, c1 = block_of(pl.src, layout.full_shape(hf))
                        d0, d1, e0, e1 = block_of(pl.dst, shape)
                        assert (r1 - r0, c1 - c0) == (d1 - d0, e1 - e0), (ename, hf)
                    pad = layout.padding(ename, r)
                    if pad is not None:
                        hits[pad] += 1
                    assert hits.min() == 1 and hits.max() == 1, (recipe, tp, r, ename)
    # SGLang's split: vocab padded to a multiple of 64, then even (509 -> 512 -> 4 x 128; 1000 -> 1024 -> 2 x 512)
    assert layout_for(load_config("tiny", vocab_size=509), 4).padding("lm_head.weight", 3) == (slice(125, 128),)
    assert layout_for(load_config("tiny", vocab_size=1000), 2).engine_shapes()["lm_head.weight"] == (512, 64)
    assert layout_for(load_config("tiny", vocab_size=1000), 2).padding("lm_head.weight", 1) == (slice(488, 512),)


@pytest.mark.timeout(60)
def test_cached_plans_are_reused_and_the_buckets_stay_exact():
    """A second sync reuses the cached plan and write lists (nothing is planned again) and its
    buffers hold the NEW weights bit for bit: the cache keeps where bytes go, never the bytes."""
    recipe, ov = MODELS[0]
    cfg = load_config(recipe, **ov)
    module = build_model(cfg, seed=3)
    layout = layout_for(cfg, 2)

    def digests() -> dict:
        got: dict = {}
        for rb in reshard.iter_rank_buckets(module, layout, BUCKET, dtype=BF16):
            for i, flat in rb.buffers.items():
                for name, t in bucket.unflatten(flat, rb.bucket.entries):
                    got.setdefault(i, {})[name] = _digest(t)
        return got

    reshard.clear_plan_cache()
    ref = _reference(recipe, ov, 2)
    assert digests() == dict(enumerate(ref))
    cached = len(reshard._TASK_CACHE)
    assert cached > 1                                   # one write list per bucket
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-0.5).add_(0.25)                     # new weights, same shapes: same plan
    got = digests()
    assert len(reshard._TASK_CACHE) == cached           # nothing planned again
    sd = {k: v.to(BF16) for k, v in module.state_dict().items()}
    assert got == {r: {k: _digest(v) for k, v in shard_state_dict(sd, layout, r).items()} for r in range(2)}
    assert got != dict(enumerate(ref))
    reshard.clear_plan_cache()
    assert not reshard._TASK_CACHE


def test_all_to_all_buffer_pool_reuses_released_buffers():
    """The tensor transport's per-rank buffers (all-to-all path) come from a pool: two buckets in
    flight get two buffers; a released one is handed out again (same memory, still sharable
    without a copy); a bucket larger than the pool's size gets a buffer of its own."""
    from fsdp_sync.transport.buffers import BufferPool

    pool = BufferPool(1024, torch.device("cpu"))
    a, b = pool.take(1000), pool.take(500)
    assert a.data_ptr() != b.data_ptr() and a.numel() == b.numel() == 1024
    pool.give_back([a[:1000]])
    c = pool.take(800)
    assert c.data_ptr() == a.data_ptr() and handles._is_owned(c.untyped_storage())
    d = pool.take(4096)
    assert d.numel() == 4096 and d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    pool.give_back([b, c, d])
    assert len(pool.free) == 3 and not pool.lent


def test_a_buffer_at_the_address_of_a_dead_copied_storage_is_reused():
    """`handles.shared_as_copy` remembered addresses only: an entry left by a storage shared as a
    copy that died unasked matched whatever was allocated there next, so the pool dropped a
    released buffer of its own and allocated a fresh one (seen once in make test: the pool test
    above got another buffer, its own left in /dev/shm). The entry is held weakly now."""
    from torch.multiprocessing import reductions as red

    from fsdp_sync.transport.buffers import BufferPool

    pool = BufferPool(1024, torch.device("cpu"))
    a = pool.take(1000)
    dead = torch.zeros(4).untyped_storage()
    stale = red.StorageWeakRef(dead)
    del dead
    assert stale.expired()
    handles._SHARED_AS_COPY[a.untyped_storage().data_ptr()] = stale   # a dead storage's entry
    pool.give_back([a])
    assert pool.take(800).data_ptr() == a.data_ptr()                   # not dropped for it
    live = pool.take(10)          # a live storage that was shared as a copy is still let go
    handles._SHARED_AS_COPY[live.untyped_storage().data_ptr()] = red.StorageWeakRef(live.untyped_storage())
    assert handles.shared_as_copy(live) and not handles.shared_as_copy(live)
    pool.close()


@pytest.mark.timeout(60)
def test_blocks_of_arbitrary_element_ranges():
    """FSDP1 flat shards start and end mid-row: every range, cut into blocks, lands where the
    full tensor's slice would."""
    full = torch.arange(7 * 10, dtype=torch.float32).view(7, 10)
    for src, dst, eshape in [((slice(2, 5),), (slice(1, 4),), (5, 10)),
                             ((slice(None), slice(3, 8)), (slice(None), slice(0, 5)), (7, 5))]:
        want = torch.zeros(eshape)
        want[dst] = full[src]
        for a, b in [(0, 70), (13, 47), (25, 26), (0, 9), (61, 70), (30, 40)]:
            got = torch.zeros(eshape)
            for blk in reshard._blocks(a, b, (7, 10), src, dst, eshape):
                blk.dst(got).copy_(blk.src(full.view(-1)[a:b]))
            mask = torch.zeros(70, dtype=torch.bool)
            mask[a:b] = True
            sel = torch.zeros(eshape, dtype=torch.bool)
            sel[dst] = mask.view(7, 10)[src]
            assert torch.equal(got[sel], want[sel]) and not got[~sel].any(), (src, a, b)


def test_a_block_that_is_one_run_on_both_sides_is_copied_as_one():
    """`_write_local` copies a block whose elements are one run in the piece and one in the engine
    parameter (whole rows, or part of one row) as two 1-D slices (`_Block.flat`): for every block
    of every range and placement, the run names exactly the elements the 2-D views hold, and a
    block that is not one run on either side has none."""
    full = torch.arange(7 * 10, dtype=torch.float32).view(7, 10)
    cases = [((slice(2, 5),), (slice(1, 4),), (5, 10)),              # rows: q/k/v, vocab
             ((slice(None), slice(3, 8)), (slice(None), slice(0, 5)), (7, 5)),    # columns: o/down
             ((slice(None), slice(0, 10)), (slice(None), slice(10, 20)), (7, 30)),  # rows, wider param
             ((slice(None),), (slice(None),), (7, 10))]              # whole (TP 1, replicated)
    runs = both = 0
    for src, dst, eshape in cases:
        cols = eshape[1]
        for a, b in [(0, 70), (13, 47), (25, 26), (0, 9), (61, 70), (30, 40), (5, 8)]:
            piece = full.view(-1)[a:b]
            for blk in reshard._blocks(a, b, (7, 10), src, dst, eshape):
                param = torch.arange(eshape[0] * cols, dtype=torch.float32).view(eshape)
                view_src, view_dst = blk.src(piece), blk.dst(param)
                run = blk.flat(cols)
                one = (view_src.is_contiguous() or view_src.shape[0] == 1) and \
                      (view_dst.is_contiguous() or view_dst.shape[0] == 1)
                assert (run is not None) == one, (src, dst, a, b, blk)
                if run is None:
                    continue
                s0, d0, n = run
                assert torch.equal(piece[s0:s0 + n], view_src.reshape(-1)), (src, a, b, blk)
                assert torch.equal(param.view(-1)[d0:d0 + n], view_dst.reshape(-1)), (dst, a, b, blk)
                runs += 1
                both += n == b - a
    assert runs > 20 and both > 3          # whole pieces and partial ones were both seen


# --------------------------------------------------------------------------- trainer ranks

def _rank_digests(rank, world):
    import torch.distributed as dist

    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    out = {}
    for fsdp in (1, 2):
        for m, (recipe, ov) in enumerate(MODELS):
            cfg = load_config(recipe, **ov)
            module = wrap_fsdp(build_model(cfg, seed=3), fsdp)
            for tp in TPS:
                layout = layout_for(cfg, tp)
                # "unavailable": group rank 0, which makes the buffers, cannot make shared memory
                # (a torch_shm_manager that cannot start): every rank must take the all-to-all
                # path, none may wait for buffers. "pipelined": the one-host path as a pipelined
                # consumer drives it (two buffer sets, no barrier before writing), with buckets of
                # 72 KiB: bucket 1 writes rows of layers.1's gate_up_proj where lm_head's padding
                # rows (rank 1) lie in bucket 3, which must still come out zero
                modes = (True, False) + (("unavailable",) if (fsdp, m, tp) == (2, 0, 2) else ()) \
                    + (("pipelined",) if (m, tp) == (0, 2) else ())
                for share in modes:
                    st = reshard.ReshardStats()
                    got: dict = {}
                    kept: list[bool] = []      # "pipelined": bucket k's bytes intact once k + 1 is out
                    held: tuple = ()
                    real = reshard._handles.empty_shared
                    if share == "unavailable" and rank == 0:
                        def refuse(*a, **k):
                            raise RuntimeError("torch_shm_manager: cannot start")
                        reshard._handles.empty_shared = refuse
                    piped = share == "pipelined"
                    try:
                        for rb in reshard.iter_rank_buckets(module, layout, 72 << 10 if piped else BUCKET,
                                                            dtype=BF16, share_host_memory=bool(share), stats=st,
                                                            host_sets=2 if piped else 1, consumer_synced=piped):
                            for i, flat in rb.buffers.items():
                                for name, t in bucket.unflatten(flat, rb.bucket.entries):
                                    got.setdefault(i, {})[name] = _digest(t)
                            if piped:
                                if held:
                                    kept.append([_digest(b) for b in held[0]] == held[1])
                                held = (list(rb.buffers.values()), [_digest(b) for b in rb.buffers.values()])
                                dist.barrier()     # the consumer's promise: every rank read bucket k
                            del flat, rb
                    finally:
                        reshard._handles.empty_shared = real
                        del held
                    out[(fsdp, m, tp, share)] = {"got": got, "stats": vars(st), "kept": kept}
            del module
            dist.barrier()
    return out


@pytest.mark.timeout(150)
def test_rank_buckets_are_the_engines_shards_bit_for_bit():
    results = run_ranks(_rank_digests, 2, timeout_s=140, env=spawn_env())
    refs = {(m, tp): _reference(r, ov, tp) for m, (r, ov) in enumerate(MODELS) for tp in TPS}
    assert (2, 0, 2, "unavailable") in results[0]
    for key in results[0]:
        fsdp, m, tp, share = key
        if share == "pipelined":        # each bucket intact while the next was written (3 of 4)
            assert all(res[key]["kept"] == [True] * 3 for res in results), key
        share = share in (True, "pipelined")   # "unavailable": the all-to-all path, checked as such
        ref = refs[(m, tp)]
        held = {}
        for r, res in enumerate(results):
            st = res[key]["stats"]
            assert st["path"] == ("host-shared" if share else "all-to-all"), key
            for i, digests in res[key]["got"].items():
                assert digests == ref[i], (key, r, i)      # every parameter, bit for bit
                held.setdefault(i, []).append(r)
            if share:
                assert st["bytes_in"] == 0
            else:
                # only the bytes this rank's engine shards need come in, never a whole bucket
                shard = st["engine_shard_bytes"]
                assert st["bytes_in"] <= shard * len(res[key]["got"]), (key, st)
                if tp > 1:
                    assert st["bytes_in"] < st["allgather_bytes_in"], (key, st)
        if share:
            assert all(held[i] == [0, 1] for i in range(tp)), key     # one host: all see all
        else:
            # each buffer is held by exactly its owners (colocated rule: group rank r, engine rank r % tp)
            assert held == dict(enumerate(reshard.default_owners(tp, 2))), key


# --------------------------------------------------------------------------- into the engine

@pytest.mark.timeout(120)
def test_engine_loads_rank_buckets_and_matches_transformers():
    """Per-rank buckets go in with ``load_format="direct"`` (one flattened payload per TP rank,
    engine names); logits equal transformers'; a sync that misses a bucket after the weights were
    released is refused at serve time, naming what is missing."""
    prompts = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]
    # TP 1/2/4 bit-exactness is the test above; here the engine at the two hard splits: padded vocab
    # with replicated KV heads (TP 4), and tied embeddings (TP 2)
    for recipe, ov, tps in [("tiny", {"vocab_size": 999}, (4,)), ("tiny-tied", {}, (2,))]:
        cfg = load_config(recipe, **ov)
        model = build_model(cfg, seed=5).eval()
        with torch.no_grad():
            want = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts])
        for tp in tps:
            layout = layout_for(cfg, tp)
            with ReferenceEngine(model_config=cfg, tp_size=tp) as eng:
                eng.release_memory_occupation(["weights"])
                eng.resume_memory_occupation(["weights"])
                buckets = list(reshard.iter_rank_buckets(model, layout, BUCKET, dtype=torch.float32))
                assert len(buckets) > 2
                for n, rb in enumerate(buckets):
                    if n == len(buckets) - 1:
                        with pytest.raises(EngineStateError, match="missing"):
                            eng.forward_logits(prompts)
                    sets = [handles.make_payloads({"flattened_tensor": rb.buffers[i], "metadata": rb.metadata()},
                                                  tp, ranks=[i]) for i in range(tp)]
                    eng.update_weights_from_tensor([s.payloads[0] for s in sets], load_format="direct")
                    for s in sets:
                        s.release()        # raises if a rank did not acknowledge
                got = eng.forward_logits(prompts)
                assert (got - want).abs().max() < 1e-5, (recipe, tp)
                assert eng.weights_checksum() == checksum_named_tensors(model.named_parameters())


# --------------------------------------------------------------------------- the SGLang loader (no sglang)

def _engine_module(layout) -> torch.nn.Module:
    """A module whose parameters are one TP rank's, named as SGLang (and our engine) name them."""
    root = torch.nn.Module()
    for name, shape in layout.engine_shapes().items():
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False))
    return root


@pytest.mark.timeout(60)
def test_sglang_loader_loads_rank_buckets_and_refuses_without_changing_anything():
    from fsdp_sync.engines.sglang.loader import bucket_name, load_rank_buckets

    cfg = load_config("tiny", vocab_size=999)
    model = build_model(cfg, seed=4)
    full = dict(model.state_dict())
    for tp in (2, 4):
        layout = layout_for(cfg, tp)
        buckets = list(reshard.iter_rank_buckets(model, layout, BUCKET, dtype=torch.float32))
        for rank in range(tp):
            target = _engine_module(layout)
            for rb in buckets:
                load_rank_buckets(target, [(bucket_name(rb.bucket), rb.buffers[rank])])
            want = shard_state_dict(full, layout, rank)
            for k, v in target.named_parameters():
                assert torch.equal(v, want[k]), (tp, rank, k)
    # a bucket planned for TP 2 sent to a TP 4 rank: refused before any copy, naming the parameter
    rb2 = next(reshard.iter_rank_buckets(model, layout_for(cfg, 2), BUCKET, dtype=torch.float32))
    target = _engine_module(layout_for(cfg, 4))
    with pytest.raises(ValueError, match=r"expected shape .* for 'model.embed_tokens.weight'.*another tp_size"):
        load_rank_buckets(target, [(bucket_name(rb2.bucket), rb2.buffers[0])])
    assert all(torch.isnan(v).all() for v in target.parameters())
    with pytest.raises(TypeError, match="expected dtype float32"):
        rbh = next(reshard.iter_rank_buckets(model, layout_for(cfg, 4), BUCKET, dtype=BF16))
        load_rank_buckets(target, [(bucket_name(rbh.bucket), rbh.buffers[0])])
    tied = layout_for(load_config("tiny-tied"), 2)
    with pytest.raises(KeyError, match="tied lm_head"):
        load_rank_buckets(_engine_module(tied), [("lm_head.weight", torch.zeros(256, 64))])


def _maps_of(pid: int, segment: str) -> int:
    """How many mappings of shared-memory segment ``segment`` process ``pid`` has."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(segment))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep", [True, False])
def test_engine_keeps_a_reused_rank_buffer_mapped_until_the_update_ends(keep):
    """Per-rank buckets come in the sync's own buffers, reused bucket after bucket: inside
    begin/end each worker maps its buffer once (not once per bucket) and unmaps it at the end;
    outside an update nothing stays mapped; the weights are the model's bit for bit. An engine
    started with ``keep_bucket_buffers=False`` maps each bucket's anew and keeps nothing."""
    cfg = load_config("tiny", vocab_size=999)
    model = build_model(cfg, seed=6)
    full = dict(model.state_dict())
    layout = layout_for(cfg, 2)
    buckets = list(reshard.iter_rank_buckets(model, layout, BUCKET, dtype=torch.float32))
    assert len(buckets) >= 3
    bufs = [handles.empty_shared(max(rb.bucket.nbytes for rb in buckets)) for _ in range(2)]
    segments = [b.untyped_storage()._share_filename_cpu_()[1].decode() for b in bufs]
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32, keep_bucket_buffers=keep)
    try:
        pids = list(engine.worker_pids)

        def load(rb) -> None:
            sets = []
            try:
                for i, buf in enumerate(bufs):
                    view = buf[:rb.bucket.nbytes]
                    view.copy_(rb.buffers[i])
                    sets.append(handles.make_payloads({"flattened_tensor": view, "metadata": rb.metadata()},
                                                      2, ranks=[i], tagged=True))
                engine.load_rank_bucket(rb.bucket, [s.payloads[0] for s in sets])
            finally:
                for s in sets:
                    s.release()

        engine.begin_weight_update()
        for rb in buckets:
            load(rb)
            assert [_maps_of(p, s) for p, s in zip(pids, segments)] == [int(keep)] * 2, rb.index
        engine.end_weight_update()
        assert [_maps_of(p, s) for p, s in zip(pids, segments)] == [0, 0]
        assert checksum_named_tensors(engine.named_full_tensors()) == checksum_named_tensors(full.items())
        load(buckets[0])                 # outside begin/end: nothing is kept
        assert [_maps_of(p, s) for p, s in zip(pids, segments)] == [0, 0]
        # an update that fails lets the buffers go as it aborts, not at an end that may never come
        engine.begin_weight_update()
        load(buckets[1])
        assert [_maps_of(p, s) for p, s in zip(pids, segments)] == [int(keep)] * 2
        with pytest.raises(WeightUpdateError, match="no_such_tensor"):
            engine.update_weights_from_tensor([("no_such_tensor", torch.zeros(3))])
        assert [_maps_of(p, s) for p, s in zip(pids, segments)] == [0, 0]
        engine.end_weight_update(abort=True)
        assert checksum_named_tensors(engine.named_full_tensors()) == checksum_named_tensors(full.items())
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_rank_buckets_with_expert_parallelism_hold_each_ranks_own_experts():
    """EP 2 over TP 4 (rank 0 holds experts 0..3 only): every rank's buffers carry its own experts'
    bits, and a plan cut for EP 1 at the same TP is not reused (the cache is keyed by ep too)."""
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import reshard
    from fsdp_sync.weights.bucket import unflatten
    from fsdp_sync.weights.export import iter_params
    from fsdp_sync.weights.layout import layout_for, shard_state_dict

    cfg = load_config("tiny-qwen3-moe")
    hf = build_model(cfg, seed=3)
    full = {k: v.detach().clone() for k, v in iter_params(hf)}
    for ep in (1, 2):
        layout = layout_for(cfg, 4, ep)
        want = [shard_state_dict(full, layout, r) for r in range(4)]
        seen = 0
        for rb in reshard.iter_rank_buckets(hf, layout, 16 << 10, dtype=torch.float32,
                                            alloc=lambda n: torch.empty(n, dtype=torch.uint8)):
            for r in range(4):
                for name, t in unflatten(rb.buffers[r], rb.bucket.entries):
                    assert torch.equal(t, want[r][name]), (ep, r, name)
                    seen += 1
        assert seen == 4 * len(layout.engine_shapes()), ep


def test_buffers_take_turns_where_the_engine_may_answer_before_every_rank_read():
    """SGLang at TP > 1 answers once its ranks passed a CPU barrier, their copies out of the call's
    buffers possibly still queued on their GPUs: a buffer is handed out again only after the next
    bucket was answered (``lag``). Without it, a released buffer is the next bucket's at once."""
    from fsdp_sync.transport.buffers import BufferPool, ReusedBuffer

    cpu = torch.device("cpu")
    plain, lagged = ReusedBuffer(256, cpu), ReusedBuffer(256, cpu, lag=True)
    seen: dict[str, list[int]] = {"plain": [], "lagged": []}
    for _ in range(4):
        for key, buf in (("plain", plain), ("lagged", lagged)):
            seen[key].append(buf.take(200).data_ptr())
            buf.give_back()
    assert len(set(seen["plain"])) == 1
    a, b = seen["lagged"][:2]
    assert a != b and seen["lagged"] == [a, b, a, b]     # bucket k's buffer again only at k + 2
    pool = BufferPool(256, cpu, lag=True)
    x = pool.take(100)
    pool.give_back([x])
    y = pool.take(100)                                   # x waits for the next release
    assert y.data_ptr() != x.data_ptr()
    pool.give_back([y])
    z = pool.take(100)
    assert z.data_ptr() == x.data_ptr() and pool.pending == [y]
    pool.close()
    assert not pool.free and not pool.pending


def _reads_outlast_rank(rank: int, world: int, flag: bool) -> list[bool]:
    import types

    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.transport.tensor import engine_reads_outlast

    topo = SyncTopology.from_mesh(make_mesh(1, world))
    engine = (types.SimpleNamespace(reads_may_outlast_answer=flag) if topo.is_tp_src else None)
    out = [engine_reads_outlast(engine, topo, on_cuda) for on_cuda in (True, False)]
    # what SGLangEngine says of itself, by its TP size (no server asked: tp_size given)
    said = [SGLangEngine("http://127.0.0.1:9", tp_size=n).reads_may_outlast_answer for n in (1, 2)]
    return out + said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", [True, False])
def test_every_rank_learns_whether_its_engine_may_answer_early(flag):
    """The flag lives with the engine on infer-TP rank 0; every rank of the group packs its own
    engine rank's buffer, so every rank must hear it. Asked only on CUDA (no collective on CPU)."""
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    out = run_ranks(_reads_outlast_rank, 2, flag, timeout_s=100, env=spawn_env())
    assert out == [[flag, False, False, True]] * 2
