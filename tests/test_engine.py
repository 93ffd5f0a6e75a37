"""The reference engine against transformers: layout, logits, greedy tokens, the three load
formats, all-or-nothing updates and transactions. Engines are shared per module where a test
leaves the weights as it found them (every test that changes them puts the original back).

Memory, dead workers and shutdown hygiene are in test_engine_lifecycle.py.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from fsdp_sync.weights import handles
from fsdp_sync.weights.bucket import flatten, plan_buckets, sglang_metadata, TensorMeta
from fsdp_sync.engines import (Engine, EngineError, EngineStateError, ReferenceEngine, SerializedPerRank,
                               WeightUpdateError, checksum_named_tensors)
from fsdp_sync.engines.reference import worker
from fsdp_sync.engines.reference.tp_model import ModelSpec, TPLayout, shard_state_dict
from fsdp_sync.models import build_model, load_config

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7], [300, 301, 302, 5, 6, 7, 8]]


# --------------------------------------------------------------------------- helpers

@torch.no_grad()
def hf_last_logits(model, prompts):
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts])


@torch.no_grad()
def hf_all_logits(model, prompts):
    return [model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]


@torch.no_grad()
def hf_generate(model, prompts, n):
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def checksum(model):
    return checksum_named_tensors(model.named_parameters())


def push_flattened(eng, named, bucket_bytes=64 * 1024):
    """Push HF-named tensors as SGLang flattened buckets, one payload per TP rank; checks acks."""
    named = list(named)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in named], bucket_bytes)
    tensors = dict(named)
    for b in plan:
        flat = flatten(b, tensors, out=handles.empty_shared(b.nbytes))
        with handles.make_payloads({"flattened_tensor": flat, "metadata": sglang_metadata(b)},
                                   eng.tp_size) as ps:
            eng.update_weights_from_tensor(ps.payloads, load_format="flattened_bucket")
            assert ps.unacknowledged() == []
    return len(plan)


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def tiny2():
    """The same architecture with other weights: what an update pushes."""
    return build_model(load_config("tiny"), seed=1).eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def eng(request, tiny):
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=request.param) as e:
        e.update_weights_from_tensor(list(tiny.state_dict().items()))
        yield e


def restore(eng, tiny):
    eng.update_weights_from_tensor(list(tiny.state_dict().items()))
    assert eng.weights_checksum() == checksum(tiny)


# --------------------------------------------------------------------------- layout (no processes)

@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe,overrides", [
    ("tiny", {}), ("tiny-tied", {}), ("small", {}),
    ("tiny", {"model_type": "llama", "attention_bias": True, "mlp_bias": True}),
])
def test_layout_names_and_round_trip(recipe, overrides):
    cfg = load_config(recipe, **overrides)
    model = build_model(cfg, seed=3)
    names = [n for n, _ in model.named_parameters()]
    for tp in (1, 2, 4, 8):
        try:
            layout = TPLayout(ModelSpec.from_config(cfg), tp)
        except ValueError:
            assert cfg.num_attention_heads % tp or cfg.intermediate_size % tp
            continue
        assert layout.hf_names() == names
        sd = model.state_dict()
        shards = [shard_state_dict(sd, layout, r) for r in range(tp)]
        for r in range(tp):
            assert {k: tuple(v.shape) for k, v in shards[r].items()} == layout.engine_shapes()
        for name in names:   # owners' pieces put back together give the full tensor
            full = torch.full_like(sd[name], float("nan"))
            for r in range(tp):
                for pl in layout.placements(name, r):
                    if pl.owner:
                        full[pl.src] = shards[r][pl.engine][pl.dst]
            assert torch.equal(full, sd[name]), (name, tp)


@pytest.mark.timeout(60)
def test_impossible_splits_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must be divisible by tp_size \(2\)"):
        ReferenceEngine(model_config=load_config("tiny", num_attention_heads=6, num_key_value_heads=3,
                                                 hidden_size=96), tp_size=2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tp_size \(8\)"):
        ReferenceEngine(model_config="tiny", tp_size=8)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        TPLayout(ModelSpec.from_config(load_config("tiny", num_attention_heads=12, num_key_value_heads=4,
                                                   hidden_size=96, intermediate_size=120)), 6)
    with pytest.raises(ValueError, match="silu"):     # the layout takes it, the engine's forward does not
        ReferenceEngine(model_config=load_config("tiny", hidden_act="gelu"), tp_size=1)


# --------------------------------------------------------------------------- numerics (tp 1 and 2)

@pytest.mark.timeout(60)
def test_is_an_engine(eng):
    assert isinstance(eng, Engine)
    assert eng.accepts_tagged_payloads


@pytest.mark.timeout(60)
def test_logits_match_transformers(eng, tiny):
    got = eng.forward_logits(PROMPTS)
    assert got.shape == (len(PROMPTS), tiny.config.vocab_size) and got.dtype == torch.float32
    assert (got - hf_last_logits(tiny, PROMPTS)).abs().max() < 1e-5
    for g, r in zip(eng.forward_logits(PROMPTS, all_positions=True), hf_all_logits(tiny, PROMPTS)):
        assert g.shape == r.shape and (g - r).abs().max() < 1e-5


@pytest.mark.timeout(90)
def test_greedy_tokens_match_transformers_generate(eng, tiny):
    assert eng.generate(input_ids=PROMPTS, max_new_tokens=32, temperature=0.0) == hf_generate(tiny, PROMPTS, 32)


@pytest.mark.timeout(60)
def test_sampling_and_batch_independence(eng):
    out = eng.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 1.0})
    assert [len(o) for o in out] == [8] * len(PROMPTS)
    assert all(0 <= t < 512 for o in out for t in o)
    # greedy of one prompt alone equals its row in the batch
    assert eng.generate([PROMPTS[1]], 8) == [eng.generate(PROMPTS, 8)[1]]


@pytest.mark.timeout(60)
def test_weights_read_back(eng, tiny):
    assert eng.weights_checksum() == checksum(tiny)
    sd = tiny.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight",
                 "model.norm.weight", "lm_head.weight"):
        assert torch.equal(eng.get_weights_by_name(name), sd[name]), name
    assert torch.equal(eng.get_weights_by_name("model.norm.weight", truncate_size=5), sd["model.norm.weight"][:5])
    with pytest.raises(KeyError, match="unknown parameter"):
        eng.get_weights_by_name("model.nope")


# --------------------------------------------------------------------------- load formats

@pytest.mark.timeout(90)
def test_flattened_buckets_in_a_transaction(eng, tiny, tiny2):
    eng.begin_weight_update()
    n = push_flattened(eng, tiny2.state_dict().items())
    assert n > 1
    # staged, not applied: the engine serves its previous weights until the end
    assert eng.weights_checksum() == checksum(tiny)
    assert eng.memory_stats()["staging_bytes"] > 0
    eng.end_weight_update()
    assert eng.memory_stats()["staging_bytes"] == 0
    assert eng.staged_on_host_bytes == 0          # a CPU engine's copies are in its own memory
    assert eng.weights_checksum() == checksum(tiny2)
    assert (eng.forward_logits(PROMPTS) - hf_last_logits(tiny2, PROMPTS)).abs().max() < 1e-5
    restore(eng, tiny)


@pytest.mark.timeout(90)
def test_serialized_per_rank_tensors(eng, tiny, tiny2):
    sets = []
    named = []
    for name, t in tiny2.state_dict().items():
        ps = handles.make_payloads(t, eng.tp_size)
        sets.append(ps)
        named.append((name, SerializedPerRank(values=ps.payloads)))
    eng.update_weights_from_tensor(named, load_format=None, flush_cache=True)
    for ps in sets:
        ps.release()    # raises if a worker did not acknowledge
    assert eng.weights_checksum() == checksum(tiny2)
    restore(eng, tiny)


@pytest.mark.timeout(90)
def test_direct_layout(eng, tiny, tiny2):
    sd2 = tiny2.state_dict()
    shards = [eng.shard_for_rank(sd2, r) for r in range(eng.tp_size)]
    names = list(eng.engine_param_shapes())
    # half as per-rank tensor lists, half as per-rank payloads, the norm as one replicated tensor
    ps = [handles.make_payloads(shards[r]["model.embed_tokens.weight"], eng.tp_size, ranks=[r])
          for r in range(eng.tp_size)]
    named = [("model.embed_tokens.weight", SerializedPerRank([p.payloads[0] for p in ps])),
             ("model.norm.weight", sd2["model.norm.weight"])]
    named += [(k, [shards[r][k] for r in range(eng.tp_size)]) for k in names
              if k not in ("model.embed_tokens.weight", "model.norm.weight")]
    eng.update_weights_from_tensor(named, load_format="direct")
    for p in ps:
        p.release()
    assert eng.weights_checksum() == checksum(tiny2)
    # back to tiny as one flattened bucket per rank in the engine's layout: one handle per rank
    sets = []
    for r in range(eng.tp_size):
        shard = eng.shard_for_rank(tiny.state_dict(), r)
        (b,) = plan_buckets([TensorMeta.of(k, v) for k, v in shard.items()], 1 << 30)
        flat = flatten(b, shard, out=handles.empty_shared(b.nbytes))
        sets.append(handles.make_payloads({"flattened_tensor": flat, "metadata": sglang_metadata(b)},
                                          eng.tp_size, ranks=[r]))
    eng.update_weights_from_tensor([s.payloads[0] for s in sets], load_format="direct")
    for s in sets:
        s.release()
    assert eng.weights_checksum() == checksum(tiny)


# --------------------------------------------------------------------------- all or nothing

def _bad_updates(eng, tiny, tiny2):
    sd2 = tiny2.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    good = [(k, v) for k, v in sd2.items() if k != q]      # valid tensors ride along: none may land
    yield "unknown", good + [("model.layers.0.self_attn.qq_proj.weight", sd2[q])], None, \
        r"unknown parameter 'model.layers.0.self_attn.qq_proj.weight' on TP rank 0"
    yield "shape", good + [(q, sd2[q][:32])], None, \
        rf"expected shape \(64, 64\) for '{q}' on TP rank 0, got \(32, 64\)"
    yield "dtype", good + [(q, sd2[q].to(torch.bfloat16))], None, \
        rf"expected dtype float32 for '{q}' on TP rank 0, got bfloat16"
    yield "duplicate", good + [(q, sd2[q]), (q, sd2[q])], None, "appears twice"
    yield "per-rank count", [(q, SerializedPerRank([b"x"] * (eng.tp_size + 1)))], None, \
        rf"expected {eng.tp_size} per-rank values for '{q}'"
    if eng.tp_size > 1:
        # a direct shard with the wrong shape only on rank 1
        shards = [eng.shard_for_rank(sd2, r) for r in range(eng.tp_size)]
        k = "model.layers.0.self_attn.qkv_proj.weight"
        vals = [shards[r][k] for r in range(eng.tp_size)]
        vals[1] = vals[1][:-1]
        rows = shards[0][k].shape[0]
        yield "direct rank 1", [(k, vals)], "direct", \
            rf"expected shape \({rows}, 64\) for '{k}' on TP rank 1, got \({rows - 1}, 64\)"
        # rank 0's payload handed to rank 1
        ps = handles.make_payloads(sd2[q], eng.tp_size)
        yield "payload for another rank", [(q, SerializedPerRank(ps.payloads[::-1]))], None, \
            "payload for infer-TP rank"
        ps.release(require_ack=False)


@pytest.mark.timeout(120)
def test_bad_updates_change_nothing(eng, tiny, tiny2):
    before_logits = eng.forward_logits(PROMPTS)
    before = eng.weights_checksum()
    for what, named, fmt, message in _bad_updates(eng, tiny, tiny2):
        with pytest.raises(WeightUpdateError, match=message):
            eng.update_weights_from_tensor(named, load_format=fmt)
        assert eng.weights_checksum() == before, what
    assert torch.equal(eng.forward_logits(PROMPTS), before_logits)
    assert eng.generate(PROMPTS, 8) == hf_generate(tiny, PROMPTS, 8)


@pytest.mark.timeout(120)
def test_a_failed_call_aborts_the_whole_transaction(eng, tiny, tiny2):
    sd2 = tiny2.state_dict()
    before = eng.weights_checksum()
    names = list(sd2)
    eng.begin_weight_update()
    eng.update_weights_from_tensor([(k, sd2[k]) for k in names[:10]])
    with pytest.raises(WeightUpdateError, match="expected shape"):
        eng.update_weights_from_tensor([(names[10], sd2[names[10]][:1])])
    with pytest.raises(WeightUpdateError, match="aborted by an earlier failure"):
        eng.update_weights_from_tensor([(k, sd2[k]) for k in names[10:]])
    with pytest.raises(WeightUpdateError, match="nothing was committed"):
        eng.end_weight_update()     # closes the aborted transaction, and says nothing was committed
    assert not eng._in_txn
    assert eng.weights_checksum() == before
    # explicit abort drops a transaction that had no failure
    eng.begin_weight_update()
    push_flattened(eng, sd2.items())
    eng.end_weight_update(abort=True)
    assert eng.weights_checksum() == before
    # non-transactional: each call lands on its own
    eng.begin_weight_update(transactional=False)
    eng.update_weights_from_tensor([("model.norm.weight", sd2["model.norm.weight"])])
    assert torch.equal(eng.get_weights_by_name("model.norm.weight"), sd2["model.norm.weight"])
    eng.end_weight_update()
    with pytest.raises(EngineStateError, match="without begin"):
        eng.end_weight_update()
    restore(eng, tiny)


@pytest.mark.timeout(90)
def test_one_worker_stages_and_commits_in_one_round_trip(eng, tiny, tiny2, monkeypatch):
    """A worker alone has no other rank's stage to wait for: the update is one round trip
    (``stage_commit``), where TP ranks stage, then commit, each a round."""
    sent = []
    real = eng._round

    def spy(cmd, *args, **kw):
        sent.append(cmd)
        return real(cmd, *args, **kw)

    monkeypatch.setattr(eng, "_round", spy)
    eng.update_weights_from_tensor(list(tiny2.state_dict().items()), flush_cache=False)
    assert sent == (["stage_commit"] if eng.tp_size == 1 else ["stage", "commit"])
    assert eng.weights_checksum() == checksum(tiny2)
    assert eng.last_call_figures["commit_s"] > 0 and eng.last_call_figures["stage_s"] > 0
    restore(eng, tiny)


@pytest.mark.timeout(60)
def test_a_failed_commit_of_one_worker_breaks_the_engine(tiny, monkeypatch):
    """The commit's failure comes back inside the fused reply; it is taken as a failed commit
    (the engine says its weights may be inconsistent and serves no more), not as a refused
    stage. (Copies fail only on, say, running out of memory: the reply is scripted here.)"""
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=1) as e:
        real = e._round

        def failing_commit(cmd, *args, **kw):
            replies = real(cmd, *args, **kw)
            if cmd == "stage_commit":
                replies[0][1]["committed"] = ("err", "other", "RuntimeError: out of memory", "tb", None)
            return replies

        monkeypatch.setattr(e, "_round", failing_commit)
        with pytest.raises(EngineError, match="out of memory"):
            e.update_weights_from_tensor(list(tiny.state_dict().items()))
        with pytest.raises(EngineError, match=r"commit failed on TP ranks \[0\]") as info:
            e.forward_logits(PROMPTS)
        assert "shut it down and start a new one, then push every tensor" in str(info.value)
    # the worker's side: a commit that raises is its reply's "committed", the stage's reply kept

    class Updates:
        def stage(self, items, keep_mapped):
            return {"stage_s": 0.5, "keep": keep_mapped}

        def commit(self):
            raise RuntimeError("out of memory")

    reply = worker._stage_commit(types.SimpleNamespace(updates=Updates()), {"items": [], "keep_mapped": True})
    assert reply["stage_s"] == 0.5 and reply["keep"] is True
    assert reply["committed"][0] == "err" and "RuntimeError: out of memory" in reply["committed"][2]


@pytest.mark.timeout(60)
def test_bad_generate_arguments_and_the_dtype_hint(eng, tiny):
    for kw in ({"max_new_tokens": -1}, {"sampling_params": {"max_new_tokens": -3}},
               {"temperature": -0.5}):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 0|temperature must be >= 0"):
            eng.generate(PROMPTS, **kw)
    assert eng.generate(PROMPTS, 0) == [[] for _ in PROMPTS]
    name = "model.norm.weight"
    with pytest.raises(WeightUpdateError, match=r"got bfloat16; the engine runs in float32: .*"
                                                r"SyncConfig\(dtype=torch.float32\)"):
        eng.update_weights_from_tensor([(name, tiny.state_dict()[name].to(torch.bfloat16))])


# constructor arguments that were coerced (or raised torch's / Python's own error): each refused
# before any worker starts, naming the argument, the rule and the value
@pytest.mark.parametrize("kw,message", [
    ({"weights_cpu_backup": "no"}, "weights_cpu_backup must be True or False, got 'no'"),   # was True
    ({"transactional_updates": 1}, "transactional_updates must be True or False, got 1"),
    ({"kv_cache_tokens": 2.5}, r"kv_cache_tokens must be >= 1, got 2.5: a whole number"),  # was 2
    ({"kv_cache_tokens": True}, r"kv_cache_tokens must be >= 1, got True"),               # was 1
    ({"kv_cache_tokens": "100"}, r"kv_cache_tokens must be >= 1, got '100'"),
    ({"mem_fraction": "0.1"}, r"mem_fraction must be in \(0, 1\], got '0.1'"),
    ({"seed": None}, r"seed must be an int .* got None"),                                # TypeError
    ({"seed": 1.5}, r"seed must be an int .* got 1.5"),
    ({"update_recv_timeout_s": 0}, "update_recv_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"update_recv_timeout_s": float("nan")}, "update_recv_timeout_s must be a finite number"),
    ({"call_timeout_s": True}, "call_timeout_s must be a finite number of seconds > 0 .*, got True"),
    ({"max_lora_rank": 0}, r"max_lora_rank must be an int >= 1 \(or None for any rank\), got 0"),
])
def test_constructor_arguments_are_refused_not_coerced(kw, message):
    with pytest.raises(ValueError, match=message):
        ReferenceEngine("tiny", **kw)


@pytest.mark.timeout(60)
def test_prompt_token_ids_are_ints(eng):
    import numpy as np

    for prompts, shown in (([[1, 3.7]], "3.7 of type float"), ([[True, 2]], "True of type bool"),
                           ([1.0, 2.0], "1.0 of type float"), (torch.tensor([[1.0, 2.0]]), "1.0 of type float"),
                           ([["5"]], "'5' of type str")):
        with pytest.raises(ValueError, match=rf"prompt 0 has \d token ids that are not ints \(position 0: "
                                             rf"{re_escape(shown)}|position 1: {re_escape(shown)}"):
            eng.generate(prompts, 1)
    with pytest.raises(ValueError, match="prompt 1 must be a list of token ids, got int"):
        eng.forward_logits([[1, 2], 3])
    with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
        eng.generate([[1, 2]], 1, stop_token_ids=[2.5])
    # what is an int stays taken: numpy integers, integer tensors (rows or elements)
    want = eng.generate([[11, 27, 93]], 3)
    assert eng.generate([np.array([11, 27, 93])], 3) == want
    assert eng.generate([[np.int64(11), torch.tensor(27), 93]], 3) == want
    assert eng.generate(torch.tensor([11, 27, 93]), 3) == want


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.timeout(60)
def test_sampling_params_stop_token_ids_override_the_keyword(eng):
    """As generate's docstring says: ``sampling_params`` override the keywords, so their
    ``stop_token_ids`` (with the eos) apply and the keyword's not at all. The keyword alone
    replaces the eos. Before: the keyword replaced sampling_params' stop_token_ids."""
    prompt = [PROMPTS[1]]
    free = eng.generate(prompt, 12, ignore_eos=True)[0]
    first = {}
    for i, t in enumerate(free):
        first.setdefault(t, i)
    assert len(first) >= 2, free
    early, late = min(first, key=first.get), max(first, key=first.get)
    by_params = eng.generate(prompt, 12, sampling_params={"stop_token_ids": [late], "ignore_eos": True})
    assert by_params == [free[:first[late] + 1]]
    both = eng.generate(prompt, 12, stop_token_ids=[early],
                        sampling_params={"stop_token_ids": [late], "ignore_eos": True})
    assert both == by_params                       # was free[:first[early] + 1]
    assert eng.generate(prompt, 12, stop_token_ids=[early]) == [free[:first[early] + 1]]


