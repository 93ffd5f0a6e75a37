"""The ``fsdp_sync_ref`` rollout's pieces without Ray (`make test-verl`): serve's command line from
verl's config (and what it refuses), verl's sampling parameters as serve's ``/generate`` body, and
the hold between ``abort_all_requests`` and ``resume_generation``. The whole replica runs in verl's
own loop in test_verl_trainer.py."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


def _config(**kw):
    base = dict(tensor_model_parallel_size=2, data_parallel_size=1, pipeline_model_parallel_size=1,
                dtype="float32", response_length=16, prompt_length=64, max_model_len=None,
                free_cache_engine=True, custom=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return types.SimpleNamespace(local_path=str(tmp_path), path=str(tmp_path))


def test_serve_command_from_verls_config_and_its_refusals(tmp_path):
    from fsdp_sync.integrations.verl.replica import serve_command

    cmd = serve_command(_config(), _model(tmp_path))
    assert cmd[1:4] == ["-m", "fsdp_sync.cli", "serve"]
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "config.json")
    assert cmd[cmd.index("--tp") + 1] == "2" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--port") + 1] == "0"
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        serve_command(_config(data_parallel_size=2), _model(tmp_path))
    with pytest.raises(ValueError, match="rollout.dtype='float8'"):
        serve_command(_config(dtype="float8"), _model(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        serve_command(_config(), types.SimpleNamespace(local_path=str(tmp_path / "nowhere")))
    assert "--quantization" not in cmd          # verl's rollout.quantization: null
    fp8 = serve_command(_config(quantization="fp8"), _model(tmp_path))
    assert fp8[fp8.index("--quantization") + 1] == "fp8"
    with pytest.raises(ValueError, match="rollout.quantization='torchao'"):
        serve_command(_config(quantization="torchao"), _model(tmp_path))


def test_sampling_request_translates_verls_parameters():
    from fsdp_sync.integrations.verl.replica import sampling_request

    cfg = _config()
    sp = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    body = sampling_request([1, 2, 3], sp, "r1", cfg)
    assert body == {"rid": "r1", "input_ids": [1, 2, 3], "return_logprob": True,
                    "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "repetition_penalty": 1.0, "max_new_tokens": 16}}
    assert sp["logprobs"] is True                       # the caller's dict is left alone
    # max_tokens (vLLM's name) is read, capped by the context left
    body = sampling_request(list(range(70)), {"max_tokens": 50}, "r2", cfg)
    assert body["sampling_params"]["max_new_tokens"] == 64 + 16 - 70 - 1
    with pytest.raises(ValueError, match="exceeds the context length"):
        sampling_request(list(range(81)), {}, "r3", cfg)
    with pytest.raises(ValueError, match="image_data"):
        sampling_request([1], {}, "r4", cfg, image_data=["x"])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        sampling_request([1], {"prompt_logprobs": 1}, "r5", cfg)


def test_abort_holds_new_requests_until_resume_or_refuses_them(tmp_path):
    from fsdp_sync.integrations.verl.replica import ServeServer

    server = ServeServer(_config(), _model(tmp_path), replica_rank=0, node_rank=0)
    posted = []

    async def post(path, body):
        posted.append(path)
        if path == "/generate":
            return {"output_ids": [5, 6], "meta_info": {
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                "finish_reason": {"type": "length"}}}
        return {"success": True}

    server._post = post

    async def scenario():
        await server.abort_all_requests()
        held = asyncio.ensure_future(server.generate([1, 2], {"logprobs": True}, "a"))
        await asyncio.sleep(0.2)
        assert not held.done() and posted == ["/abort_request"]
        await server.resume_generation()
        out = await asyncio.wait_for(held, 5)
        assert out.token_ids == [5, 6] and out.log_probs == [-0.5, -0.25]
        assert out.stop_reason == "completed"
        await server.abort_all_requests(reject_request=True)
        with pytest.raises(RuntimeError, match="paused"):
            await server.generate([1, 2], {}, "b")
        await server.resume_generation()
        assert (await server.generate([1, 2], {}, "c")).log_probs is None

    asyncio.run(scenario())
    assert posted.count("/generate") == 2
