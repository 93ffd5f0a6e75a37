"""Qwen3 dense, Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral: layout map, export names,
reference engine and every sync method.

Single-process: each family's exported names and shapes are the layout map's (transformers 5's
fused experts cut into the Hub's per-expert names; a transformers-4-style per-expert model exports
the same bytes under the same names), every engine element of every TP/EP rank is written exactly
once, and what the map cannot split is refused by name. The reference engine against transformers
at TP 1, 2, 4 and EP 2: logits within 1e-5 (float32) and equal greedy tokens.

One 4-rank job: FSDP1 and FSDP2 trainers (transformers 5 fused experts and transformers 4
per-expert modules) synced by the tensor, distributed and disk methods with ``layout`` full and
engine, TP 1/2/4, EP 2, tied and untied Qwen3: after every sync the engine's weights equal the
trainer's bit for bit, its logits are within 1e-5 and its greedy tokens equal the trainer's; with
per-rank buckets (or per-rank files) no engine rank receives (reads) more than 1.05 x its shard,
experts included. A stale
expert (one expert's weights left as they were after the sync) is caught by ``verify="full"`` on
every trainer rank, naming the expert, for each method.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export
from fsdp_sync.weights.experts import hub_parts, hub_views
from fsdp_sync.weights.layout import ModelSpec, TPLayout, layout_for, shard_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from _moe import per_expert  # noqa: E402
from _util import digests  # noqa: E402

FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"]
PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]


def _splits(spec: ModelSpec):
    for tp in (1, 2, 4):
        for ep in ((1, 2) if spec.num_experts and tp % 2 == 0 else (1,)):
            yield tp, ep


# --------------------------------------------------------------------------- layout and export

@pytest.mark.parametrize("recipe,overrides", [(r, {}) for r in FAMILIES] + [("tiny-qwen2-moe", {"qkv_bias": False})],
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_export_names_are_the_layout_maps_and_every_engine_element_is_written_once(recipe, overrides):
    cfg = load_config(recipe, **overrides)
    model = build_model(cfg, seed=5)
    named = dict(export.iter_params(model))
    spec = ModelSpec.from_config(cfg)
    lay = TPLayout(spec, 1)
    assert list(named) == [m.name for m in export.param_metas(model)]
    assert set(named) == set(lay.hf_names())
    assert all(tuple(named[n].shape) == s for n, s in lay.hf_shapes.items())
    if spec.num_experts:
        g, u, d = spec.expert_names
        e = f"model.layers.0.{spec.moe_prefix}.experts.3."
        fused = model.model.layers[0].mlp.experts
        inter = spec.moe_intermediate_size
        assert torch.equal(named[e + f"{g}.weight"], fused.gate_up_proj[3, :inter])
        assert torch.equal(named[e + f"{u}.weight"], fused.gate_up_proj[3, inter:])
        assert torch.equal(named[e + f"{d}.weight"], fused.down_proj[3])
        # a transformers-4 trainer (per-expert modules, Hub names) exports the same bytes
        if spec.model_type != "mixtral":
            assert digests(export.iter_params(per_expert(build_model(cfg, seed=5)))) == digests(named.items())
        # and hub_views loads Hub-named tensors back into the fused parameters
        other = build_model(cfg, seed=6)
        views = hub_views(other)
        with torch.no_grad():
            for n, t in named.items():
                views[n].copy_(t)
        assert digests(export.iter_params(other)) == digests(named.items())
    for tp, ep in _splits(spec):
        lay = TPLayout(spec, tp, ep)
        for r in range(tp):
            nan = {n: torch.full(s, float("nan")) for n, s in lay.engine_shapes().items()}
            hits = {n: torch.zeros(s) for n, s in lay.engine_shapes().items()}
            for name in lay.hf_names():
                for pl in lay.placements(name, r):
                    nan[pl.engine][pl.dst] = named[name][pl.src]
                    hits[pl.engine][pl.dst] += 1
            for n, h in hits.items():
                pad = lay.padding(n, r)
                if pad is not None:
                    h[pad] = 1
                assert bool((h == 1).all()), (recipe, tp, ep, r, n, int((h != 1).sum()))
            shard = shard_state_dict(named, lay, r)
            assert {n: tuple(t.shape) for n, t in shard.items()} == lay.engine_shapes()
            if spec.num_experts:
                m = f"model.layers.0.{spec.moe_prefix}.experts."
                held = [e for e in range(spec.num_experts) if lay.placements(f"{m}{e}.{spec.expert_names[0]}.weight", r)]
                assert held == list(lay.expert_range(r)) and len(held) == spec.num_experts // ep
                assert shard[m + "w13_weight"].shape[0] == len(held)


def test_what_the_map_cannot_split_is_refused_by_name():
    spec = ModelSpec.from_config(load_config("tiny-qwen3-moe"))
    for tp, ep, what in [(4, 3, "ep_size (3) must divide tp_size (4)"),
                         (2, 2, None), (4, 4, None)]:
        if what is None:
            TPLayout(spec, tp, ep)
            continue
        with pytest.raises(ValueError, match=rf"{what.replace('(', '[(]').replace(')', '[)]')}"):
            TPLayout(spec, tp, ep)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(34\) must be divisible by tp_size / ep_size \(4\)"):
        TPLayout(ModelSpec.from_config(load_config("tiny-qwen3-moe", num_attention_heads=8,
                                                   num_key_value_heads=8, moe_intermediate_size=34)), 8, 2)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by ep_size \(4\)"):
        layout_for(load_config("tiny-qwen3-moe", num_experts=6), 4, 4)
    with pytest.raises(ValueError, match="ep_size 2 needs an MoE model; qwen3 has no experts"):
        layout_for(load_config("tiny-qwen3"), 2, 2)
    with pytest.raises(ValueError, match="model_type 'deepseek_v3'"):
        ModelSpec.from_config(load_config("tiny-qwen3-moe", model_type="deepseek_v3"))
    # sliding windows change no tensor's place: the reference engine refuses them (test_model_families)
    windowed = ModelSpec.from_config(load_config("tiny-mixtral", sliding_window=4096))
    assert "mixtral sliding_window 4096" in windowed.unsupported
    # a family whose fused layout is not known keeps its own (fused) name: an engine refuses it
    assert hub_parts("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 16), "gpt_oss") is None
    assert hub_parts("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 16), "qwen3_moe")[1] == \
        ("model.layers.0.mlp.experts.0.up_proj.weight", (4, 16), 64)
    assert hub_parts("model.layers.2.mlp.gate.weight", (4, 16), "mixtral") == \
        [("model.layers.2.block_sparse_moe.gate.weight", (4, 16), 0)]


# --------------------------------------------------------------------------- the engine

@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe,tp,ep", [("tiny-qwen3", 2, 1), ("tiny-qwen3-moe", 1, 1), ("tiny-qwen3-moe", 4, 2),
                                          ("tiny-qwen2-moe", 2, 1), ("tiny-mixtral", 2, 2)])
def test_engine_matches_transformers(recipe, tp, ep):
    from fsdp_sync.engines import ReferenceEngine

    cfg = load_config(recipe)
    model = build_model(cfg, seed=7).eval()
    with ReferenceEngine(cfg, tp_size=tp, ep_size=ep, kv_cache_tokens=256) as eng:
        assert f"tp={tp}" in repr(eng) and (ep == 1 or f"ep={ep}" in repr(eng))
        eng.update_weights_from_tensor(list(export.iter_params(model)))
        with torch.no_grad():
            for p, got in zip(PROMPTS, eng.forward_logits(PROMPTS, all_positions=True)):
                want = model(input_ids=torch.tensor([p])).logits[0].float()
                assert (got - want).abs().max() < 1e-5, (recipe, tp, ep)
            want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in PROMPTS]
        assert eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want


@pytest.mark.timeout(120)
def test_qwen2_moe_without_qkv_bias_syncs_bit_exact():
    """Qwen2-MoE's ``qkv_bias: false`` (a config field transformers and SGLang honour): the layout
    map, and so the engine, has no q/k/v biases; a sync of the trainer's tensors at TP 2 loads
    every one bit for bit and the engine computes the trainer's logits."""
    from fsdp_sync.engines import ReferenceEngine

    cfg = load_config("tiny-qwen2-moe", qkv_bias=False)
    model = build_model(cfg, seed=7).eval()
    named = dict(export.iter_params(model))
    assert not any(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for n in named)
    assert not any(n.endswith("qkv_proj.bias") for n in layout_for(cfg, 2).engine_shapes())
    with ReferenceEngine(cfg, tp_size=2, kv_cache_tokens=256) as eng:
        eng.update_weights_from_tensor(list(named.items()))
        for n, t in named.items():
            assert torch.equal(eng.get_weights_by_name(n), t), n
        with torch.no_grad():
            for p, got in zip(PROMPTS, eng.forward_logits(PROMPTS, all_positions=True)):
                assert (got - model(input_ids=torch.tensor([p])).logits[0].float()).abs().max() < 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe, first", [("tiny-qwen3-moe", "model.layers.0.mlp.experts.gate_up_proj"),
                                           ("tiny-mixtral", "model.layers.0.mlp.gate.weight")])
