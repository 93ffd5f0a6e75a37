"""SGLang's ``sampling_params`` and ``/generate`` fields as the reference engine checks them, in
process (no engine, no server): each bound SGLang 0.5.23 enforces (``SamplingParams.verify``:
temperature >= 0 and finite, top_p in (0, 1], top_k -1 or >= 1, min_p in [0, 1], min_new_tokens in
[0, max_new_tokens], sampling_seed in [-2**63, 2**63)) admits its edge and refuses one past it with
the field and the value named; a bool is not a number; the stop and min_new_tokens sets follow
ignore_eos as SGLang's; `pick`'s greedy and sampled log-probabilities, its min_new_tokens mask and
a row's independence of the batch; `input_token_logprobs` position by position; `parse_generate`'s
refusals (unknown and non-default fields, n, rid, lora_path, logprob_start_len) and ids; a prompt
that is empty, not ints or outside the vocabulary refused naming it and the vocabulary.

H63's mutation pass: each check below was taken out (or its bound moved by one) and a test here
failed; before, no test held it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.engines.reference.generate_request import (GenerateRefused, answer_item,
                                                           parse_generate, sample_ids)
from fsdp_sync.engines.reference.generation import (NO_LIMIT, Sampling, draw_seed,
                                                    input_token_logprobs, pick)
from fsdp_sync.engines.reference.rollout import GenerationCalls

pytestmark = pytest.mark.timeout(60)


def ok(sp, **kw) -> Sampling:
    return Sampling.from_sglang(sp, **kw)


def refused(sp, needle: str, **kw) -> None:
    with pytest.raises(ValueError) as info:
        Sampling.from_sglang(sp, **kw)
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("key, good, bad, needle", [
    ("temperature", [0, 0.0, 1e-9, 2.5], [-1e-9, -0.5, math.inf, math.nan],
     "sampling_params.temperature must be >= 0 (0 is greedy), got "),
    ("top_p", [1.0, 1, 1e-6], [0, 0.0, 1.0000001, -0.1], "sampling_params.top_p must be a number in (0, 1], got "),
    ("top_k", [-1, 1, 2, 10**6], [0, -2], "sampling_params.top_k must be -1 (off) or an integer >= 1, got "),
    ("min_p", [0, 0.0, 1, 1.0, 0.5], [-1e-9, 1.0000001], "sampling_params.min_p must be a number in [0, 1], got "),
    ("n", [1, 1024], [0, -1, 1025], "sampling_params.n must be an integer in [1, 1024], got "),
    ("stream_interval", [1, 7], [0, -1], "sampling_params.stream_interval must be an integer >= 1, got "),
    ("max_new_tokens", [0, 1, 5000], [-1], "sampling_params.max_new_tokens must be >= 0, got "),
    ("min_new_tokens", [0, 16], [-1], "sampling_params.min_new_tokens must be >= 0, got "),
    ("sampling_seed", [0, -1, -2 ** 63, 2 ** 63 - 1], [2 ** 63, -2 ** 63 - 1],
     "sampling_params.sampling_seed must be an integer in [-2**63, 2**63), got "),
])
def test_each_bound_admits_its_edge_and_refuses_past_it_naming_field_and_value(key, good, bad, needle):
    for v in good:
        s = ok({key: v, "max_new_tokens": 5000} if key == "min_new_tokens" else {key: v})
        got = {"sampling_seed": "seed"}.get(key, key)
        assert getattr(s, got) == v, (key, v)
    for v in bad:
        refused({key: v}, needle + repr(v))


def test_a_bool_or_string_is_not_a_number_nor_a_float_an_integer():
    for key in ("temperature", "top_p", "min_p", "max_new_tokens", "min_new_tokens", "top_k", "n",
                "stream_interval", "sampling_seed"):
        for v in (True, False, "1"):
            refused({key: v}, f"sampling_params.{key} must be ")
            refused({key: v}, f"got {v!r}")
    for key in ("top_k", "n", "max_new_tokens", "min_new_tokens", "stream_interval", "sampling_seed"):
        refused({key: 2.0}, f"sampling_params.{key} must be an integer, got 2.0")


def test_min_new_tokens_is_held_to_max_new_tokens_given_not_to_a_null_one():
    assert ok({"max_new_tokens": 4, "min_new_tokens": 4}).min_new_tokens == 4
    refused({"max_new_tokens": 4, "min_new_tokens": 5},
            "sampling_params.min_new_tokens (5) must be <= max_new_tokens (4)")
    refused({"min_new_tokens": 129}, "min_new_tokens (129) must be <= max_new_tokens (128)")
    s = ok({"max_new_tokens": None, "min_new_tokens": 500})
    assert (s.max_new_tokens, s.min_new_tokens) == (NO_LIMIT, 500)
    assert ok({}).max_new_tokens == 128 and ok({}, default_max_new_tokens=7).max_new_tokens == 7


def test_ignore_eos_and_the_stop_sets_follow_sglang():
    s = ok({"stop_token_ids": [5, 6]}, eos=[2], vocab=10)
    assert (s.stop, s.min_stop, s.stop_token_ids) == ({2, 5, 6}, {2, 5, 6}, (5, 6))
    s = ok({"stop_token_ids": [5], "ignore_eos": True}, eos=[2], vocab=10)
    assert (s.stop, s.min_stop) == (frozenset(), {2, 5})
    assert ok({"ignore_eos": None}, eos=[2]).stop == {2}
    refused({"ignore_eos": "yes"}, "sampling_params.ignore_eos must be true or false, got 'yes'")
    refused({"ignore_eos": 1}, "sampling_params.ignore_eos must be true or false, got 1")
    refused({"stop_token_ids": [1, True]}, "sampling_params.stop_token_ids must be a list of token ids")
    refused({"stop_token_ids": 3}, "sampling_params.stop_token_ids must be a list of token ids, got 3")
    assert ok({"stop_token_ids": [0, 9]}, vocab=10).stop_token_ids == (0, 9)
    refused({"stop_token_ids": [0, 10, -1]}, "sampling_params.stop_token_ids [10, -1] are outside the "
                                             "vocabulary [0, 10)", vocab=10)
    refused({"min_new_tokens": 1, "stop_token_ids": [0, 1]}, "cover the whole vocabulary of 3",
            eos=[2], vocab=3)
    assert ok({"min_new_tokens": 1, "stop_token_ids": [0]}, eos=[2], vocab=3).min_new_tokens == 1


def test_keys_this_engine_cannot_honour_are_refused_by_name():
    refused({"foo": 1}, "sampling_params.foo is not supported by this engine; supported: max_new_tokens")
    refused({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty=0.5 is not supported")
    refused({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty=1.2 is not supported")
    refused({"stop": ["x"]}, "use stop_token_ids")
    refused({"logit_bias": {"3": 1.0}}, "sampling_params.logit_bias=")
    s = ok({"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": [],
            "logit_bias": {}, "regex": None, "skip_special_tokens": False, "no_stop_trim": True})
    assert s == ok({})


def test_greedy_below_sglangs_epsilon_or_top_k_one():
    assert ok({"temperature": 0}).greedy and ok({"temperature": 9e-7}).greedy
    assert not ok({"temperature": 1e-6}).greedy
    assert ok({"temperature": 1.0, "top_k": 1}).greedy and not ok({"top_k": 2}).greedy


def test_pick_greedy_rows_are_argmax_with_the_raw_log_softmax_whatever_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    greedy, hot = Sampling(temperature=0.0), Sampling(temperature=0.7, seed=11)
    tokens, lps = pick(logits, [greedy, hot, greedy], [0, 0, 0], torch.Generator().manual_seed(1), True)
    want = logits.argmax(dim=-1).tolist()
    assert tokens[0] == want[0] and tokens[2] == want[2]
    assert lps[0] == float(torch.log_softmax(logits[0], -1)[want[0]])
    # a sampled row reports the temperature-scaled distribution's log-probability
    assert lps[1] == float(torch.log_softmax(logits[1] / 0.7, -1)[tokens[1]])
    # a row's token is its own: alone, or beside others, the same (the seeded row too)
    alone, _ = pick(logits[1:2], [hot], [0], torch.Generator().manual_seed(5), False)
    assert alone == [tokens[1]]
    alone, none = pick(logits[2:3], [greedy], [0], None, False)
    assert alone == [tokens[2]] and none is None


def test_min_new_tokens_masks_the_stop_tokens_until_then_and_no_longer():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]])   # token 1 wins unmasked, 2 after it
    s = Sampling(temperature=0.0, min_new_tokens=2, min_stop=frozenset({1}), stop=frozenset({1}))
    assert pick(logits, [s], [0], None, False)[0] == [2]
    assert pick(logits, [s], [1], None, False)[0] == [2]
    assert pick(logits, [s], [2], None, False)[0] == [1]
    # the mask is this row's alone
    other = Sampling(temperature=0.0)
    assert pick(logits.repeat(2, 1), [s, other], [0, 0], None, False)[0] == [2, 1]


def test_seeded_draws_depend_on_seed_and_index_only():
    assert draw_seed(3, 4) == draw_seed(3, 4) and draw_seed(3, 4) != draw_seed(3, 5) != draw_seed(4, 4)
    assert 0 <= draw_seed(-2 ** 63, 10 ** 6) < 2 ** 63


def test_input_token_logprobs_score_each_token_by_the_position_before_it():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=g)
    prompt = [3, 1, 4, 1]
    lps = torch.log_softmax(logits, -1)
    got = input_token_logprobs(prompt, logits, 0)
    assert got == [[None, 3, None]] + [[float(lps[j - 1, prompt[j]]), prompt[j], None] for j in (1, 2, 3)]
    assert input_token_logprobs(prompt, logits, 2) == got[2:]
    assert input_token_logprobs(prompt, logits, 4) == []


# ---------------------------------------------------------------------------- /generate fields
def gen_refused(body: dict, needle: str) -> None:
    with pytest.raises(GenerateRefused) as info:
        parse_generate(body)
    assert needle in str(info.value), str(info.value)


def test_unknown_and_non_default_fields_are_refused_naming_them():
    gen_refused({"input_ids": [1], "no_such": 1}, "field 'no_such' is not supported by this server; supported: input_ids")
    gen_refused({"input_ids": [1], "image_data": "x.png"}, "field 'image_data'='x.png' is not supported")
    gen_refused({"input_ids": [1], "top_logprobs_num": 3}, "field 'top_logprobs_num'=3")
    gen_refused({"input_ids": [1], "model": 5}, "field 'model' must be a string")
    gen_refused({"text": "hi"}, "no tokenizer")
    req = parse_generate({"input_ids": [1, 2], "image_data": None, "top_logprobs_num": 0, "model": "m",
                          "log_metrics": True, "stream": None, "return_logprob": None})
    assert (req.prompts, req.single, req.stream, req.return_logprob) == ([[1, 2]], True, False, False)
    gen_refused({"input_ids": [1], "stream": "yes"}, "field 'stream' must be true or false, got 'yes'")
    gen_refused({"input_ids": [1], "return_logprob": 1}, "field 'return_logprob' must be true or false, got 1")


def test_input_ids_must_be_token_id_lists():
    for ids in ([], [[]], [[1], []], [[1, True]], [1.0], "12", None, [[1], 2]):
        gen_refused({"input_ids": ids}, "field 'input_ids' must be a list of token ids")


def test_sampling_params_per_prompt_and_n():
    req = parse_generate({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 2, "top_k": 3}]})
    assert req.n == 2 and [s.get("top_k") for s in req.sampling] == [None, 3] and len(req.ids) == 4
    gen_refused({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
                "sampling_params.n must be the same for every prompt, got [2, 3]")
    gen_refused({"input_ids": [[1], [2]], "sampling_params": [{}]}, "a list of 2 objects (one per prompt)")
    gen_refused({"input_ids": [[1]], "sampling_params": {"top_p": 0}}, "sampling_params.top_p must be")
    req = parse_generate({"input_ids": [[1], [2]], "sampling_params": {"stream_interval": 3}})
    assert req.interval == [3, 3]


def test_logprob_start_len_and_rid():
    body = {"input_ids": [[1], [2]], "return_logprob": True}
    assert parse_generate(dict(body, logprob_start_len=-1)).logprob_start_len is None
    assert parse_generate(dict(body, logprob_start_len=0)).logprob_start_len == 0
    assert parse_generate({"input_ids": [1], "logprob_start_len": 3}).logprob_start_len is None   # ignored
    for bad in (-2, 1.0, True, "0"):
        gen_refused(dict(body, logprob_start_len=bad), f"field 'logprob_start_len' must be an integer >= -1, got {bad!r}")
    assert parse_generate(dict(body, rid="r")).rids == ["r_0", "r_1"]
    assert parse_generate(dict(body, rid=["a", "b"])).ids == ["a", "b"]
    assert parse_generate({"input_ids": [1], "rid": "one"}).ids == ["one"]
    for bad in (["a", "a"], ["a"], ["a", ""], "", 5):
        gen_refused(dict(body, rid=bad), "field 'rid' must be a non-empty string")
    gen_refused({"input_ids": [1], "rid": ["a"]}, "field 'rid'")


def test_lora_path_is_one_name_or_one_per_prompt():
    body = {"input_ids": [[1], [2]]}
    assert parse_generate(dict(body, lora_path=["a", None])).lora_path == ["a", None]
    assert parse_generate(dict(body, lora_path="a")).lora_path == "a"
    for bad in (["a"], ["a", None, None], "", ["a", ""], 3, ["a", 3]):
        gen_refused(dict(body, lora_path=bad), "field 'lora_path' must be a loaded LoRA adapter's name")


def test_samples_get_ids_of_their_own_and_a_stream_of_several_an_index():
    assert sample_ids(["a", "b"], 1) == ["a", "b"]
    many = sample_ids(["a", "b"], 3)
    assert len(many) == 6 == len(set(many)) and not {"a", "b"} & set(many)
    r = {"output_ids": [5, 6], "finish_reason": {"type": "length", "length": 2}, "prompt_index": 0}
    one = parse_generate({"input_ids": [1, 2], "stream": True, "rid": "x"})
    out = answer_item(one, 0, r, "v1", 0.0)
    assert "index" not in out and out["meta_info"]["id"] == "x" and out["meta_info"]["prompt_tokens"] == 2
    assert out["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 2}]
    two = parse_generate({"input_ids": [1, 2], "stream": True, "sampling_params": {"n": 2}})
    assert answer_item(two, 1, r, "v1", 0.0)["index"] == 1
    batch = parse_generate({"input_ids": [[1, 2]], "return_logprob": True})
    meta = answer_item(batch, 0, r, "v1", 0.0)["meta_info"]
    assert "index" not in answer_item(batch, 0, r, "v1", 0.0)
    assert meta["input_token_logprobs"] == meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0


# ---------------------------------------------------------------------------- prompts (rollout)
class _Prompts(GenerationCalls):
    spec = SimpleNamespace(vocab_size=10)


def test_a_prompt_that_is_empty_not_ints_or_outside_the_vocabulary_is_refused_naming_it():
    for ids, needle in [
        ([[1, 2], []], "prompt 1 is empty"),
        ([], "input_ids is a non-empty list of token-id lists, got list []"),
        ([[1, 10]], "prompt 0 has token ids [10] outside the vocabulary [0, 10)"),
        ([[0, -1]], "prompt 0 has token ids [-1] outside the vocabulary [0, 10)"),
        ([[1, True]], "prompt 0 has 1 token ids that are not ints (position 1: True of type bool)"),
        ([[1], [2.0, 3]], "prompt 1 has 1 token ids that are not ints (position 0: 2.0 of type float)"),
        ([[1], "ab"], "prompt 1 must be a list of token ids, got str 'ab'"),
    ]:
        with pytest.raises(ValueError) as info:
            _Prompts()._check_prompts(ids)
        assert needle in str(info.value), str(info.value)


def test_prompts_given_flat_or_as_tensors_are_the_same_prompts():
    p = _Prompts()
    assert p._check_prompts([0, 9]) == [[0, 9]]
    assert p._check_prompts(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert p._check_prompts([(1,), torch.tensor([9])]) == [[1], [9]]


def test_lora_path_per_prompt_is_checked_against_the_loaded_adapters():
    p = _Prompts()
    p.lora_adapters = {"a": {}}
    assert p._check_lora_paths(["a", None], 2) == ["a", None]
    assert p._check_lora_paths("a", 3) == ["a", "a", "a"]
    with pytest.raises(ValueError, match=r"lora_path has 1 entries for 2 prompts"):
        p._check_lora_paths(["a"], 2)
    with pytest.raises(ValueError, match=r"lora_path 'b' \(prompt 1\) is not a loaded LoRA adapter; loaded: \['a'\]"):
        p._check_lora_paths([None, "b"], 2)


class _Reached(Exception):
    """generate_requests went past its checks (to the engine's state)."""


class _Engine(GenerationCalls):
    """`generate_requests` up to its checks: a 64-token context, a 40-token KV cache (a row holds
    its prompt and every new token but the last), eos 2."""

    spec = SimpleNamespace(vocab_size=10)
    config = SimpleNamespace(max_position_embeddings=64, eos_token_id=2)
    kv_cache_tokens = 40
    lora_adapters = {"a": {}}

    def _check_usable(self):
        raise _Reached


def test_generate_requests_refuses_before_anything_runs_naming_the_prompt():
    e = _Engine()
    with pytest.raises(ValueError, match=r"sampling_params has 1 entries for 2 prompts"):
        e.generate_requests([[1], [3]], [{"max_new_tokens": 1}])
    with pytest.raises(ValueError, match=r"sampling_params has 3 entries for 2 prompts"):
        e.generate_requests([[1], [3]], [{}, {}, {}])
    with pytest.raises(ValueError, match=r"^logprob_start_len needs return_logprob=True$"):
        e.generate_requests([[1, 3]], {"max_new_tokens": 1}, logprob_start_len=0)
    with pytest.raises(ValueError, match=r"logprob_start_len=3 is higher than the number of input tokens "
                                         r"of prompt 1 \(2\)"):
        e.generate_requests([[1, 3, 4], [1, 3]], {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=3)
    from fsdp_sync.engines import EngineStateError
    with pytest.raises(EngineStateError, match=r"prompt 1 \(30 tokens\) \+ max_new_tokens \(12\) needs 41 "
                                               r"KV-cache tokens; the cache holds 40"):
        e.generate_requests([[1], [1] * 30], {"max_new_tokens": 12})
    with pytest.raises(ValueError, match=r"The input \(64 tokens\) is longer than the model's context length"):
        e.generate_requests([[1] * 64], {"max_new_tokens": 0})
    with pytest.raises(ValueError, match=r"sampling_params.top_k must be"):
        e.generate_requests([[1]], {"top_k": 0})
    with pytest.raises(ValueError, match=r"sampling_params.stop_token_ids \[10\] are outside the vocabulary"):
        e.generate_requests([[1]], {"stop_token_ids": [10]})
    with pytest.raises(ValueError, match=r"lora_path 'b' \(prompt 0\) is not a loaded LoRA adapter"):
        e.generate_requests([[1]], {}, lora_path="b")
    # each of these fits exactly, and goes on to the engine
    for args, kw in [(([[1], [1] * 30], {"max_new_tokens": 11}), {}),     # 40 KV tokens: the whole cache
                     (([[1, 3, 4], [1, 3]], {"max_new_tokens": 1}), {"return_logprob": True, "logprob_start_len": 2}),
                     (([[1, 3]], {"max_new_tokens": 1}), {"logprob_start_len": -1}),
                     (([[1]], {}), {"lora_path": ["a"]})]:
        with pytest.raises(_Reached):
            e.generate_requests(*args, **kw)


def test_generate_keyword_stop_token_ids_replace_the_eos_and_must_be_ints():
    seen = {}

    class E(_Engine):
        def generate_requests(self, input_ids, sp, *, eos=None, lora_path=None):
            seen.update(sp=sp, eos=eos)
            return [{"output_ids": [7]}]

    assert E().generate([[1]], 5, stop_token_ids=[np_int(4)]) == [[7]]
    assert seen == {"sp": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": False, "stop_token_ids": [4]},
                    "eos": []}
    E().generate([[1]], 5, stop_token_ids=[4], sampling_params={"stop_token_ids": [6]})
    assert seen["sp"]["stop_token_ids"] == [6] and seen["eos"] is None
    E().generate([[1]], 5)
    assert "stop_token_ids" not in seen["sp"] and seen["eos"] is None
    with pytest.raises(ValueError, match=r"generate: stop_token_ids must be token ids \(ints\), got \[4, 2.5\]"):
        E().generate([[1]], 5, stop_token_ids=[4, 2.5])


def np_int(v):
    import numpy as np
    return np.int64(v)


def test_an_integer_past_floats_range_is_refused_naming_the_field_not_an_overflow():
    """JSON carries integers of any size: one past a float's range was an OverflowError (the
    server's 500, naming no field) from ``math.isfinite``; now an integer field takes it where
    its bound does (the context then refuses such a max_new_tokens) and every other refuses it
    naming the field, as a ValueError (400)."""
    huge = 10 ** 400
    for key, fits in [("max_new_tokens", True), ("top_k", True), ("stream_interval", True),
                      ("min_new_tokens", True), ("n", False), ("sampling_seed", False),
                      ("temperature", False), ("top_p", False), ("min_p", False)]:
        sp = {key: huge} | ({"max_new_tokens": None} if key == "min_new_tokens" else {})
        gen = {"input_ids": [1], "sampling_params": sp}
        if fits:
            assert getattr(Sampling.from_sglang(sp), key) == huge
            parse_generate(gen)
        else:
            refused(sp, f"sampling_params.{key} must be ")
            gen_refused(gen, f"sampling_params.{key} must be ")


def test_input_logprobs_of_rows_that_generate_nothing_use_each_rows_own_adapter():
    """A prompt scored alone (max_new_tokens 0, return_logprob with logprob_start_len) takes its
    input logprobs from one forward per adapter: each prompt's with its own ``lora_path`` (None:
    the base), in the prompts' order. With the adapter's name dropped every prompt was scored by
    the base weights, and no test saw it."""
    asked = []

    class E(_Engine):
        def _call(self, cmd, args, collective=False):
            asked.append((cmd, args["lora"], [len(p) for p in args["prompts"]], args["all_positions"]))
            shift = {None: 0.0, "a": 1.0, "b": 2.0}[args["lora"]]
            return [[torch.arange(len(p) * 10, dtype=torch.float32).reshape(len(p), 10) * shift
                     for p in args["prompts"]]]

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]]
    got = E()._input_logprobs(prompts, 1, ["a", None, "b", "a"])
    assert asked == [("forward_logits", "a", [3, 2], True), ("forward_logits", None, [2], True),
                     ("forward_logits", "b", [4], True)]
    for p, lp, shift in zip(prompts, got, (1.0, 0.0, 2.0, 1.0)):
        logits = torch.arange(len(p) * 10, dtype=torch.float32).reshape(len(p), 10) * shift
        assert lp == input_token_logprobs(p, logits, 1), (p, shift)
    asked.clear()
    assert E()._input_logprobs(prompts[:2], 0) == [input_token_logprobs(p, torch.zeros(len(p), 10), 0)
                                                    for p in prompts[:2]]
    assert [a[1] for a in asked] == [None]


