"""What a model config asks of the engines beyond its tensors' shapes, single-process.

- Rope scaling (Llama 3's ``rope_type: llama3``, YaRN), another activation or sliding-window layers
  change no tensor's place: the layout map takes them (SGLang's per-rank buckets, its verify and
  ``fsdp-sync plan`` work for a Llama-3.x model) with the sharding of the same model without them,
  while the reference engine, whose forward computes none of them, refuses them by name before a
  worker starts (the engine, ``serve``'s and ``demo``'s checks).
- SGLang's Qwen3-MoE, Qwen2-MoE and Mixtral keep an lm_head apart from a tied embedding, which no
  sync writes: a tied model of those families into SGLang is refused before anything is sent, and
  SGLang's checksum verify names any weight SGLang holds that the layout never fills.
- A Hub checkpoint on disk (``save_pretrained``'s files) loads into the reference engine as SGLang
  loads it: rotary tables it carries (``rotary_emb.inv_freq``, ``cos_cached``, ``sin_cached``) are
  skipped, and a floating-point dtype other than the engine's is cast (never FP8), while a sync's
  own version in another dtype is still refused.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "hidden_act": "silu",
          "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 256, "rope_type": "llama3"}}


def _llama(tmp_path, name="llama3", **changes):
    d = {**LLAMA3, **changes}
    (tmp_path / name).mkdir()
    path = tmp_path / name / "config.json"
    path.write_text(json.dumps({k: v for k, v in d.items() if v is not None}))
    return path


def _sharding(layout):
    return (layout.hf_shapes, layout.engine_shapes(),
            [[layout.placements(n, r) for n in layout.hf_names()] for r in range(layout.tp)])


def test_rope_scaling_keeps_the_layout_and_the_reference_engine_refuses_it(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    cfg = load_config(str(_llama(tmp_path)))
    plain = load_config(str(_llama(tmp_path, "plain", rope_scaling=None)))
    for tp in (1, 2, 4):
        got = layout_for(cfg, tp)
        assert "rope_type 'llama3'" in got.spec.unsupported
        assert _sharding(got) == _sharding(layout_for(plain, tp)), tp
    yarn = load_config("tiny-qwen3-moe", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 256})
    assert "rope_type 'yarn'" in layout_for(yarn, 2).spec.unsupported
    with pytest.raises(ValueError, match=r"reference engine cannot compute this llama model .*"
                                         r"expected the default rope, got rope_type 'llama3'"):
        ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=64)
    for what, c in (("hidden_act 'silu', got 'gelu'", load_config("tiny", hidden_act="gelu")),
                    ("mixtral sliding_window 4096", load_config("tiny-mixtral", sliding_window=4096))):
        assert what in layout_for(c, 1).spec.unsupported
        with pytest.raises(ValueError, match=what):
            ReferenceEngine(model_config=c, tp_size=1, kv_cache_tokens=64)


def test_plan_and_sglang_verify_take_a_llama3_model_demo_refuses_it(tmp_path, capsys):
    from fsdp_sync import cli, verify
    from fsdp_sync.cli.demo_check import check_model
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config

    path = _llama(tmp_path)
    rc = cli.main(["plan", "--config-json", str(path), "--tp", "2", "--ranks", "2", "--layout", "engine",
                   "--engine", "sglang"])
    out = capsys.readouterr()
    assert rc == 0 and "refused" not in out.out and "rope" not in out.err, out
    # SGLang's checksum check knows which bytes each of its TP ranks holds
    module = build_model(load_config(str(path)), seed=0)
    answer = {"ranks": [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": 2}} for r in range(2)]}
    checker = verify._sglang_checker(module, SyncConfig(), types.SimpleNamespace(tp_size=2),
                                     {"answer": answer, "algorithm": "cpu"}, ["model.norm.weight"])
    assert checker.hf_names() == {"model.norm.weight"}
    with pytest.raises(ValueError, match=r"argument --model: .*rope_type 'llama3'"):
        check_model(str(path), 2, 1, None)
    # the bench runs the reference engine too: refused in one line before any rank starts
    # (the layout map takes the model now, so the bench's own family check no longer did)
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--models", str(path), "--ranks", "1", "--tp", "1"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "rope_type 'llama3'" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- SGLang's MoE heads

def _tied_moe(recipe="tiny-qwen3-moe"):
    from fsdp_sync.models import build_model, load_config

    return build_model(load_config(recipe, tie_word_embeddings=True), seed=3)


@pytest.mark.parametrize("recipe", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"])
def test_a_tied_moe_model_into_sglang_is_refused_before_anything_is_sent(recipe, tmp_path, monkeypatch):
    """SGLang's Qwen3-MoE, Qwen2-MoE and Mixtral classes keep an lm_head of their own whatever
    tie_word_embeddings says, and a tied trainer sends none: the head would stay as SGLang started.
    The manager's engine check refuses it (in process and over HTTP: the fake SGLang), naming the
    class; untied, the reference engine and ``fsdp-sync serve`` behind SGLang's API are not."""
    import fake_sglang as fake

    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.config_check import check_engine
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError

    module = _tied_moe(recipe)
    engine = sg.SGLangEngine(fake.FakeSGLangEngine(tp_size=1))
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True for a '\w+' model: SGLang's \w+ForCausalLM "
                                         r"always builds an lm_head of its own .* \(trainer rank 0\)"):
        check_engine(module, engine, SyncConfig(), None, where="trainer rank 0")
    check_engine(build_model(load_config(recipe), seed=3), engine, SyncConfig(), None, where="")   # untied
    check_engine(module, object(), SyncConfig(), None, where="")       # an engine with its own tie rule
    if recipe != "tiny-qwen3-moe":
        return
    served = sg.SGLangEngine(fake.FakeSGLangEngine(tp_size=1))
    monkeypatch.setattr(served, "serves_tensor_checksums", lambda: True)   # fsdp-sync serve ties
    check_engine(module, served, SyncConfig(), None, where="")
    cfg = SyncConfig(method="disk", disk_dir=str(tmp_path / "ck"), dtype=torch.float32, layout="full",
                     free_cache_engine=False)
    with fake.FakeSGLangServer(tp_size=1) as srv:
        manager = FSDPShardingManager(module, [sg.SGLangEngine(base_url=srv.url, tp_size=1, timeout_s=10)],
                                      config=cfg)
        try:
            with pytest.raises(SyncError, match="MoeForCausalLM always builds an lm_head"):
                with manager:
                    pass
        finally:
            manager.close()
        assert not any(p.startswith("/update_weights") for _, p, _ in srv.requests), srv.requests


