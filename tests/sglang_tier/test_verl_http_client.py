"""`fsdp-sync serve` against verl 0.9.1's own SGLang HTTP client (issue 21 item 2).

verl's ``HttpServerAdapter`` (run by `verl_client_check.py`, read from verl's wheel) calls every
route it has on a served TP-2 reference engine; each call is checked for its effect, not only for
the absence of an exception, since the adapter swallows some failures (``flush_cache`` used to
get 405 on its GET, retry, log "Failed to flush cache" and go on).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_sync.engines.reference.serve_cache import FLUSHED     # SGLang 0.5.23's text

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WHEEL = Path(sys.prefix) / "verl-wheel" / "verl-0.9.1-py3-none-any.whl"
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(240)]

CALLED = {"generate", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
          "update_weights_from_tensor", "abort_request", "shutdown"}
NOT_CALLED = {"reward_score": "asserts server_args.is_embedding before any request: embedding "
                              "models only, and the reference engine is a generation model"}
# verl's AsyncHttpServerAdapter (what its SGLang rollout drives): every async method it defines
ASYNC_CALLED = {"generate", "async_generate", "flush_cache", "available_models",
                "release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor",
                "load_lora_adapter_from_tensor", "unload_lora_adapter", "reward_score",
                "async_reward_score", "abort_request"}


def _weights(host: str, port: int, name: str) -> list:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/get_weights_by_name", json.dumps({"name": name}),
                 {"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())


def test_verls_http_client_drives_serve_and_every_call_takes_effect(tmp_path):
    assert WHEEL.is_file(), f"{WHEEL} missing: scripts/sglang_env.sh downloads it"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    serve = subprocess.Popen([sys.executable, "-m", "fsdp_sync.cli", "serve", "--port", "0",
                              "--tp", "2", "--weights-cpu-backup"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, deadline = "", time.monotonic() + 120
        while "http://" not in line and time.monotonic() < deadline and serve.poll() is None:
            line = serve.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        host, port = line.split("http://", 1)[1].split()[0].rsplit(":", 1)
        # output to a file, not a pipe: the client's torch_shm_manager (file_system strategy)
        # inherits its stdio and outlives it, so a pipe would not reach EOF when the client exits
        log = tmp_path / "verl_client.log"
        with open(log, "w") as f:
            check = subprocess.run([sys.executable, str(HERE / "verl_client_check.py"), str(WHEEL),
                                    host, port], cwd=HERE, env=env, stdout=f,
                                   stderr=subprocess.STDOUT, timeout=200)
        text = log.read_text()
        lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
        assert check.returncode == 0 and lines, text[-5000:]
        out = json.loads(lines[-1][len("RESULT "):])
        assert set(out["methods"]) == CALLED | set(NOT_CALLED), out["methods"]
        assert {"serialized_named_tensors", "load_format", "flush_cache"} <= set(out["io_struct_fields"])

        gen = out["generate"]
        assert len(gen["output_ids"]) == 6
        assert [t for _, t, _ in gen["meta_info"]["output_token_logprobs"]] == gen["output_ids"]
        assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        # SGLang answers a flush in plain text; verl's adapter returns {} when it gave up
        assert out["flush_cache"].get("text") == FLUSHED, out["flush_cache"]
        assert out["abstract_in_verl"] == ["begin_weight_update", "end_weight_update"]
        assert out["release"].get("success") is True
        assert "released" in out["generate_released"], out["generate_released"]
        assert out["resume"].get("success") is True
        assert out["generate_resumed"]["output_ids"] == gen["output_ids"]     # weights came back
        assert out["update"].get("success") is True, out["update"]
        assert out["update_served"] == [0.5] * 64

        # the async client, every method it has, each for its effect
        aout = out["async"]
        print({k: str(aout[k])[:160] for k in ("generate_released", "load_lora", "reward_score",
                                               "models", "flush_cache", "update")})
        assert set(aout["methods"]) == ASYNC_CALLED, aout["methods"]
        # greedy, same weights: both of its generate calls give the same 6 tokens
        assert len(aout["generate"]["output_ids"]) == 6
        assert aout["generate"]["output_ids"] == aout["async_generate"]["output_ids"]
        assert [t for _, t, _ in aout["generate"]["meta_info"]["output_token_logprobs"]] == \
            aout["generate"]["output_ids"]
        assert aout["flush_cache"].get("text") == FLUSHED, aout["flush_cache"]
        card = aout["models"]["data"]
        assert aout["models"]["object"] == "list" and len(card) == 1 and card[0]["object"] == "model"
        assert card[0]["max_model_len"] > 0 and card[0]["owned_by"] == "sglang"
        assert aout["release"].get("success") is True and aout["resume"].get("success") is True
        # weights released: the server cannot serve now, a 503 a client may retry (issue 36 item 3)
        assert aout["generate_released"] != "answered" and "503" in aout["generate_released"], \
            aout["generate_released"]
        assert aout["generate_resumed"]["output_ids"] == aout["generate"]["output_ids"]
        assert aout["update"].get("success") is True and aout["update_served"] == [0.25] * 64
        # LoRA is refused by name (400), classify is a route of embedding models only (404)
        assert "400" in aout["load_lora"] and "400" in aout["unload_lora"], (aout["load_lora"],
                                                                             aout["unload_lora"])
        assert "404" in aout["reward_score"] and "404" in aout["async_reward_score"]
        # SGLang 0.5.23 answers /abort_request 200 with an empty body, which verl reads as {}
        assert aout["abort"] == {} and aout["abort_all"] == {}, aout
        assert _weights(host, int(port), "model.norm.weight") == [0.25] * 64
        assert out["abort"] == {} and out["abort_all"] == {}, out
        assert serve.poll() is None                    # shutdown() of a client leaves it serving
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(timeout=10)