def test_a_transformers_state_dict_of_fused_experts_is_refused_saying_what_to_send(recipe, first):
    """transformers 5's own state_dict() holds a layer's experts fused (and Mixtral's router
    under 'mlp'): the engine refused its first such name as 'not a ... parameter name', with an
    unrelated example; it says now what the name is and what to send, and loads nothing."""
    from fsdp_sync.engines import ReferenceEngine, WeightUpdateError

    cfg = load_config(recipe)
    model = build_model(cfg, seed=7)
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=64) as eng:
        before = eng.weight_version
        with pytest.raises(WeightUpdateError, match=rf"unknown parameter '{first}'.*installed transformers' "
                                                    r"own name.*export\.iter_params\(model\)"):
            eng.update_weights_from_tensor(list(model.state_dict().items()))
        assert eng.weight_version == before
        eng.update_weights_from_tensor(list(export.iter_params(model)))     # what it says works


@pytest.mark.timeout(120)
def test_serve_takes_a_hugging_face_moe_config_with_ep(tmp_path, capsys):
    from _util import cli_here, start_serve

    from fsdp_sync.engines.sglang import SGLangEngine

    cfg = load_config("tiny-qwen3-moe", eos_token_id=None)     # no early stop on either side
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    model = build_model(cfg, seed=8).eval()
    proc, url = start_serve("--model", str(path), "--tp", "2", "--ep", "2")
    try:
        client = SGLangEngine(base_url=url)
        client.update_weights_from_tensor(list(export.iter_params(model)))
        got = client.generate(PROMPTS[:1], max_new_tokens=4)
        ids = torch.tensor([PROMPTS[0]])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False)[0, len(PROMPTS[0]):].tolist()
        assert got == [want]
    finally:
        proc.terminate()
        proc.wait(30)
    # the refusal, through the command's own main in this process (a child spends 3 s of CPU on its
    # imports to print one line; `test_cli_args` runs a refusal from the shell)
    bad = cli_here(capsys, "serve", "--model", str(path), "--tp", "2", "--ep", "4")
    assert bad.returncode == 2 and "argument --ep: ep_size (4) must divide tp_size (2)" in bad.stderr, bad.stderr


