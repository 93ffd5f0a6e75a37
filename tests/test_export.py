"""Export from FSDP2, FSDP1 (full / sharded / local) and plain modules: every tensor rebuilt by an
independent consumer process is bit-identical to the unsharded model's state_dict (HF names, cast
to the rollout dtype), per parameter and per flattened bucket, at 2 and 4 ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import _ranks
from _util import ODD_NAMES, SEED, Odd, digest, odd_reference, perturb_, reference
from fsdp_sync.weights import bucket, export, handles
from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.models import build_model, load_config

BF16 = torch.bfloat16
DTYPES = {"none": None, "bfloat16": BF16}


@functools.lru_cache(maxsize=None)
def ref(recipe: str, dtype_key: str) -> dict:
    tied = "lm_head.weight" if recipe == "tiny-tied" else None
    return reference(recipe, DTYPES[dtype_key], tied_alias=tied)


@functools.lru_cache(maxsize=None)
def odd_ref(dtype_key: str) -> dict:
    return odd_reference(DTYPES[dtype_key])


def _as_dict(named: list) -> dict:
    names = [n for n, _ in named]
    assert len(names) == len(set(names)), f"a tensor was exported twice: {names}"
    return {n: d for n, d in named}


def _check(named: list, want: dict, label: str) -> None:
    got = _as_dict(named)
    assert list(got) == list(want), f"{label}: names/order differ"
    bad = [n for n in want if got[n] != want[n]]
    assert not bad, f"{label}: not bit-identical: {bad[:5]} e.g. {got[bad[0]]} != {want[bad[0]]}"


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_ranks.export_2rank, 2, env=spawn_env(), timeout_s=200)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_ranks.export_4rank, 4, env=spawn_env(), timeout_s=220)


# --------------------------------------------------------------------------- 1 rank

@pytest.mark.timeout(150)
def test_one_rank_exports_bit_identical_with_no_collective():
    """A one-rank trainer (FSDP2; FSDP1 local, sharded, full): its shards are the tensors, so the
    export copies (casts) them into place and calls no collective. Through the all-gather it had
    made one per bucket (and per parameter), with a cast copy of the bucket beside it: a one-rank
    qwen2-160m sync rose 298 MiB (budget 175) at 3x the copy floor; now 64 MiB, 0.86x
    (`fsdp-sync bench --models qwen2-160m --strategies flattened --layout full --ranks 1 --tp 1
    --dtype bfloat16 --bucket-mb 64`). A tensor yielded without a cast is a copy, not the shard."""
    (res,) = run_ranks(_ranks.export_1rank, 1, env=spawn_env(), timeout_s=120)
    assert len(res["cases"]) == 16, sorted(res["cases"])
    for key, named in res["cases"].items():
        _check(named, ref("tiny", key.split("/")[2]), key)
        if not key.startswith("fsdp1/full/"):   # FSDP1's full state dict is FSDP's own unshard
            assert res["collectives"][key] == {"all_gather": 0, "broadcast": 0, "full_tensor": 0}, \
                (key, res["collectives"][key])
    assert all(not names for names in res["shares_storage"].values()), res["shares_storage"]


# --------------------------------------------------------------------------- 2 ranks

@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["params", "buckets"])
@pytest.mark.parametrize("dtype", ["none", "bfloat16"])
def test_fsdp2_two_ranks_bit_identical(two_ranks, dtype, mode):
    for rank, res in enumerate(two_ranks):
        _check(res["cases"][f"fsdp2/full/{dtype}/{mode}"], ref("tiny", dtype), f"rank {rank}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["params", "buckets"])
@pytest.mark.parametrize("kind", ["full", "sharded", "local"])
def test_fsdp1_each_state_dict_type_bit_identical(two_ranks, kind, mode):
    for dtype in DTYPES:
        for rank, res in enumerate(two_ranks):
            _check(res["cases"][f"fsdp1/{kind}/{dtype}/{mode}"], ref("tiny", dtype),
                   f"rank {rank} {dtype}")


@pytest.mark.timeout(240)
def test_buckets_are_several_and_one_collective_each(two_ranks):
    res = two_ranks[0]
    assert res["buckets"]["fsdp2/full/bfloat16/buckets"] >= 3
    for key, c in res["collectives"].items():
        assert c["full_tensor"] == 0, (key, c)      # no per-parameter gather anywhere
        if key.startswith("fsdp2"):
            # even dim-0 shards: the whole bucket in ONE all-gather
            assert c["all_gather"] == c["buckets"] and c["broadcast"] == 0, (key, c)
        else:
            # FSDP1 flat shards: a parameter inside one rank's chunk is broadcast from it (one
            # broadcast per run of them, from each of the 2 ranks at most), the straddling rest
            # in at most one all-gather per bucket
            assert c["all_gather"] <= c["buckets"] <= c["all_gather"] + c["broadcast"], (key, c)
            assert c["broadcast"] <= 2 * c["buckets"], (key, c)


@pytest.mark.timeout(240)
def test_tied_embeddings_are_exported_once(two_ranks):
    want = {d: ref("tiny-tied", d) for d in DTYPES}
    assert "lm_head.weight" not in want["none"] and "model.embed_tokens.weight" in want["none"]
    for rank, res in enumerate(two_ranks):
        for key in ("fsdp2-tied/full/bfloat16/params", "fsdp2-tied/full/bfloat16/buckets",
                    "fsdp1-tied/local/bfloat16/buckets", "fsdp1-tied/full/none/params",
                    "fsdp1-tied/sharded/bfloat16/params"):
            _check(res["cases"][key], want[key.split("/")[2]], f"rank {rank} {key}")


@pytest.mark.timeout(240)
def test_param_metas_are_checkpoint_order_without_data(two_ranks):
    for rank, res in enumerate(two_ranks):
        for key, metas in res["metas"].items():
            model, dtype = key.split("/")
            want = ref("tiny-tied" if model.endswith("tied") else "tiny", dtype)
            assert [[n, d[0], d[1]] for n, d in want.items()] == metas, (rank, key)


@pytest.mark.timeout(240)
def test_streams_keep_nothing_they_yielded(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert set(res["lazy"]) >= {"fsdp2/full/params", "fsdp1/local/buckets"}
        assert all(v == [] for v in res["lazy"].values()), (rank, res["lazy"])


@pytest.mark.timeout(240)
def test_fsdp1_state_dict_type_is_restored(two_ranks):
    for res in two_ranks:
        s = res["state_dict_type"]
        sharded = ["SHARDED_STATE_DICT"] * 3    # root + 2 decoder layers
        assert s["before"] == sharded
        assert s["while_suspended"] == sharded   # switched only around state_dict()
        assert s["after_local"] == sharded and s["after_full"] == sharded
        assert s["inside"] == ["LOCAL_STATE_DICT"] * 3
        assert s["raised"] == "boom" and s["after_exception"] == sharded
        assert "'everything'" in s["bad_kind"] and "full" in s["bad_kind"]


# --------------------------------------------------------------------------- 4 ranks

@pytest.mark.timeout(260)
def test_dp2_tp2_payloads_reach_their_tp_src_and_rebuild(four_ranks):
    assert [r["topo"] for r in four_ranks] == [[0, 0, 0, [0, 1]], [0, 1, 0, [0, 1]],
                                               [1, 0, 2, [2, 3]], [1, 1, 2, [2, 3]]]
    for case in ("buckets/bfloat16", "params/none"):
        want = ref("tiny", case.split("/")[1])
        for r in four_ranks:
            seen = r[f"gathered/{case}"]
            if r["rank"] in (0, 2):            # infer-TP rank 0 of each group: its group's payloads
                assert seen and set(seen) == {2}
                for tp_rank, named in r[f"rebuilt/{case}"].items():
                    _check(named, want, f"rank {r['rank']} tp {tp_rank} {case}")
            else:
                assert seen and set(seen) == {None}
                assert r[f"rebuilt/{case}"] is None
            assert r[f"acked/{case}"], (r["rank"], case)
            assert r[f"payloads/{case}"] == [1]     # one serialize per consuming rank, no more


@pytest.mark.timeout(260)
def test_uneven_shards_int_buffers_flat_padding_and_no_shard_at_four_ranks(four_ranks):
    # FSDP2's torch.chunk split leaves the last rank(s) with 0 rows of these parameters
    assert four_ranks[3]["odd_local_fsdp2"] == [[0, 7], [0, 3], [0], [0, 4], [0, 4]]
    assert four_ranks[2]["odd_local_fsdp2"] == [[0, 7], [1, 3], [1], [3, 4], [1, 4]]
    for r in four_ranks:
        assert r["odd_metas"] == {k: ODD_NAMES for k in ("fsdp2", "fsdp1-uop0", "fsdp1-uop1",
                                                          "fsdp1-noshard")}
        assert len(r["odd"]) == 6 + 3 * 18
        for key, named in r["odd"].items():
            _check(named, odd_ref(key.split("/")[2]), f"rank {r['rank']} {key}")


@pytest.mark.timeout(260)
def test_other_placements_fall_back_to_full_tensor(four_ranks):
    for r in four_ranks:
        fb = r["fallback"]
        assert fb["params"] == fb["want"] and fb["buckets"] == fb["want"], r["rank"]
        assert fb["counts"]["full_tensor"] == 4, fb["counts"]   # 2 params x 2 entry points


@pytest.mark.timeout(260)
def test_a_rank_local_error_is_raised_on_every_rank(four_ranks):
    for r in four_ranks:
        for mode, msg in r["errors"].items():
            assert msg is not None and not msg.startswith("unexpected"), (r["rank"], mode, msg)
            assert "export failed on group rank 3" in msg
            assert "'bad' (rank 3)" in msg and "should hold 2 rows" in msg and "(1, 4)" in msg


# --------------------------------------------------------------------------- one process

@pytest.fixture(scope="module")
def plain():
    model = build_model(load_config("tiny"), seed=SEED)
    perturb_(model.parameters())
    return model


@pytest.mark.parametrize("dtype", ["none", "bfloat16"])
def test_plain_module_params_and_buckets(plain, dtype):
    want = ref("tiny", dtype)
    named = [[n, digest(t)] for n, t in export.iter_params(plain, dtype=DTYPES[dtype])]
    _check(named, want, "params")
    named = []
    sizes = []
    for b, flat in export.iter_buckets(plain, 20_000, dtype=DTYPES[dtype]):
        assert flat.is_shared() and flat.numel() == b.nbytes
        sizes.append((b.nbytes, len(b.entries)))
        named.extend([n, digest(t)] for n, t in bucket.unflatten(flat, b.entries))
    _check(named, want, "buckets")
    assert len(sizes) > 3 and all(s <= 20_000 or n == 1 for s, n in sizes)   # oversize: alone
    del flat


def test_plain_tied_module_is_exported_once():
    model = build_model(load_config("tiny-tied"), seed=SEED)
    perturb_(model.parameters())
    named = [[n, digest(t)] for n, t in export.iter_params(model, dtype=BF16)]
    _check(named, ref("tiny-tied", "bfloat16"), "tied")


def test_non_weight_buffers_are_skipped_and_int_buffers_keep_their_dtype():
    m = Odd()
    perturb_(m.parameters())
    assert [x.name for x in export.param_metas(m, BF16)] == ODD_NAMES
    assert {x.name: x.dtype for x in export.param_metas(m, BF16)}["step"] == torch.int64
    named = [[n, digest(t)] for n, t in export.iter_params(m, dtype=BF16)]
    _check(named, odd_ref("bfloat16"), "odd")


def test_wrapper_prefixes_are_stripped():
    class Holder(nn.Module):
        def __init__(self, inner, attr):
            super().__init__()
            setattr(self, attr, inner)

    inner = build_model(load_config("tiny"), seed=SEED)
    perturb_(inner.parameters())
    layer = inner.model.layers[0]
    inner.model.layers[0] = Holder(layer, "_checkpoint_wrapped_module")
    wrapped = Holder(Holder(Holder(inner, "_orig_mod"), "module"), "module")
    keys = list(wrapped.state_dict())
    assert keys[0] == "module.module._orig_mod.model.embed_tokens.weight"
    assert any("_checkpoint_wrapped_module" in k for k in keys)
    named = [[n, digest(t)] for n, t in export.iter_params(wrapped)]
    _check(named, ref("tiny", "none"), "wrapped")


@pytest.mark.parametrize("name, want", [
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight",
     "model.layers.0.mlp.up_proj.weight"),
    ("module._orig_mod.model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.bias",
     "model.layers.1.self_attn.q_proj.bias"),
    ("model.norm.weight", "model.norm.weight"),
    ("model.module.weight", "model.module.weight"),       # only a *leading* "module." is a wrapper
])
def test_hf_name(name, want):
    assert export.hf_name(name) == want


def test_bad_arguments_say_what_was_expected():
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(2, 2))
    m.idx = nn.Parameter(torch.arange(3), requires_grad=False)
    with pytest.raises(TypeError, match=r"cannot cast parameter 'idx' of dtype int64 to bfloat16 \(rank 0\)"):
        export.param_metas(m, BF16)
    with pytest.raises(TypeError, match="'idx'"):
        list(export.iter_params(m, dtype=BF16))
    assert [n for n, _ in export.iter_params(m)] == ["w", "idx"]   # no cast: exported as is
    with pytest.raises(ValueError, match="floating-point torch.dtype, got torch.int8"):
        list(export.iter_params(m, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"one of \('full', 'sharded', 'local'\), got 'shraded'"):
        list(export.iter_buckets(m, 1024, fsdp1_state_dict="shraded"))
    with pytest.raises(ValueError, match=r"alloc\(48\) must return a 1-D uint8 tensor of at least 48"):
        list(export.iter_buckets(m, 1024, alloc=lambda n: torch.empty(n // 2, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="needs an FSDP1 module"):
        with export.state_dict_type(m, "full"):
            pass


def test_bucket_buffers_can_be_shared_without_a_copy():
    m = Odd()
    (b, flat), = export.iter_buckets(m, 1 << 20)
    with handles.make_payloads({"flattened_tensor": flat, "metadata": bucket.sglang_metadata(b)}, 1) as ps:
        assert ps._keep == []      # the buffer was already in shared memory: nothing copied
        got = handles.open_payload(ps.payloads[0], 0)
        assert got.value["flattened_tensor"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        got.ack()
    del flat, got


# --------------------------------------------------------------------------- GPU tier

@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_fsdp2_buckets_on_cuda_with_nccl():
    (named,) = run_ranks(_ranks.export_cuda, 1, backend="nccl", env=spawn_env(), timeout_s=200)
    _check(named, ref("tiny", "bfloat16"), "cuda")
