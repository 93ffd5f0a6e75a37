"""Every HTTP request body `SGLangEngine` sends, read by the installed SGLang's own request model
as its server reads it (`make test-sglang`: 0.5.23, and 0.5.12 in the older-release run).

SGLang's server drops a field its request model does not have without a word (0.5.23: its
msgspec ``BaseReq`` schema has ``extra_behavior="ignore"``; 0.5.12: FastAPI's dataclass body), and
an omitted field takes the model's default: so a field name, a type or an omission that is wrong
never errors, the call just does something else (a pause without its mode is an abort; an
``/update_weight_version`` without ``abort_all_requests`` aborts every request in flight, its
default being True). ``test_real_sglang`` checks the field names against the source; here each
body the adapter sent (`drive`: a whole sync step with every control call, through the fake of
the installed release) is validated with ``pydantic.TypeAdapter(RequestClass).validate_json`` in a
process that imported ``sglang.srt.managers.io_struct``, and every field sent must come out of
the model with the value sent (base64 payloads decoded to the bytes sent); every omitted
``abort_all_requests`` must default to False.

Known and kept: 0.5.23's ``EndWeightUpdateReqInput`` has no fields, so ``weight_version`` and
``abort`` in ``/end_weight_update`` are dropped; the adapter sends ``/update_weight_version``
right after a commit whose answer does not echo the version, and says an abort dropped nothing
(`session_calls`; ``test_real_sglang.test_sglangs_end_weight_update_ignores_an_abort_field``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang.control import PAUSE_MODES

TIER = Path(__file__).resolve().parent
sys.path.insert(0, str(TIER.parent))
sys.path.insert(0, str(TIER))
import fake_sglang as fake  # noqa: E402
from test_real_sglang import FAKE_VERSION, INSTALLED, REQUEST_CLASSES, drive_adapter  # noqa: E402

pytestmark = pytest.mark.sglang

CLASSES = {**REQUEST_CLASSES, "/pause_generation": "PauseGenerationReqInput",
           "/continue_generation": "ContinueGenerationReqInput",
           "/update_weight_version": "UpdateWeightVersionReqInput"}
DROPPED_ON_PURPOSE = {("/end_weight_update", "weight_version"), ("/end_weight_update", "abort")}

# run in a process of its own: the stand-ins io_struct's imports need (`sglang_models`) stay there
READ = r"""
import base64, dataclasses, importlib.util, json, os, sys
sys.path.insert(0, sys.argv[1])
import sglang_models
srt = os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), "srt")
if not os.path.exists(os.path.join(srt, "runtime_context.py")):      # 0.5.12, as sglang_lora.py
    sglang_models.STUBS = sglang_models.STUBS + ("sglang.srt.configs.qwen3_asr", "sglang.srt.function_call")
import msgspec, pydantic
from sglang.srt.managers import io_struct as io

def fields(cls):
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name: f.default for f in msgspec.structs.fields(cls)}
    return {f.name: f.default for f in dataclasses.fields(cls)}

def plain(v):
    if isinstance(v, (bytes, bytearray)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v

out = []
for path, cls_name, body in json.load(sys.stdin):
    cls = getattr(io, cls_name, None)
    if cls is None:
        out.append({"path": path, "error": f"no {cls_name}"})
        continue
    try:
        obj = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
    except Exception as e:
        out.append({"path": path, "error": f"{type(e).__name__}: {e}"})
        continue
    known = fields(cls)
    out.append({"path": path,
                "unknown": sorted(set(body) - set(known)),
                "changed": {k: [body[k], plain(getattr(obj, k))] for k in body
                            if k in known and plain(getattr(obj, k)) != body[k]},
                "omitted_defaults": {k: repr(d) for k, d in known.items()
                                     if k not in body and k not in ("rid", "http_worker_ipc")}})
print("RESULT " + json.dumps(out))
"""


def drive(url: str) -> None:
    """Every control call the adapter makes over HTTP, beyond `drive_adapter`'s sync step."""
    a = sg.SGLangEngine(base_url=url, retry_backoff_s=0.01, timeout_s=10)
    for mode in PAUSE_MODES:
        a.pause_generation(mode)
    a.continue_generation()
    a.update_weight_version("v7", abort_all_requests=False)
    a.update_weight_version("v8", abort_all_requests=True)
    a.load_lora_adapter_from_tensors("p", dict(fake.mixed_tensors()[:2]),
                                     {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                      "peft_type": "LORA"}, pinned=True, added_tokens_config={"<t>": 7})
    a.unload_lora_adapter("p")
    if a.features.weight_update_session:
        a.begin_weight_update()
        a.end_weight_update(weight_version="v9")
        a.begin_weight_update()
        a.end_weight_update(abort=True)


@pytest.mark.timeout(240)
def test_every_body_the_adapter_sends_reads_back_as_sent():
    ok = (200, json.dumps({"message": "ok", "status": "ok"}))
    with fake.FakeSGLangServer(tp_size=2, version=FAKE_VERSION) as srv:
        srv.script["/pause_generation"] = [ok] * 3
        srv.script["/continue_generation"] = [ok]
        drive_adapter(srv.url)
        drive(srv.url)
        sent = [(p, CLASSES[p], b) for m, p, b in srv.requests if m == "POST" and p in CLASSES
                and isinstance(b, dict)]
    paths = {p for p, _, _ in sent}
    assert {"/pause_generation", "/continue_generation", "/update_weight_version",
            "/update_weights_from_tensor", "/update_weights_from_disk", "/load_lora_adapter_from_tensors",
            "/update_weights_from_distributed", "/init_weights_update_group"} <= paths, sorted(paths)
    proc = subprocess.run([sys.executable, "-c", READ, str(TIER)], input=json.dumps(sent),
                          capture_output=True, text=True, timeout=200)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    results = json.loads(line[7:])
    assert len(results) == len(sent)
    problems = []
    for (path, _, body), r in zip(sent, results):
        if "error" in r:
            problems.append(f"{path}: {r['error']}")
            continue
        unknown = [k for k in r["unknown"] if (path, k) not in DROPPED_ON_PURPOSE]
        if unknown:
            problems.append(f"{path}: fields {unknown} unknown to SGLang {INSTALLED.version} (dropped)")
        if r["changed"]:
            problems.append(f"{path}: SGLang reads {r['changed']} (sent, read)")
        if r["omitted_defaults"].get("abort_all_requests", "False") != "False":
            problems.append(f"{path}: abort_all_requests omitted, SGLang's default is "
                            f"{r['omitted_defaults']['abort_all_requests']}")
    assert not problems, "\n".join(problems)
    modes = [b["mode"] for p, _, b in sent if p == "/pause_generation"]
    assert modes == ["abort", "retract", "in_place"]
    versions = [(b["new_version"], b["abort_all_requests"]) for p, _, b in sent
                if p == "/update_weight_version"]
    assert ("v7", False) in versions and ("v8", True) in versions
    if INSTALLED.weight_update_session:     # what the adapter knows 0.5.23 drops, and sends again
        dropped = {(p, k) for (p, _, b), r in zip(sent, results) for k in r["unknown"]}
        assert dropped == DROPPED_ON_PURPOSE, dropped
        assert ("v9", False) in versions