def test_the_context_length_skips_a_llama3_factor_and_a_longer_one_needs_sglangs_env(monkeypatch):
    """SGLang's ``get_context_length`` skips the factor of ``rope_type`` llama3 whether or not the
    config holds ``original_max_position_embeddings`` (the legacy ``type`` key is not read for it);
    ``--context-length`` past the derived length is refused unless its env var allows it."""
    from fsdp_sync.engines.reference.rollout import check_context_length, sglang_context_length

    def cfg(scaling):
        return SimpleNamespace(max_position_embeddings=256, rope_scaling=scaling)

    assert sglang_context_length(cfg({"rope_type": "llama3", "factor": 8.0})) == 256
    assert sglang_context_length(cfg({"type": "llama3", "factor": 8.0})) == 2048
    assert sglang_context_length(cfg({"rope_type": "linear"})) == 256
    with pytest.raises(ValueError, match=r"config.rope_scaling must be a dict or null, got list"):
        sglang_context_length(cfg([2.0]))
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    check_context_length(cfg(None), 256)
    with pytest.raises(ValueError, match=r"context_length 257 is greater than the context length derived "
                                         r"from the model config \(256"):
        check_context_length(cfg(None), 257)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"context_length must be an integer >= 1 or None, got {bad!r}"):
            check_context_length(cfg(None), bad)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "true")
    check_context_length(cfg(None), 4096)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "0")
    with pytest.raises(ValueError, match="context_length 257"):
        check_context_length(cfg(None), 257)


def test_a_streaming_caller_is_told_every_stream_interval_tokens_and_at_the_end():
    """SGLang's ``stream_interval``: told once a result has that many new tokens since it was last
    told, or once it ends (an abort may end it with no new token), and not again after."""
    rows = [(0, Sampling(stream_interval=2)), (0, Sampling(stream_interval=1))]
    res = [{"output_ids": [], "finish_reason": None}, {"output_ids": [], "finish_reason": None}]
    told, ended = [0, 0], [False, False]

    def step(a=None, b=None, end_a=False):
        if a is not None:
            res[0]["output_ids"].append(a)
        if b is not None:
            res[1]["output_ids"].append(b)
        if end_a:
            res[0]["finish_reason"] = {"type": "abort"}
        return GenerationCalls._stream_due(res, rows, told, ended)

    assert step(a=1) is False and told == [0, 0]
    assert step(a=2) is True and told == [2, 0]
    assert step(b=5) is True and told == [2, 1]
    assert step(a=3) is False
    assert step(end_a=True) is True and told == [3, 1] and ended == [True, False]
    assert step() is False