# --------------------------------------------------------------------------- other models

@pytest.mark.timeout(120)
def test_tied_embeddings_tp2():
    cfg = load_config("tiny-tied")
    model = build_model(cfg, seed=4).eval()
    with ReferenceEngine(model_config=cfg, tp_size=2) as e:
        e.update_weights_from_tensor(list(model.state_dict().items()))   # lm_head.weight is ignored
        assert (e.forward_logits(PROMPTS) - hf_last_logits(model, PROMPTS)).abs().max() < 1e-5
        assert e.generate(PROMPTS, 32) == hf_generate(model, PROMPTS, 32)
        assert e.weights_checksum() == checksum(model)
        assert torch.equal(e.get_weights_by_name("lm_head.weight"), model.lm_head.weight)


@pytest.mark.timeout(120)
def test_llama_biases_replicated_kv_heads_and_small_kv_cache():
    """Llama with q/k/v/o and MLP biases, one KV head replicated on 2 TP ranks, and a KV cache so
    small that the batch runs in several waves."""
    cfg = load_config("tiny", model_type="llama", attention_bias=True, mlp_bias=True, num_key_value_heads=1)
    model = build_model(cfg, seed=5).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    with ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=48) as e:
        assert e.kv_cache_tokens == 48
        push_flattened(e, model.state_dict().items())
        assert (e.forward_logits(PROMPTS) - hf_last_logits(model, PROMPTS)).abs().max() < 1e-5
        assert e.generate(PROMPTS, 32) == hf_generate(model, PROMPTS, 32)
        assert e.weights_checksum() == checksum(model)
        with pytest.raises(EngineStateError, match="needs 56 KV-cache tokens; the cache holds 48"):
            e.generate([[1] * 25], 32)