# --------------------------------------------------------------------------- every method, 4 ranks

CASES = [
    # (fsdp, recipe, overrides, transformers-4 per-expert modules, dp, engine tp, ep, [sync overrides])
    # dp None: the engine is held by trainer rank 0 (methods distributed and disk). "stale": expert
    # 5 of layer 2 (held by engine rank 1 at ep 2) keeps its old weights after the sync
    (2, "tiny-qwen3-moe", {}, False, 1, 4, 2,
     [{"layout": "engine"}, {"layout": "full"}, {"layout": "engine", "share_host_memory": False, "pipelined": False},
      {"layout": "engine", "verify": "full", "stale": True}]),
    (1, "tiny-qwen3-moe", {}, True, 2, 2, 1,
     [{"layout": "engine", "fsdp1_state_dict": "local"}, {"layout": "full", "fsdp1_state_dict": "sharded"},
      {"layout": "engine", "fsdp1_state_dict": "full"}]),
    (1, "tiny-qwen2-moe", {}, False, 2, 2, 2, [{"layout": "engine"}, {"layout": "full"}]),
    (2, "tiny-mixtral", {}, False, 4, 1, 1, [{"layout": "engine"}, {"layout": "full"}]),
    (2, "tiny-qwen3", {}, False, 2, 2, 1, [{"layout": "engine"}, {"layout": "full"}]),
    (2, "tiny-qwen3-moe", {}, False, None, 2, 2,
     [{"method": "distributed", "layout": "engine"}, {"method": "distributed", "layout": "full"},
      {"method": "disk", "layout": "engine"}, {"method": "disk", "layout": "full"},
      {"method": "distributed", "layout": "full", "verify": "full", "stale": True},
      {"method": "disk", "layout": "engine", "verify": "full", "stale": True}]),
    (1, "tiny-mixtral", {}, False, None, 4, 2,
     [{"method": "distributed", "layout": "engine", "fsdp1_state_dict": "local"},
      {"method": "disk", "layout": "engine", "fsdp1_state_dict": "local"}]),
    (2, "tiny-qwen2-moe", {}, True, None, 1, 1,
     [{"method": "distributed", "layout": "engine"}, {"method": "disk", "layout": "full"}]),
    (1, "tiny-qwen3", {"tie_word_embeddings": False}, False, None, 4, 1,
     [{"method": "distributed", "layout": "engine"}, {"method": "disk", "layout": "engine"}]),
]
STALE = "model.layers.2.mlp.experts.5.down_proj.weight"


