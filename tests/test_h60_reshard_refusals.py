"""Per-rank buckets refuse, before any buffer is filled, what they cannot send exactly (H60's
mutation pass: each check below was dropped without any test failing):

- a layout tensor the module holds in an integer dtype is never cast to the engine's float dtype
  silently: refused naming it, its dtype and the engine's;
- a module of several float dtypes with no ``dtype=`` is refused naming them (no dtype picked
  for the engine by chance);
- ``ranks`` naming an engine rank outside ``[0, tp)`` is refused naming it and the range (it
  would get a buffer of zeros).

In process: a plain module (the local path), no engine, no process group.
"""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import reshard
from fsdp_sync.weights.layout import layout_for


def _model():
    cfg = load_config("tiny", num_hidden_layers=1)
    return cfg, build_model(cfg, seed=7)


def _host(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_an_integer_layout_tensor_is_refused_not_cast():
    cfg, model = _model()
    norm = model.model.norm
    del norm.weight
    norm.register_buffer("weight", torch.ones(cfg.hidden_size, dtype=torch.int32))
    with pytest.raises(TypeError, match=re.escape("'model.norm.weight' has dtype int32; the engine's "
                                                  "weights are bfloat16")):
        next(reshard.iter_rank_buckets(model, layout_for(cfg, 2), 64 << 10, dtype=torch.bfloat16, alloc=_host))


def test_several_float_dtypes_without_a_dtype_are_refused_naming_them():
    cfg, model = _model()
    model.model.norm.to(torch.float16)
    with pytest.raises(TypeError, match=re.escape("several dtypes ['torch.float16', 'torch.float32']: pass dtype=")):
        next(reshard.iter_rank_buckets(model, layout_for(cfg, 2), 64 << 10, alloc=_host))
    # with the engine's dtype given, each tensor is cast to it (nothing refused)
    rb = next(reshard.iter_rank_buckets(model, layout_for(cfg, 2), 64 << 10, dtype=torch.float32, alloc=_host))
    assert sorted(rb.buffers) == [0, 1]


@pytest.mark.parametrize("ranks", [[0, 2], [-1]])
def test_ranks_outside_the_engines_tp_are_refused_naming_them(ranks):
    cfg, model = _model()
    with pytest.raises(ValueError, match=re.escape(f"ranks must name engine ranks in [0, 2), got {sorted(ranks)}")):
        next(reshard.iter_rank_buckets(model, layout_for(cfg, 2), 64 << 10, dtype=torch.float32,
                                       alloc=_host, ranks=ranks))


def test_kept_one_host_buffers_are_reused_only_while_they_fit():
    """``host_keep``: a later sync takes the buffers an earlier one left only when every rank's
    are as many and at least as large as this sync needs; else new ones are made (here one rank:
    none, the caller gathers). H60's mutation pass: reusing them on the group alone survived every
    reshard test (a larger bucket then wrote past them, more buffer sets indexed past the list).
    One process, a one-rank gloo group."""
    import torch.distributed as dist

    from fsdp_sync.topology import cpu_group
    from fsdp_sync.weights.hostbuf import HostShared

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        old = HostShared(cpu_group(group), 0, [torch.zeros(64, dtype=torch.uint8) for _ in range(2)])
        keep = [old]
        assert reshard._host_buffers(group, 2, 64, keep) is old and keep == [old]     # fits: reused
        for count, nbytes in [(2, 65), (4, 64)]:          # a larger bucket; more buffer sets
            keep = [old]
            assert reshard._host_buffers(group, count, nbytes, keep) is None and keep == [], (count, nbytes)
    finally:
        dist.destroy_process_group()


def test_a_cached_plan_is_given_only_to_a_layout_of_its_own_class():
    """The plan cache was keyed by spec, TP, EP, dtype and bucket size alone: an `FP8Layout` asked
    after a `TPLayout` of the same model got the plain layout's plan (its names and shapes, none
    of the FP8 scales). No caller hands reshard an FP8Layout today (the FP8 stream quantizes each
    bucket after), so this was latent (H60); the key names the layout's class now."""
    from fsdp_sync.weights import fp8

    cfg = load_config("tiny-fp8")
    plain = layout_for(cfg, 1)
    quant = fp8.FP8Layout(plain.spec, 1)
    reshard.clear_plan_cache()
    try:
        for layout in (plain, quant):
            planned = {e.name: e.shape for b in reshard.plan_rank_buckets(layout, torch.bfloat16, 1 << 20)
                       for e in b.entries}
            assert planned == {n: tuple(s) for n, s in layout.engine_shapes().items()}, type(layout).__name__
    finally:
        reshard.clear_plan_cache()
