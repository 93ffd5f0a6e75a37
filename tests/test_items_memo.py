"""`export.resolve` reuses the last sync's items while the module holds the same tensors
(`weights.items_memo`), and works them out again the moment it does not: a reused item that read a
replaced tensor would sync stale weights, so every test here changes the module and checks the
exported bytes against the module's own values, and that the memo missed where it must."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export

from _util import SEED, perturb_

BF16 = torch.bfloat16


def _exported(module, dtype=None) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in export.iter_params(module, dtype=dtype)}


def _truth(module, dtype=None) -> dict[str, torch.Tensor]:
    """The module's own values under their export names (full tensors of DTensors)."""
    out = {}
    for k, v in module.state_dict().items():
        name = export.hf_name(k)
        if name in out or name.rsplit(".", 1)[-1] in export.NON_WEIGHT_BUFFERS:
            continue
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[name] = v if dtype is None or not v.is_floating_point() else v.to(dtype)
    return out


def _same(got: dict, want: dict) -> list[str]:
    """Names whose exported bytes differ from the module's (every name must be exported)."""
    assert set(got) <= set(want), sorted(set(got) - set(want))
    return [n for n in got if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]


def _counts():
    return export._MEMO.hits, export._MEMO.misses


@pytest.fixture
def model():
    m = build_model(load_config("tiny"), seed=SEED)
    perturb_(m.parameters())
    return m


def test_a_second_export_reuses_the_items_and_reads_live_values(model):
    _exported(model)
    h, mi = _counts()
    perturb_(model.parameters())             # a training step: in place, the same tensors
    got = _exported(model, BF16)
    assert _counts() == (h + 1, mi), "an unchanged module was worked out again"
    assert not _same(got, _truth(model, BF16))


@pytest.mark.parametrize("change", ["new parameter", "data swap", "resize", "cast",
                                    "set_ storage", "new buffer"])
def test_any_change_to_the_modules_tensors_works_the_items_out_again(model, change):
    _exported(model)
    up = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        if change == "new parameter":
            up.weight = nn.Parameter(torch.full_like(up.weight, 3.0))
        elif change == "data swap":
            up.weight.data = torch.full_like(up.weight, 5.0)
        elif change == "resize":
            up.weight.data = torch.full((up.weight.shape[0] + 16, up.weight.shape[1]), 9.0)
        elif change == "cast":
            model.double()
        elif change == "set_ storage":         # the same tensor object, other memory
            w = up.weight
            w.set_(torch.full_like(w, 7.0).untyped_storage(), 0, w.shape, w.stride())
        else:
            model.register_buffer("extra_scale", torch.ones(3))
    h, mi = _counts()
    got = _exported(model)
    assert _counts() == (h, mi + 1), f"{change}: the kept items were reused"
    assert not _same(got, _truth(model)), change
    if change == "cast":
        assert {t.dtype for t in got.values() if t.is_floating_point()} == {torch.float64}
    if change == "resize":
        assert got["model.layers.0.mlp.up_proj.weight"].shape[0] == up.weight.shape[0]
    if change == "new buffer":
        assert "extra_scale" in got


def test_a_renamed_submodule_is_exported_under_its_new_name(model):
    _exported(model)
    layers = model.model.layers
    layers[0], layers[1] = layers[1], layers[0]      # the same tensors, in other places
    h, mi = _counts()
    got = _exported(model)
    assert _counts() == (h, mi + 1)
    assert not _same(got, _truth(model))


def test_the_memo_keeps_no_tensor_alive(model):
    """What is kept between syncs holds no data: a parameter the module let go of is freed at once,
    not at the next sync."""
    _exported(model)
    up = model.model.layers[0].mlp.up_proj
    old = weakref.ref(up.weight)
    up.weight = nn.Parameter(up.weight.detach().clone())
    gc.collect()
    assert old() is None, "the memo (or the export) still holds the replaced parameter"


def _fsdp2_changes(rank: int, world: int) -> dict:
    """FSDP2 on ``world`` ranks: in-place updates reuse the items; a swapped local shard, a
    local shard pointed at other memory, and a re-registered parameter work them out again; the
    exported bytes are the module's full tensors every time."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(load_config("tiny"), seed=SEED)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    perturb_(model.parameters())
    out: dict = {"wrong": {}, "counts": {}}

    def step(label: str) -> None:
        h, mi = export._MEMO.hits, export._MEMO.misses
        got = {n: t.clone() for n, t in export.iter_params(model, dtype=BF16)}
        out["counts"][label] = (export._MEMO.hits - h, export._MEMO.misses - mi)
        out["wrong"][label] = _same(got, _truth(model, BF16))

    step("first")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    step("after a training step")
    p = model.model.layers[0].mlp.up_proj.weight
    p._local_tensor = torch.full_like(p._local_tensor, 2.0 + rank)
    step("swapped local shard")
    with torch.no_grad():
        loc = p._local_tensor
        loc.set_(torch.full_like(loc, 4.0 + rank).untyped_storage(), 0, loc.shape, loc.stride())
    step("local shard on other memory")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_reuses_items_through_training_and_not_past_a_swapped_shard(world):
    for res in run_ranks(_fsdp2_changes, world, timeout_s=100, pg_timeout_s=60, env=spawn_env()):
        assert all(not bad for bad in res["wrong"].values()), res["wrong"]
        assert res["counts"] == {"first": (0, 1), "after a training step": (1, 0),
                                 "swapped local shard": (0, 1), "local shard on other memory": (0, 1)}, res["counts"]


def test_submodules_walks_what_modules_walks():
    """`items_memo.submodules` stands in for ``list(module.modules())`` (the FSDP1 unit search,
    `tensors_key`): the same modules, in the same order, a module held twice once, and a child
    slot holding None skipped."""
    from fsdp_sync.weights.items_memo import submodules

    m = build_model(load_config("tiny"), seed=SEED)
    shared = m.model.layers[0].mlp
    m.model.layers[1].register_module("again", shared)       # one module in two places
    m.model.register_module("nothing", None)
    assert [id(x) for x in submodules(m)] == [id(x) for x in m.modules()]
    assert sum(x is shared for x in submodules(m)) == 1


@pytest.mark.parametrize("change", ["new parameter", "removed buffer", "cast", "resize",
                                    "replaced submodule", "new submodule"])
def test_param_metas_follow_any_change_to_the_modules_tensors(model, change):
    """`export.param_metas` is remembered while the module holds the same tensors: after each
    change, the answer is the one worked out from scratch (and differs from the one before)."""
    dtype = None if change == "cast" else BF16
    before = export.param_metas(model, dtype)
    layer = model.model.layers[1]
    with torch.no_grad():
        if change == "new parameter":
            layer.mlp.up_proj.register_parameter("extra", nn.Parameter(torch.ones(4, 2)))
        elif change == "removed buffer":
            model.register_buffer("extra_scale", torch.ones(3))
            before = export.param_metas(model, dtype)
            del model.extra_scale
        elif change == "cast":
            layer.mlp.up_proj.to(torch.float64)             # the same objects, another dtype
        elif change == "resize":
            layer.mlp.up_proj.weight.data = torch.ones(layer.mlp.up_proj.weight.shape[0] + 8, 3)
        elif change == "replaced submodule":
            old = layer.mlp.down_proj
            layer.mlp.down_proj = nn.Linear(old.in_features, old.out_features + 4, bias=False)
        else:
            layer.mlp.register_module("side", nn.Linear(3, 5))
    got = export.param_metas(model, dtype)
    export._METAS.pop(model, None)
    want = export.param_metas(model, dtype)
    assert got == want, change
    assert got != before, change
