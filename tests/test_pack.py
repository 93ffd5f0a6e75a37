"""Fused packing (issue 35): every packer of a bucket copies with a fixed number of ops per bucket
(`bucket.copy_many`, `bucket.zero_gaps`), not one ``copy_`` per tensor, and stays bit-exact.

The op count is structural: ``torch.profiler`` on CPU lists the ops Python dispatches; the ops that
move bytes (copies, casts, zeroing) at the top level must not grow with the number of tensors
(on a GPU each is a kernel launch). Bit-exactness is checked against ``copy_`` one tensor at a
time, on real model weights and on every dtype the bucket takes (FP8 and bool included).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import bucket, export, reshard
from fsdp_sync.weights.layout import layout_for, shard_state_dict

pytestmark = pytest.mark.timeout(300)

F8 = torch.float8_e4m3fn
MOVES = {"aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::_foreach_zero_", "aten::fill_",
         "aten::cat", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous"}


def _moves(fn) -> int:
    """Top-level ops that move bytes while ``fn`` runs (a copy inside a fused op is not counted)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events()
               if e.name in MOVES and (e.cpu_parent is None or e.cpu_parent.name not in MOVES))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(dtype: torch.dtype, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def test_copy_many_is_bit_exact_against_copy_one_by_one():
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32,
              torch.uint8, torch.bool, F8, torch.float8_e5m2]
    pairs = []                                    # (dst dtype, src dtype, shape)
    for d in dtypes:
        pairs += [(d, d, (3, 5)), (d, d, ()), (d, d, (0, 4)), (d, d, (7,))]
    normal = torch.randn(6, 9, generator=gen) * 3   # casts: real values, no NaN payloads to compare
    casts = [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
             (F8, torch.float32), (F8, torch.bfloat16), (torch.float32, F8)]
    srcs, dsts, refs = [], [], []
    for dd, sd, shape in pairs:
        srcs.append(_random(sd, shape, gen))
    for dd, sd in casts:
        srcs.append(normal.to(sd))
    # strided both ways: column blocks of 2-D views (the engine layout's row-parallel slices)
    big_src, big_dst = torch.randn(8, 12, generator=gen), torch.zeros(8, 12, dtype=torch.bfloat16)
    srcs += [big_src[:, 3:7], _random(F8, (8, 12), gen)[:, 2:9]]
    kinds = [(dd, shape) for dd, _, shape in pairs] + [(dd, (6, 9)) for dd, _ in casts]
    for (dd, shape), s in zip(kinds, srcs):
        dsts.append(torch.full(shape, 7, dtype=torch.float32).to(dd))
        refs.append(dsts[-1].clone())
    dsts += [big_dst[:, 1:5], torch.zeros(8, 12, dtype=F8)[:, 4:11]]
    refs += [torch.zeros(8, 12, dtype=torch.bfloat16)[:, 1:5], torch.zeros(8, 12, dtype=F8)[:, 4:11]]
    for r, s in zip(refs, srcs):
        r.copy_(s)
    bucket.copy_many(dsts, srcs)
    for i, (d, r) in enumerate(zip(dsts, refs)):
        assert d.dtype == r.dtype and _raw(d) == _raw(r), (i, d.dtype, srcs[i].dtype, tuple(d.shape))
    assert big_dst[:, :1].eq(0).all() and big_dst[:, 5:].eq(0).all()   # nothing outside the views


