"""The reference engine serving block-FP8 weights (``quantization="fp8"``, SGLang's
``--quantization fp8``), for ``tiny-fp8`` at TP 1 and 2 and ``tiny-fp8-moe`` at TP 2 / EP 2, one
engine per case shared by the module:

- its start-up weights are `fp8.quantize_block` of the same random draws an unquantized engine
  makes; every quantized weight is stored as float8_e4m3fn with a float32 ``weight_scale_inv``,
  its memory accounting counts 1 byte per weight element;
- the trainer's stream (HF names, each quantized weight as fp8 plus its scale) loads bit for bit:
  read back (``get_weights_by_name``, checksums, per-rank digests) it is the quantizer's bytes, and
  the greedy tokens are transformers' on the same model with its quantized weights replaced by
  ``dequantize_block(*quantize_block(w))``;
- new weights by every path (HF-named tensors, ``direct`` per-rank tensors, an HF and a per-rank
  checkpoint, ``update_weights_from_distributed`` flattened and per tensor, SGLang's HTTP route)
  change the stored bytes and the tokens; after a release without backup the engine serves only
  once the scales are pushed again too;
- a tensor in the wrong precision is refused on every path, naming the tensor, both dtypes and
  what to change, and nothing of the update lands (a transaction included); an unquantized engine
  refuses FP8 weights and scales the same way; an unknown quantization or a model whose split cuts
  a 128 block is refused before any worker starts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.client
import json
import os
import re
import threading

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.engines import EngineStateError, ReferenceEngine, WeightUpdateError, checksum_named_tensors
from fsdp_sync.engines.reference.quant import resolve
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.reference.tp_model import initial_tensors
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export, fp8
from fsdp_sync.weights.experts import hub_views
from fsdp_sync.weights.layout import ModelSpec, TPLayout, rank_digest
from fsdp_sync.wire import host_store, new_update_group, destroy_update_group

pytestmark = pytest.mark.timeout(120)

SEED, A, B = 5, 11, 12          # engine seed; the trainer's two versions of the weights
F8 = torch.float8_e4m3fn
PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]
NEW = 6
CASES = [("tiny-fp8", 1, 1), ("tiny-fp8", 2, 1), ("tiny-fp8-moe", 2, 2)]
Q = "model.layers.0.self_attn.q_proj.weight"


# --------------------------------------------------------------------------- the trainer's side

@functools.lru_cache(maxsize=None)
def _model(recipe: str, seed: int):
    return build_model(load_config(recipe), seed=seed).eval()


@functools.lru_cache(maxsize=None)
def _quantized(recipe: str) -> frozenset[str]:
    return fp8.FP8Layout(ModelSpec.from_config(load_config(recipe)), 1).quantized


@functools.lru_cache(maxsize=None)
def _stream(recipe: str, seed: int) -> tuple:
    """What the trainer sends: HF names, each quantized weight as fp8 followed by its scale."""
    out = []
    for n, t in export.iter_params(_model(recipe, seed)):
        if n in _quantized(recipe):
            q, s = fp8.quantize_block(n, t)
            out += [(n, q), (fp8.scale_name(n), s)]
        else:
            out.append((n, t.detach().clone()))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _greedy(recipe: str, seed: int) -> list:
    """transformers' greedy tokens of the model with its quantized weights round-tripped."""
    model = build_model(load_config(recipe), seed=seed).eval()
    views = hub_views(model)
    with torch.no_grad():
        for n in _quantized(recipe):
            views[n].copy_(fp8.dequantize_block(*fp8.quantize_block(n, views[n]), torch.float32))
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_u8(a), _u8(b))