@pytest.mark.timeout(120)
def test_bf16_engine_within_bf16_tolerance(tiny):
    ref32 = hf_last_logits(tiny, PROMPTS)
    # tiny's own weights in bf16: a model built in bf16 from the same seed has other weights on
    # torch 2.11 (its CPU normal_ draws bf16 differently), the same on 2.13
    model16 = copy.deepcopy(tiny).to(torch.bfloat16).eval()
    ref16 = hf_last_logits(model16, PROMPTS)
    with ReferenceEngine(model_config="tiny", tp_size=2, dtype=torch.bfloat16) as e:
        with pytest.raises(WeightUpdateError, match="expected dtype bfloat16 for 'model.embed_tokens.weight'"):
            e.update_weights_from_tensor(list(tiny.state_dict().items()))
        e.update_weights_from_tensor(list(model16.state_dict().items()))
        got = e.forward_logits(PROMPTS)
        assert got.dtype == torch.bfloat16
        scale = ref32.abs().max()
        # bf16 keeps 8 bits of mantissa: a few ulps of the largest logit
        assert (got.float() - ref32).abs().max() < 0.03 * scale
        assert (got.float() - ref16).abs().max() < 0.03 * scale
        assert e.weights_checksum() == checksum(model16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(300)
def test_cuda_engine_matches_transformers(tiny):
    with ReferenceEngine(model_config="tiny", tp_size=1, device="cuda", use_memory_saver=False) as e:
        push_flattened(e, tiny.state_dict().items())
        assert (e.forward_logits(PROMPTS).cpu() - hf_last_logits(tiny, PROMPTS)).abs().max() < 1e-4
        assert e.generate(PROMPTS, 16) == hf_generate(tiny, PROMPTS, 16)
        stats = e.memory_stats()["workers"][0]
        held = stats["weights_bytes"] + stats["kv_cache_bytes"]
        assert stats["cuda"]["allocated"] >= held
        e.release_memory_occupation()
        after = e.memory_stats()["workers"][0]
        assert after["weights_bytes"] == after["kv_cache_bytes"] == 0
        assert after["cuda"]["allocated"] <= stats["cuda"]["allocated"] - held
        e.resume_memory_occupation()
        push_flattened(e, tiny.state_dict().items())
        assert e.generate(PROMPTS, 16) == hf_generate(tiny, PROMPTS, 16)