def test_copy_many_refuses_shapes_that_differ():
    with pytest.raises(ValueError, match=r"destination shape \(4,\) != source shape \(2, 2\)"):
        bucket.copy_many([torch.empty(4)], [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        bucket.copy_many([torch.empty(4), torch.empty(4)], [torch.zeros(4)])


def _model(layers: int, seed: int = 0):
    config = load_config("tiny", num_hidden_layers=layers)
    return config, build_model(config, seed=seed, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_buckets_of_a_real_model_are_bit_exact(dtype):
    """`export.iter_buckets` (the cast copies of `gather.fill_bucket`) against each weight cast
    alone; padding zero (the buffers start full of 0xFF)."""
    _, model = _model(2)
    want = {n: p.detach().to(dtype) for n, p in model.state_dict().items()}
    seen = set()
    for bkt, flat in export.iter_buckets(model, 40_000, dtype=dtype,
                                         alloc=lambda n: torch.full((n,), 255, dtype=torch.uint8)):
        covered = torch.zeros(bkt.nbytes, dtype=torch.bool)
        for e, (name, t) in zip(bkt.entries, bucket.unflatten(flat, bkt.entries)):
            assert _raw(t) == _raw(want[name]), name
            covered[e.start:e.end] = True
            seen.add(name)
        assert flat[:bkt.nbytes][~covered].eq(0).all()
    assert seen == set(want)


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_layout_buckets_of_a_real_model_are_bit_exact(tp):
    """`reshard.iter_rank_buckets` on one process (the blocks of `_write_local`, fused) against
    `layout.shard_state_dict` built with one ``copy_`` per placement."""
    config, model = _model(2)
    layout = layout_for(config, tp)
    full = {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}
    want = [shard_state_dict(full, layout, r) for r in range(tp)]
    seen = set()
    for rb in reshard.iter_rank_buckets(model, layout, 30_000, dtype=torch.bfloat16,
                                        alloc=lambda n: torch.full((n,), 255, dtype=torch.uint8)):
        for r, flat in rb.buffers.items():
            for name, t in bucket.unflatten(flat, rb.bucket.entries):
                assert _raw(t) == _raw(want[r][name]), (r, name)
                seen.add(name)
    assert seen == set(layout.engine_shapes())


def test_ops_per_bucket_do_not_grow_with_the_number_of_tensors():
    """Structural: the ops that move bytes per bucket are the same for 2 and 8 layers of a model
    (4x the tensors) in each packer (before: one ``copy_`` per tensor or block)."""
    counts = {}
    for layers in (2, 8):
        config, model = _model(layers)
        layout = layout_for(config, 2)
        named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items()]
        big = 1 << 30                       # one bucket for the whole model
        plan = bucket.plan_buckets([bucket.TensorMeta.of(n, t) for n, t in named], big)
        assert len(plan) == 1
        out = torch.empty(plan[0].nbytes, dtype=torch.uint8)

        def flat():
            bucket.flatten(plan[0], [t for _, t in named], out=out)

        def full():
            assert len(list(export.iter_buckets(model, big, dtype=torch.bfloat16, alloc=lambda n: torch.empty(n, dtype=torch.uint8)))) == 1

        def engine():
            assert len(list(reshard.iter_rank_buckets(model, layout, big, dtype=torch.bfloat16,
                                                      alloc=lambda n: torch.empty(n, dtype=torch.uint8)))) == 1
        engine()                                    # plans and write lists cached, as in a 2nd sync
        counts[layers] = {"tensors": len(named), "flatten": _moves(flat), "full": _moves(full),
                          "engine": _moves(engine)}
    few, many = counts[2], counts[8]
    assert many["tensors"] >= 3 * few["tensors"], counts
    for packer in ("flatten", "full", "engine"):
        assert many[packer] == few[packer], (packer, counts)
    # flatten: one fused copy (no padding: bf16 tiny's sizes are 16-byte multiples) or + one zero;
    # engine at tp 2: one fused copy, one zero of the gaps per engine rank, the vocab padding rows
    assert few["flatten"] <= 2 and few["full"] <= 2 and few["engine"] <= 8, counts


def _ops(fn) -> int:
    """Top-level ops of any kind (views and slices too) while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def test_host_ops_per_tensor_stay_few():
    """Structural, for the host's work a GPU sync waits on (docs/gpu.md, *The host's work per
    tensor*): each tensor added to a model adds at most three top-level ops of any kind (views
    and slices included, ~3 us each on a CPU) to the one-rank packers (its detached view, its
    flat view, the slice of the bucket it goes to), and each engine entry two to the engine's
    reading of a bucket (a slice of the buffer viewed once per dtype, its shape). Before, the
    per-rank write took 2-D views of the parameter and the piece: 7.75 ops a tensor, and the
    engine three an entry."""
    counts = {}
    for layers in (2, 8):
        config, model = _model(layers)
        layout = layout_for(config, 1)
        big = 1 << 30                       # one bucket for the whole model
        alloc = lambda n: torch.empty(n, dtype=torch.uint8)    # noqa: E731

        def full():
            assert len(list(export.iter_buckets(model, big, dtype=torch.bfloat16, alloc=alloc))) == 1

        def engine():
            assert len(list(reshard.iter_rank_buckets(model, layout, big, dtype=torch.bfloat16, alloc=alloc))) == 1

        (rb,) = reshard.iter_rank_buckets(model, layout, big, dtype=torch.bfloat16, alloc=alloc)
        full()                                      # plans, metas and write lists cached, as in a 2nd sync
        counts[layers] = {"tensors": len(model.state_dict()), "entries": len(rb.bucket.entries),
                          "full": _ops(full), "engine": _ops(engine),
                          "unflatten": _ops(lambda: bucket.unflatten(rb.buffers[0], rb.bucket.entries))}
    few, many = counts[2], counts[8]
    tensors, entries = many["tensors"] - few["tensors"], many["entries"] - few["entries"]
    assert tensors >= 2 * few["tensors"] and entries >= 2 * few["entries"], counts
    for what in ("full", "engine"):
        assert many[what] - few[what] <= 3 * tensors, (what, counts)
    assert many["unflatten"] - few["unflatten"] <= 2 * entries, counts
