"""Drive `fsdp-sync serve` with verl 0.9.1's own SGLang HTTP client, ``HttpServerAdapter``; prints JSON.

verl is not installed in the SGLang tier (its dependencies pin another torch); its client module,
``verl/workers/rollout/sglang_rollout/http_server_engine.py``, is read from verl's wheel (which
`scripts/sglang_env.sh` downloads) and imported as it is, with the real sglang beside it. Two of the
module's imports are replaced by stand-ins: ``sglang.srt.entrypoints.http_server`` (``launch_server``,
which starts SGLang's own server and is never called here: ``launch_server=False``), SGLang's
modules that need torchvision (`sglang_models.STUBS`), and ``io_struct``'s request class (its
fields read from SGLang's source). verl's adapter catches some errors and only
logs them (``flush_cache`` gives ``{}`` after its retries), so every call's answer is printed and
the test checks each one took effect.

Usage: python verl_client_check.py WHEEL HOST PORT
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import zipfile

import sglang_models  # installs the stand-ins for modules that need torchvision


wheel, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
stub = types.ModuleType("sglang.srt.entrypoints.http_server")


def _never(*a, **k):
    raise AssertionError("verl's adapter tried to launch SGLang's own server")


stub.launch_server = _never
sys.modules["sglang.srt.entrypoints.http_server"] = stub

# SGLang's io_struct does not import on a CPU tier (its imports reach the openai package and more);
# the adapter reads three fields of UpdateWeightsFromTensorReqInput, so that class is stood in for
# by one whose fields are read from io_struct's source (checked by the test, not assumed here)
import ast  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402

import sglang  # noqa: E402

_src = os.path.join(os.path.dirname(sglang.__file__), "srt", "managers", "io_struct.py")
_cls = next(n for n in ast.parse(open(_src).read()).body
            if isinstance(n, ast.ClassDef) and n.name == "UpdateWeightsFromTensorReqInput")
FIELDS = [n.target.id for n in _cls.body if isinstance(n, ast.AnnAssign)]
_io = types.ModuleType("sglang.srt.managers.io_struct")
_io.UpdateWeightsFromTensorReqInput = dataclasses.make_dataclass(
    "UpdateWeightsFromTensorReqInput",
    [("serialized_named_tensors", list)] + [(f, object, dataclasses.field(default=None))
                                           for f in FIELDS if f != "serialized_named_tensors"])
sys.modules["sglang.srt.managers.io_struct"] = _io

MEMBER = "verl/workers/rollout/sglang_rollout/http_server_engine.py"
source = zipfile.ZipFile(wheel).read(MEMBER).decode()
spec = importlib.util.spec_from_loader("verl_http_server_engine", loader=None, origin=MEMBER)
mod = importlib.util.module_from_spec(spec)
exec(compile(source, f"{wheel}/{MEMBER}", "exec"), mod.__dict__)

import torch  # noqa: E402
UpdateWeightsFromTensorReqInput = _io.UpdateWeightsFromTensorReqInput
from sglang.srt.utils import MultiprocessingSerializer  # noqa: E402

# sglang 0.5.23's EngineBase declares begin/end_weight_update abstract, which verl 0.9.1's adapter
# (written against an older sglang) does not define: the class cannot be instantiated as it is.
# A subclass adds the two, refusing; nothing else of verl's class changes.
missing = sorted(getattr(mod.HttpServerAdapter, "__abstractmethods__", ()))


class Adapter(mod.HttpServerAdapter):
    def begin_weight_update(self, *a, **k):
        raise NotImplementedError("not in verl 0.9.1's HttpServerAdapter")

    end_weight_update = begin_weight_update


adapter = Adapter(launch_server=False, host=host, port=port, model_path="unused",
                                max_attempts=2, retry_delay=0.1, timeout=60)
out: dict = {"io_struct_fields": FIELDS, "abstract_in_verl": missing, "methods": sorted(n for n in vars(mod.HttpServerAdapter)
                               if not n.startswith("_") and callable(getattr(adapter, n)))}
import urllib.request  # noqa: E402


def served(name: str) -> list:
    """What the server now serves under ``name`` (SGLang's /get_weights_by_name)."""
    req = urllib.request.Request(f"http://{host}:{port}/get_weights_by_name",
                                 json.dumps({"name": name}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


prompt = [11, 27, 93, 5]
greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
out["generate"] = adapter.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True)
out["flush_cache"] = adapter.flush_cache()
out["release"] = adapter.release_memory_occupation()          # tags None: everything
try:
    adapter.generate(input_ids=prompt, sampling_params=greedy)
    out["generate_released"] = "answered"
except Exception as e:  # noqa: BLE001 - the refusal is what is checked
    out["generate_released"] = str(getattr(getattr(e, "response", None), "text", e))
out["resume"] = adapter.resume_memory_occupation(tags=[])        # []: everything, as SGLang
out["generate_resumed"] = adapter.generate(input_ids=prompt, sampling_params=greedy)
# CPU tensors: torch's default "file_descriptor" strategy hands a storage over through the
# sender's multiprocessing resource sharer, which only processes of the sender's own tree (same
# authkey) may connect to; the served engine is not one, and serve refuses rebuild_storage_fd.
# The "file_system" strategy names a shared-memory file any local process can open.
torch.multiprocessing.set_sharing_strategy("file_system")
norm = torch.full((64,), 0.5)
payload = [("model.norm.weight", norm)]
req = UpdateWeightsFromTensorReqInput(
    serialized_named_tensors=[MultiprocessingSerializer.serialize(payload) for _ in range(2)],
    load_format=None, flush_cache=True)
out["update"] = adapter.update_weights_from_tensor(req)
out["abort"] = adapter.abort_request(rid="no-such-request")
out["abort_all"] = adapter.abort_request(abort_all=True)
out["update_served"] = served("model.norm.weight")
adapter.shutdown()                                 # launched nothing: must not touch the server


# verl's AsyncHttpServerAdapter: the class verl 0.9.1's SGLang rollout (ServerAdapter) drives, with
# aiohttp; every async method it has, each checked for its effect
class AsyncAdapter(mod.AsyncHttpServerAdapter):
    begin_weight_update = end_weight_update = Adapter.begin_weight_update


async def async_calls() -> dict:
    a = AsyncAdapter(launch_server=False, host=host, port=port, model_path="unused",
                     max_attempts=2, retry_delay=0.1, timeout=60)
    got: dict = {"methods": sorted(n for n in vars(mod.AsyncHttpServerAdapter)
                                   if not n.startswith("_") and callable(getattr(a, n)))}
    got["generate"] = await a.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True)
    got["async_generate"] = await a.async_generate(input_ids=prompt, sampling_params=greedy)
    got["flush_cache"] = await a.flush_cache()
    got["models"] = await a.available_models()
    got["release"] = await a.release_memory_occupation()
    try:
        await a.generate(input_ids=prompt, sampling_params=greedy)
        got["generate_released"] = "answered"
    except Exception as e:  # noqa: BLE001 - the refusal is what is checked
        got["generate_released"] = f"{type(e).__name__}: {e}"
    got["resume"] = await a.resume_memory_occupation(tags=None)
    got["generate_resumed"] = await a.generate(input_ids=prompt, sampling_params=greedy)
    quarter = [("model.norm.weight", torch.full((64,), 0.25))]
    got["update"] = await a.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(quarter) for _ in range(2)],
        load_format=None, flush_cache=True))
    got["update_served"] = served("model.norm.weight")
    lora = types.SimpleNamespace(lora_name="x", config_dict={}, serialized_named_tensors=[b"x"])
    for name, call in (("load_lora", a.load_lora_adapter_from_tensor(lora)),
                       ("unload_lora", a.unload_lora_adapter("x"))):
        try:
            got[name] = await call
        except Exception as e:  # noqa: BLE001 - the refusal is what is checked
            got[name] = f"{type(e).__name__}: {e}"
    for name, call in (("reward_score", a.reward_score(input_ids=prompt)),
                       ("async_reward_score", a.async_reward_score(input_ids=prompt))):
        try:
            got[name] = await call
        except BaseException as e:  # noqa: BLE001 - an AssertionError on a generation model
            got[name] = f"{type(e).__name__}: {e}"
    got["abort"] = await a.abort_request(rid="no-such-request")
    got["abort_all"] = await a.abort_request(abort_all=True)
    return got


import asyncio  # noqa: E402

out["async"] = asyncio.run(async_calls())
print("RESULT " + json.dumps(out))
