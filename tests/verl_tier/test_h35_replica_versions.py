"""What the ``fsdp_sync_ref`` replica's server actor answers verl, pinned against verl 0.9.1's own
SGLang server (``async_sglang_server.py`` ~588-723) and the agent loop that reads it
(``llm_server.py`` ~289-350) (audit H35; cases no test pinned, found by mutating `replica`):

- the version: each answer carries ``extra_fields["global_steps"]``, the step `set_global_steps`
  last set (verl's fully async trainer takes the min and max of it over a partial rollout's
  pieces to measure staleness);
- an aborted request answers ``stop_reason="aborted"`` (verl's agent loop resumes it after the
  sync: ``stop_reason in ("aborted", "abort")``), a finished one ``"completed"``;
- log-probs that do not match the tokens are refused naming the request (never shifted);
- ``max_new_tokens`` when verl names none: ``min(response_length, prompt_length +
  response_length - len(prompt))`` as verl's server computes it, also when ``max_model_len`` leaves
  more room; capped by the room left in the context; a prompt that fills the context refused;
- memory calls go out only from node 0 and only when ``free_cache_engine``;
- ``pipeline_model_parallel_size`` > 1 is refused naming it.
"""

from __future__ import annotations

import asyncio

import pytest

from test_verl_replica import _config as _tp2_config, _model

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]


def _config(**kw):
    return _tp2_config(**{"tensor_model_parallel_size": 1, **kw})


def _server(tmp_path, answers, node_rank=0, **cfg):
    from fsdp_sync.integrations.verl.replica import ServeServer

    server = ServeServer(_config(**cfg), _model(tmp_path), replica_rank=3, node_rank=node_rank)
    posted = []

    async def post(path, body):
        posted.append((path, body))
        return answers.pop(0) if path == "/generate" else {"success": True}

    server._post = post
    return server, posted


def _answer(ids, finish="length", logprobs=None):
    meta = {"finish_reason": {"type": finish}}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[p, t, None] for p, t in zip(logprobs, ids)]
    return {"output_ids": ids, "meta_info": meta}


def test_each_answer_carries_the_step_set_and_an_abort_reads_aborted(tmp_path):
    server, _ = _server(tmp_path, [_answer([4, 5]), _answer([6], finish="abort"),
                                   _answer([7], finish="stop")])

    async def scenario():
        await server.set_global_steps(3)
        first = await server.generate([1, 2], {}, "a")
        await server.set_global_steps(4)
        second = await server.generate([1, 2], {}, "b")
        third = await server.generate([1, 2], {}, "c")
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first.extra_fields == {"global_steps": 3} and first.stop_reason == "completed"
    assert first.token_ids == [4, 5]
    assert second.extra_fields == {"global_steps": 4} and second.stop_reason == "aborted"
    assert third.stop_reason == "completed"


def test_log_probs_that_do_not_match_the_tokens_are_refused_naming_the_request(tmp_path):
    bad = _answer([4, 5], logprobs=[-0.5])
    bad["meta_info"]["output_token_logprobs"] = [[-0.5, 4, None]]
    server, _ = _server(tmp_path, [bad])
    with pytest.raises(RuntimeError, match=r"serve answered 1 log-probs for 2 tokens \(request r9\)"):
        asyncio.run(server.generate([1, 2], {"logprobs": True}, "r9"))


def test_max_new_tokens_as_verls_server_computes_it():
    from fsdp_sync.integrations.verl.replica import sampling_request

    roomy = _config(max_model_len=1000)
    # verl names none: what is left of prompt_length + response_length, at most response_length
    assert sampling_request(list(range(70)), {}, "a", roomy)["sampling_params"]["max_new_tokens"] == 10
    assert sampling_request(list(range(3)), {}, "b", roomy)["sampling_params"]["max_new_tokens"] == 16
    # named: taken as is within the context, capped by the room left
    assert sampling_request(list(range(70)), {"max_new_tokens": 500}, "c", roomy)[
        "sampling_params"]["max_new_tokens"] == 500
    assert sampling_request(list(range(70)), {"max_new_tokens": 5000}, "d", roomy)[
        "sampling_params"]["max_new_tokens"] == 1000 - 70 - 1
    # exactly full: no room for a token, none asked (verl's clamp to 0), not refused
    tight = _config()
    assert sampling_request(list(range(79)), {}, "e", tight)["sampling_params"]["max_new_tokens"] == 0
    # a prompt filling the whole context: refused, as verl's server refuses it (not 0 tokens)
    with pytest.raises(ValueError, match="prompt of 80 tokens exceeds the context length 80"):
        sampling_request(list(range(80)), {"max_new_tokens": 4}, "f", tight)


@pytest.mark.parametrize("node_rank,free,posts", [(0, True, True), (1, True, False),
                                                  (0, False, False)])
def test_memory_calls_only_from_node_0_and_only_when_verl_frees_the_cache(tmp_path, node_rank, free,
                                                                        posts):
    server, posted = _server(tmp_path, [], node_rank=node_rank, free_cache_engine=free)

    async def scenario():
        await server.sleep()
        await server.wake_up()
        await server.release_kv_cache()
        await server.resume_kv_cache()

    asyncio.run(scenario())
    want = [("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
            ("/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}),
            ("/release_memory_occupation", {"tags": ["kv_cache"]}),
            ("/resume_memory_occupation", {"tags": ["kv_cache"]})]
    assert posted == (want if posts else [])


def test_pipeline_parallel_is_refused_naming_it(tmp_path):
    from fsdp_sync.integrations.verl.replica import serve_command

    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2 must be 1"):
        serve_command(_config(pipeline_model_parallel_size=2), _model(tmp_path))