def _job(rank, world, root):
    from _util import run_syncs

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    out = []
    for c, (fsdp, recipe, ov, t4, dp, tp, ep, syncs) in enumerate(CASES):
        cfg = load_config(recipe, **ov)
        model = build_model(cfg, seed=c)
        module = wrap_fsdp(per_expert(model) if t4 else model, fsdp)
        opt = torch.optim.SGD(module.parameters(), lr=1e-1)
        if dp is None:
            mesh, holder = None, rank == 0
        else:
            mesh = make_mesh(dp, tp)
            holder = SyncTopology.from_mesh(mesh).is_tp_src
        engine = ReferenceEngine(model_config=cfg, tp_size=tp, ep_size=ep, kv_cache_tokens=128) if holder else None

        def make_manager(wrapped, step, kw, c=c, mesh=mesh, engine=engine):
            kw = dict(kw)
            stale = kw.pop("stale", False)
            if kw.get("method") == "disk":
                kw["disk_dir"] = os.path.join(root, f"case{c}-{step}")
            m = FSDPShardingManager(module, wrapped, mesh=mesh, config=SyncConfig(
                dtype=torch.float32, bucket_bytes=16 << 10, free_cache_engine=False, dist_timeout_s=60, **kw))
            if stale:
                real = m.transport.sync

                def sync(ctx, real=real):
                    old = engine.get_weights_by_name(STALE) if engine is not None else None
                    real(ctx)
                    if engine is not None:       # as if this expert had not been sent
                        engine.update_weights_from_tensor([(STALE, old)])

                m.transport.sync = sync
            return m

        out += run_syncs(rank, c, module, opt, cfg, engine, syncs, prompts=PROMPTS, refuses=(),
                         make_manager=make_manager, greedy=3)
        del module, opt, model
    return out


@pytest.mark.timeout(400)
def test_every_method_and_layout_is_bit_exact_for_qwen3_and_moe(tmp_path):
    results = run_ranks(_job, 4, str(tmp_path), timeout_s=380, env=spawn_env())
    n = sum(len(case[-1]) for case in CASES)
    for rank, recs in enumerate(results):
        assert len(recs) == n, rank
        for rec in recs:
            fsdp, recipe, ov, t4, dp, tp, ep, syncs = CASES[rec["case"]]
            holder = rank == 0 if dp is None else rank % tp == 0
            if syncs[rec["step"]].get("stale"):
                # caught on every trainer rank, naming the expert that was not updated
                assert STALE in rec.get("error", ""), (rank, rec)
                continue
            assert "error" not in rec, rec["error"]
            assert rec["extra"]["layout"] == rec["kw"]["layout"], rec
            if rec["kw"]["layout"] == "engine":   # disk: bytes each engine rank read
                assert rec["extra"]["engine_rank_bytes_in"] <= 1.05 * rec["extra"]["engine_rank_shard_bytes"], rec
            if holder:
                assert rec["exact"], rec            # every weight, experts included, bit for bit
                assert rec["diff"] <= 1e-5, rec
                assert rec["tokens"], rec           # the trainer's own greedy tokens