def test_sglang_verify_names_a_weight_no_sync_writes():
    """SGLang's /weights_checker hashes every parameter it holds; one the layout map has none of
    (SGLang's own lm_head behind a tied Qwen3-MoE) is never written by a sync, so the check names
    it on every TP rank instead of reporting the engine clean. Rotary caches are not weights."""
    from fsdp_sync.engines.sglang import checksums
    from fsdp_sync.weights import export
    from fsdp_sync.weights.layout import layout_for

    module = _tied_moe()
    layout = layout_for(module.config, 2)
    full = list(export.iter_params(module))
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": 2}} for r in range(2)]
    for name, per_rank in checksums.expected_checksums(layout, full):
        for r, h in enumerate(per_rank):
            ranks[r]["checksums"][name] = h
    for r in ranks:
        r["checksums"]["model.layers.0.self_attn.rotary_emb.cos_sin_cache"] = "0" * 16

    def problems(answer):
        c = checksums.Checker(layout, answer, algorithm="cpu")
        return [p for n, t in full for p in c.feed(n, t)] + c.finish()

    assert problems({"ranks": ranks}) == []
    for r in ranks:
        r["checksums"]["lm_head.weight"] = "d5568f5091ec8295"
    said = ("'lm_head.weight' on TP ranks 0, 1: SGLang holds it, but the trainer's layout has no such "
            "parameter, so no sync writes it")
    assert problems({"ranks": ranks}) == [said]
    # a streaming sender's record (verl's adapter) says the same
    from fsdp_sync.verify import SentToSGLang

    server = types.SimpleNamespace(server_info=lambda: {"device": "cpu"},
                                   weights_checker=lambda action: {"ranks": ranks})
    sent = SentToSGLang(server, "full", 0, hf_config=module.config, tp_size=2)
    for n, t in full:
        sent.add(n, t)
    err, _ = sent.check(server)
    assert err is not None and said in err, err