def _write_ranked(directory, eng, named: dict, cast: dict | None = None) -> str:
    """A per-rank checkpoint (``layout="engine"``) of full HF tensors ``named`` for ``eng``'s split,
    as the disk method writes one: each rank's engine-named slices in its own file, a manifest
    with their digests. ``cast``: {engine name: dtype} to spoil."""
    os.makedirs(directory, exist_ok=True)
    ranks, files = [], {}
    for r in range(eng.tp_size):
        shard = {k: v.to(cast[k]) if cast and k in cast else v for k, v in eng.shard_for_rank(named, r).items()}
        f = f"model-rank-{r}-part-0.safetensors"
        save_file(shard, os.path.join(directory, f))
        with open(os.path.join(directory, f), "rb") as fh:
            files[f] = {"sha256": hashlib.sha256(fh.read()).hexdigest(), "names": list(shard)}
        ranks.append([f])
    manifest = {"layout": "engine", "tp_size": eng.tp_size, "ep_size": eng.ep_size, "ranks": ranks,
                "files": files, "model": json.loads(json.dumps(dataclasses.asdict(eng.layout.spec))),
                "dtype": "F8_E4M3", "hash": "sha256"}
    with open(os.path.join(directory, "fsdp_sync_manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    return str(directory)


def _send_distributed(eng, named: list, load_format: str | None) -> None:
    """``named`` over ``update_weights_from_distributed`` from this process as group rank 0 (gloo;
    float8 broadcast as its bytes, which gloo has no type for)."""
    store, box = host_store(1 + eng.tp_size, 30), {}
    port = store.port
    joined = threading.Thread(target=lambda: box.setdefault("pg", new_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, world_size=1 + eng.tp_size, rank=0,
        group_name="fp8", timeout_s=30, store=store)))
    joined.start()
    eng.init_weights_update_group("127.0.0.1", port, 1, 1 + eng.tp_size, "fp8", backend="gloo")
    joined.join(30)
    pg = box["pg"]
    try:
        names = [n for n, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        call = threading.Thread(target=lambda: box.setdefault("err", _call(
            eng.update_weights_from_distributed, names, dtypes, shapes, "fp8", load_format=load_format)))
        eng.begin_weight_update()
        call.start()
        if load_format == "flattened_bucket":   # SGLang's tight layout: every offset aligned here
            torch.distributed.broadcast(torch.cat([_u8(t) for _, t in named]), src=0, group=pg)
        else:
            for _, t in named:
                torch.distributed.broadcast(_u8(t) if t.dtype == F8 else t.contiguous(), src=0, group=pg)
        call.join(60)
        eng.end_weight_update()
        assert box["err"] is None, box["err"]
    finally:
        eng.destroy_weights_update_group("fp8")
        destroy_update_group(pg)


def _call(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        return exc
    return None


# --------------------------------------------------------------------------- engines

@pytest.fixture(scope="module", params=CASES, ids=[f"{r}-tp{t}-ep{e}" for r, t, e in CASES])
def eng(request):
    recipe, tp, ep = request.param
    with ReferenceEngine(recipe, tp_size=tp, ep_size=ep, quantization="fp8", seed=SEED,
                         kv_cache_tokens=64) as e:
        e.recipe = recipe
        e.initial = dict(e.named_full_tensors())     # the start-up weights, before any test loads
        yield e


def test_start_up_weights_are_the_random_draws_quantized(eng):
    assert eng.quantization == "fp8" and ", fp8," in repr(eng)
    lay = eng.layout
    assert isinstance(lay, fp8.FP8Layout) and set(eng.initial) == set(eng.hf_names()) == set(lay.hf_shapes)
    draws = dict(initial_tensors(lay, SEED))
    assert set(draws) == set(lay.hf_shapes) - {fp8.scale_name(n) for n in lay.quantized}
    for name, full in draws.items():
        if name in lay.quantized:
            q, s = fp8.quantize_block(name, full)
            assert _same(eng.initial[name], q) and _same(eng.initial[fp8.scale_name(name)], s), name
        else:
            assert _same(eng.initial[name], full), name
    # stored as held: 1 byte per quantized weight element, the scales in float32
    shapes = eng.engine_param_shapes()
    assert any(k.endswith("qkv_proj.weight_scale_inv") for k in shapes)
    assert ("model.layers.0.mlp.experts.w13_weight_scale_inv" in shapes) == (eng.recipe == "tiny-fp8-moe")
    plain = TPLayout(lay.spec, lay.tp, lay.ep).engine_bytes(4)
    for w in eng.memory_stats()["workers"]:
        assert w["weights_bytes"] == lay.engine_bytes(4) < plain / 2, w


def test_the_fp8_stream_loads_bit_for_bit_and_serves_the_dequantized_models_tokens(eng):
    stream = _stream(eng.recipe, A)
    eng.update_weights_from_tensor(list(stream))
    got = dict(eng.named_full_tensors())
    assert set(got) == {n for n, _ in stream}
    for n, t in stream:
        assert t.dtype == eng.layout.dtype_of(n, torch.float32) and _same(got[n], t), n
    assert _same(eng.get_weights_by_name(Q), dict(stream)[Q]) and eng.get_weights_by_name(Q).dtype == F8
    assert eng.weights_checksum() == checksum_named_tensors(stream)
    assert eng.tensor_checksums() == {n: checksum_named_tensors([(n, t)]) for n, t in stream}
    digests = eng.rank_digests()      # what SyncConfig.verify recomputes from the trainer's tensors
    for n, t in stream:
        assert digests[n] == [rank_digest(eng.layout, n, r, lambda pl, t=t: t[pl.src])
                              for r in range(eng.tp_size)], n
    assert eng.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == _greedy(eng.recipe, A)


def test_new_weights_by_every_path_change_the_bytes_and_the_tokens(eng, tmp_path):
    a, b = _stream(eng.recipe, A), _stream(eng.recipe, B)
    ca, cb = checksum_named_tensors(a), checksum_named_tensors(b)
    assert ca != cb

    def loaded(want: str, seed: int | None = None) -> None:
        assert eng.weights_checksum() == want
        if seed is not None:
            assert eng.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == _greedy(eng.recipe, seed)

    eng.update_weights_from_tensor(list(a))                      # HF names, one flattened bucket
    eng.update_weights_from_tensor(list(b))
    loaded(cb, B)
    shards = [eng.shard_for_rank(dict(a), r) for r in range(eng.tp_size)]   # direct: each rank its slice
    assert shards[0]["model.layers.0.self_attn.qkv_proj.weight"].dtype == F8
    eng.update_weights_from_tensor([(k, [s[k] for s in shards]) for k in shards[0]], load_format="direct")
    loaded(ca, A)
    os.makedirs(tmp_path / "hf")
    save_file(dict(b), str(tmp_path / "hf" / "model.safetensors"))              # an HF checkpoint
    eng.update_weights_from_disk(str(tmp_path / "hf"))
    loaded(cb)
    eng.update_weights_from_disk(_write_ranked(tmp_path / "ranked", eng, dict(a)))   # a per-rank one
    loaded(ca, A)
    _send_distributed(eng, list(b), "flattened_bucket")
    loaded(cb)
    _send_distributed(eng, list(a), None)
    loaded(ca)
    # weights released without a backup come back as zeros: the scales must be pushed again too
    eng.release_memory_occupation(["weights"])
    eng.resume_memory_occupation(["weights"])
    eng.update_weights_from_tensor([(n, t) for n, t in b if not n.endswith("_scale_inv")])
    with pytest.raises(EngineStateError, match=r"not all pushed again: \d+ of \d+ tensors missing \(e.g. "
                                               r"'[^']+_scale_inv'\)"):
        eng.generate(PROMPTS[:1], max_new_tokens=1)
    eng.update_weights_from_tensor([(n, t) for n, t in b if n.endswith("_scale_inv")])
    loaded(cb, B)


def test_serve_reports_and_takes_fp8(eng, capsys):
    from fsdp_sync.cli import app as cli
    from fsdp_sync.engines.sglang import SGLangEngine

    with EngineServer(eng) as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request("GET", "/get_server_info")
        assert json.loads(conn.getresponse().read())["quantization"] == "fp8"
        conn.close()
        SGLangEngine(base_url=srv.url).update_weights_from_tensor(list(_stream(eng.recipe, B)))
        assert eng.weights_checksum() == checksum_named_tensors(_stream(eng.recipe, B))
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--quantization {fp8}" in out and "SGLang's --quantization fp8" in out and "multiples of 128" in out
    args = cli.parse_args(["serve", "--model", eng.recipe, "--tp", str(eng.tp_size), "--ep", str(eng.ep_size),
                           "--quantization", "fp8", "--port", "0"])
    assert args.quantization == "fp8"


# --------------------------------------------------------------------------- refusals

def test_the_wrong_precision_is_refused_on_every_path_and_nothing_lands(eng, tmp_path):
    eng.update_weights_from_tensor(list(_stream(eng.recipe, A)))
    before = eng.weights_checksum()
    b = _stream(eng.recipe, B)
    plain = dict(export.iter_params(_model(eng.recipe, B)))        # float32, unquantized
    sq = fp8.scale_name(Q)
    hint = r".*quantization='fp8'"
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    cases = [   # valid tensors ride along: none may land
        ("a float32 weight", [(n, plain[Q]) if n == Q else (n, t) for n, t in b], {},
         rf"expected dtype float8_e4m3fn for '{Q}' on TP rank 0, got float32{hint}"),
        ("a bfloat16 scale", [(n, t.to(torch.bfloat16)) if n == sq else (n, t) for n, t in b], {},
         rf"expected dtype float32 for '{sq}' on TP rank 0, got bfloat16; a block-FP8 weight_scale_inv "
         rf"is float32"),
        ("a direct float32 weight", [(qkv, [torch.zeros(eng.engine_param_shapes()[qkv])] * eng.tp_size)],
         {"load_format": "direct"}, rf"expected dtype float8_e4m3fn for '{qkv}' on TP rank 0, got float32{hint}"),
    ]
    for what, named, kw, match in cases:
        with pytest.raises(WeightUpdateError, match=match):
            eng.update_weights_from_tensor(named, **kw)
        assert eng.weights_checksum() == before, what
    os.makedirs(tmp_path / "hf")
    save_file(plain, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(WeightUpdateError, match=rf"model.safetensors: expected dtype float8_e4m3fn for '[^']+"
                                                rf"\.weight' on TP rank \d, got float32{hint}"):
        eng.update_weights_from_disk(str(tmp_path / "hf"))
    qkv1 = "model.layers.1.self_attn.qkv_proj.weight"
    with pytest.raises(WeightUpdateError, match=rf"expected dtype float8_e4m3fn for '{qkv1}' on TP rank 0, "
                                                rf"got bfloat16{hint}"):
        eng.update_weights_from_disk(_write_ranked(tmp_path / "ranked", eng, dict(b), {qkv1: torch.bfloat16}))
    eng.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=rf"expected dtype float8_e4m3fn for '{Q}', got float32{hint}"):
        eng.update_weights_from_distributed([Q], ["float32"], [list(plain[Q].shape)], group_name="none")
    eng.end_weight_update(abort=True)
    # in a transaction: a good call, then a refused one, and the transaction keeps neither
    eng.begin_weight_update()
    eng.update_weights_from_tensor(list(b))
    with pytest.raises(WeightUpdateError, match=Q):
        eng.update_weights_from_tensor([(Q, plain[Q])])
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update()
    assert eng.weights_checksum() == before


def test_an_unquantized_engine_refuses_fp8_weights_and_scales(tmp_path):
    a = _stream("tiny-fp8", A)
    sq = fp8.scale_name(Q)
    hint = r".*start it with quantization='fp8'"
    with ReferenceEngine("tiny-fp8", seed=SEED, kv_cache_tokens=16) as plain:
        assert plain.quantization is None and not any(n.endswith("_scale_inv") for n in plain.hf_names())
        draws = dict(initial_tensors(plain.layout, SEED))       # the quantized engines' draws
        assert _same(plain.get_weights_by_name(Q), draws[Q])
        before = plain.weights_checksum()
        with pytest.raises(WeightUpdateError, match=rf"expected dtype float32 for '{Q}' on TP rank 0, got "
                                                    rf"float8_e4m3fn{hint}"):
            plain.update_weights_from_tensor(list(a))
        with pytest.raises(WeightUpdateError, match=rf"unknown parameter '{sq}' on TP rank 0.*block-FP8 scale{hint}"):
            plain.update_weights_from_tensor([(sq, dict(a)[sq])])
        for names, dtypes, match in [([sq], ["float32"], rf"unknown parameter '{sq}'.*block-FP8 scale{hint}"),
                                     ([Q], ["float8_e4m3fn"], rf"expected dtype float32 for '{Q}', got "
                                                              rf"float8_e4m3fn{hint}")]:
            plain.begin_weight_update()      # refused before any group is asked for
            with pytest.raises(WeightUpdateError, match=match):
                plain.update_weights_from_distributed(names, dtypes, [list(dict(a)[names[0]].shape)], "none")
            plain.end_weight_update(abort=True)
        os.makedirs(tmp_path / "hf")
        save_file(dict(a), str(tmp_path / "hf" / "model.safetensors"))
        with pytest.raises(WeightUpdateError, match=rf"(got float8_e4m3fn|block-FP8 scale){hint}"):
            plain.update_weights_from_disk(str(tmp_path / "hf"))
        assert plain.weights_checksum() == before


def test_a_quantization_the_engine_cannot_hold_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'fp8'\].*got 'int8'"):
        ReferenceEngine("tiny-fp8", quantization="int8")
    with pytest.raises(ValueError, match=r"block FP8 \[128, 128\] at tp 1, ep 1 \(qwen2\): q_proj rows per "
                                         r"rank = 64 is not a multiple of block 128"):
        ReferenceEngine("tiny", quantization="fp8")
    with pytest.raises(ValueError, match=r"at tp 4, ep 1 \(qwen3_moe\): expert rows per rank .* = 64"):
        ReferenceEngine("tiny-fp8-moe", tp_size=4, quantization="fp8")
    for recipe, splits in [("tiny-fp8", [(1, 1), (2, 1), (4, 1)]), ("tiny-fp8-moe", [(2, 1), (2, 2)])]:
        spec = ModelSpec.from_config(load_config(recipe))
        for tp, ep in splits:                     # the recipes' promised splits hold whole blocks
            fp8.FP8Layout(spec, tp, ep)
    # a config's quantization_config, as SGLang reads it
    block = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
             "ignored_layers": ["model.layers.1.mlp.down_proj"]}
    assert resolve(load_config("tiny-fp8"), None) is None
    assert resolve(load_config("tiny-fp8", quantization_config=block), None) == \
        {"method": "fp8", "block": (128, 128), "ignored": ("model.layers.1.mlp.down_proj",)}
    for bad, match in [({"quant_method": "awq"}, "quant_method 'awq'"),
                       ({"quant_method": "fp8"}, "per-tensor FP8"),
                       ({**block, "activation_scheme": "static"}, "activation_scheme 'static'")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            resolve(load_config("tiny-fp8", quantization_config=bad), "fp8")