def test_sglang_sent_record_names_a_parameter_wrong_on_one_tp_rank():
    """A streaming sender's record (`SentToSGLang`, verl's adapter) against /weights_checker: all
    hashes as sent, clean; one synced parameter's hash off on TP rank 1 only is named with that
    rank (and rank 0, still right, is not)."""
    from fsdp_sync.engines.sglang import checksums
    from fsdp_sync.verify import SentToSGLang
    from fsdp_sync.weights import export
    from fsdp_sync.weights.layout import layout_for

    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny-qwen3-moe"), seed=3)      # untied: every weight synced
    full = list(export.iter_params(module))
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": 2}} for r in range(2)]
    for name, per_rank in checksums.expected_checksums(layout_for(module.config, 2), full):
        for r, h in enumerate(per_rank):
            ranks[r]["checksums"][name] = h
    server = types.SimpleNamespace(server_info=lambda: {"device": "cpu"},
                                   weights_checker=lambda action: {"ranks": ranks})

    def check():
        sent = SentToSGLang(server, "full", 0, hf_config=module.config, tp_size=2)
        for n, t in full:
            sent.add(n, t)
        return sent.check(server)[0]

    assert check() is None
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    ranks[1]["checksums"][qkv] = "0" * 64
    err = check()
    assert err is not None and f"{qkv!r} on TP rank 1: SGLang hashes {'0' * 64}" in err, err
    assert "TP rank 0" not in err and "more)" not in err, err


# --------------------------------------------------------------------------- Hub checkpoints on disk

def _hub_checkpoint(path, model, extra=(), **kw):
    """``save_pretrained`` (the Hub's file names, an index when sharded), plus ``extra`` tensors
    written into its first file (and index) as an older transformers saved its rotary tables."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(str(path), **kw)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if extra:
        tensors = load_file(str(path / files[0]))
        tensors.update({n: torch.arange(8, dtype=torch.float32) for n in extra})
        save_file(tensors, str(path / files[0]), metadata={"format": "pt"})
        index = path / "model.safetensors.index.json"
        if index.exists():
            doc = json.loads(index.read_text())
            doc["weight_map"].update({n: files[0] for n in extra})
            index.write_text(json.dumps(doc))
    return files


ROTARY = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.cos_cached",
          "model.layers.1.self_attn.rotary_emb.sin_cached"]


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_a_hub_checkpoint_with_rotary_tables_loads_them_skipped(tmp_path, shard):
    """Older Hub checkpoints carry ``rotary_emb.inv_freq`` (and cos/sin caches), which SGLang's
    loader skips: the reference engine loads the weights around them, complete, bit for bit."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    cfg = load_config("tiny")
    model = build_model(cfg, seed=4)
    files = _hub_checkpoint(tmp_path / "hub", model, ROTARY, **({"max_shard_size": shard} if shard else {}))
    assert (len(files) > 1) == bool(shard)
    with ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=64) as eng:
        eng.update_weights_from_disk(str(tmp_path / "hub"), require_complete=True)
        got = dict(eng.named_full_tensors())
        assert eng.disk_tensors_loaded == len(got)
    want = dict(model.named_parameters())
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in got)


def test_a_hub_checkpoint_in_another_float_dtype_is_cast_a_syncs_version_is_not(tmp_path):
    """``save_pretrained`` in bfloat16 into a float32 engine (``serve``'s default): cast on load, as
    SGLang's loader casts. A sync's own version in another dtype than the engine's stays refused,
    naming SyncConfig.dtype; an FP8 tensor is never cast, and a checkpoint's integer tensor is
    refused without advice about the sync."""
    from safetensors.torch import load_file, save_file

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import WeightUpdateError
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    cfg = load_config("tiny")
    model = build_model(cfg, seed=4).to(torch.bfloat16)
    _hub_checkpoint(tmp_path / "hub", model)
    sc = SyncConfig(disk_dir=str(tmp_path / "ck"), dtype=torch.bfloat16, layout="full")
    t = DiskTransport(sc)
    ctx = SyncContext(module=model, config=sc, topo=None, group=None, engines=[], step=0, stats=SyncStats())
    t.sync(ctx)
    t.close()
    with ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=64, dtype=torch.float32) as eng:
        eng.update_weights_from_disk(str(tmp_path / "hub"), require_complete=True)
        got = dict(eng.named_full_tensors())
        assert all(got[n].dtype == torch.float32 and torch.equal(got[n], p.float())
                   for n, p in model.named_parameters())
        with pytest.raises(WeightUpdateError, match=r"expected dtype float32 for .* got bfloat16; .*"
                                                    r"SyncConfig\(dtype=torch.float32\)"):
            eng.update_weights_from_disk(ctx.stats.extra["path"])
        file = next((tmp_path / "hub").glob("*.safetensors"))
        tensors = load_file(str(file))
        for dtype, said in ((torch.float8_e4m3fn, "start it with quantization='fp8'"),
                            (torch.int32, "only floating-point tensors are cast")):
            bad = {**tensors, "model.norm.weight": tensors["model.norm.weight"].to(dtype)}
            save_file(bad, str(file), metadata={"format": "pt"})
            with pytest.raises(WeightUpdateError, match=rf"'model.norm.weight' on TP rank 0, got "
                                                        rf"{str(dtype).removeprefix('torch.')}; .*{said}"):
                eng.update_weights_from_disk(str(tmp_path / "hub"))
        assert all(torch.equal(t, got[n]) for n, t in eng.named_full_tensors())    # the old weights


def test_a_llama_with_mlp_biases_into_sglang_is_refused_before_anything_is_sent():
    """SGLang's LlamaMLP (0.5.12 and 0.5.23) builds gate_up_proj and down_proj with bias=False
    whatever mlp_bias says, and its load_weights skips a .bias it has no parameter for: a Llama
    trained with mlp_bias=True synced into SGLang without a word, served without its MLP biases
    (layout="engine" failed with a KeyError after the update began). The engine check refuses it,
    naming the key; the reference engine (which has them) and a Llama without them are not."""
    import fake_sglang as fake

    from fsdp_sync import SyncConfig
    from fsdp_sync.config_check import check_engine
    from fsdp_sync.engines import sglang as sg
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny", model_type="llama", mlp_bias=True), seed=3)
    assert any(n.endswith("mlp.down_proj.bias") for n, _ in module.named_parameters())
    engine = sg.SGLangEngine(fake.FakeSGLangEngine(tp_size=1))
    with pytest.raises(ValueError, match=r"mlp_bias=True for a 'llama' model: SGLang's LlamaMLP .* "
                                         r"\(trainer rank 0\)"):
        check_engine(module, engine, SyncConfig(), None, where="trainer rank 0")
    check_engine(build_model(load_config("tiny", model_type="llama"), seed=3), engine, SyncConfig(), None,
                 where="")
    check_engine(module, object(), SyncConfig(), None, where="")


def test_a_sliding_window_switch_over_full_attention_layers_is_served():
    """``use_sliding_window: true`` with ``max_window_layers`` at least the layer count: transformers
    makes every layer full attention (``layer_types``), as SGLang's Qwen2 does (it has no window).
    The reference engine refused it as "sliding-window attention is not supported (layer_types
    ['full_attention', 'full_attention'])", contradicting itself; a window on any layer is still
    refused. The engine built from it computes the trainer's logits."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights.layout import layout_for

    full = load_config("tiny", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert full.layer_types == ["full_attention"] * 2
    assert layout_for(full, 1).spec.unsupported == ""
    windowed = load_config("tiny", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert "sliding-window attention is not supported" in layout_for(windowed, 1).spec.unsupported
    model = build_model(full, seed=4).eval()
    prompt = [[5, 9, 2, 44, 7]]
    with torch.no_grad():
        want = model(input_ids=torch.tensor(prompt)).logits[0, -1].float()     # the next token's
    with ReferenceEngine(model_config=full, tp_size=1, kv_cache_tokens=64, dtype=torch.float32) as e:
        e.update_weights_from_tensor(list(model.state_dict().items()))
        got = e.forward_logits(prompt)[0]
    assert torch.allclose(got.float(), want, atol=1e-4), (got - want).abs().max()
