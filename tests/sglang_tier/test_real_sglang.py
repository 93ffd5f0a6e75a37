"""fsdp_sync's SGLang payloads and adapter calls against the installed sglang (`make test-sglang`).

- SGLang's deserializer and ``FlattenedTensorBucket`` rebuild our payloads bit-exact, in processes
  of their own, for bf16 / fp16 / fp32 / int64 (a ``bf16[3]`` followed by an ``int64`` included).
- Every global our payloads name is on SGLang's allow-list, and it refuses classes of ours.
- Every call the adapter makes binds to the installed ``sglang.Engine`` signatures; every HTTP
  route and body field it sends exists in the installed server.
- LoRA from tensors: the body is the installed ``LoadLoRAAdapterFromTensorsReqInput`` (its required
  fields, its payload field and type: one payload or one per TP rank), and SGLang's own
  deserializer, as the installed TP worker calls it, opens in each rank's process the dict sent;
  in process, the adapters are listed from the Engine's LoRA registry, as ``/v1/models`` lists them.
- The release table (`engines.sglang.versions`) says what the installed release has: the
  weight-update session, the checker's fields, the LoRA-from-tensors payload field, the receive
  bucket's pre-check.

`make test-sglang` runs this file against 0.5.23 and again against 0.5.12 (verl 0.9.1's pin): the
adapter is driven through the fake of the installed release (`fake_sglang`: 0.5.12 has no
weight-update session and a checker that takes only ``action``).

On a CPU-only torch ``sglang.srt.entrypoints.engine`` does not import (torchvision), so Engine's
signatures and the server's routes are read from the installed source when the import fails.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import os
import pickle
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import sglang
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.common import SafeUnpickler

from fsdp_sync.weights.bucket import BucketEntry
from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import versions

TIER = Path(__file__).resolve().parent
sys.path.insert(0, str(TIER.parent))
import fake_sglang as fake  # noqa: E402

mixed_tensors = fake.mixed_tensors

pytestmark = pytest.mark.sglang

SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
INSTALLED = versions.features(sglang.__version__)
FAKE_VERSION = "0.5.12" if not INSTALLED.weight_update_session else "0.5.23"


class _Resolved(pickle.Unpickler):
    def find_class(self, module, name):      # stands for the import SGLang's check would allow
        return (module, name)


class _AllowProbe(SafeUnpickler, _Resolved):
    """SGLang's own ``find_class`` check, whose ``super().find_class`` lands in `_Resolved`: the rule
    decides without importing the module (0.5.12's model_runner does not import on CPU)."""


def unpickler_allows(module: str, name: str) -> bool:
    """SGLang's own ``SafeUnpickler.find_class`` decides (0.5.12: module prefixes and a deny list;
    0.5.21 on: an exact allow-list)."""
    try:
        return _AllowProbe(io.BytesIO(b"")).find_class(module, name) == (module, name)
    except Exception:   # noqa: BLE001 - SGLang raises RuntimeError / UnpicklingError by release
        return False


@pytest.fixture(scope="module")
def sglang_opener(tmp_path_factory, leftovers_check):
    """`sglang_open.py --serve`: one process that imported SGLang's modules; each payload is then
    opened in a child forked from it, a process of its own per TP rank."""
    cwd = tmp_path_factory.mktemp("sglang_open")
    with leftovers_check():
        with open(cwd / "stderr.log", "w") as err:
            proc = subprocess.Popen([sys.executable, str(TIER / "sglang_open.py"), "--serve"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    text=True, cwd=cwd)
        try:
            yield proc, cwd / "stderr.log"
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def open_with_sglang(opener, tmp_path: Path, payloads: list, tag: str) -> list[dict]:
    """Each TP rank's payload opened once with SGLang's code, in a process of its own."""
    proc, log = opener
    paths = []
    for rank, p in enumerate(payloads):
        path = tmp_path / f"{tag}-rank{rank}.{'b64' if isinstance(p, str) else 'bin'}"
        path.write_bytes(p.encode("ascii") if isinstance(p, str) else p)
        paths.append(str(path))
    proc.stdin.write(json.dumps(paths) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], 180)
    line = proc.stdout.readline() if ready else ""
    answer = json.loads(line) if line else {"error": "no answer in 180 s"}
    assert "results" in answer, f"{answer.get('error')}; sglang_open.py: {log.read_text()[-3000:]}"
    assert len(answer["results"]) == len(payloads)
    return answer["results"]


@pytest.mark.timeout(60)
def test_installed_stack():
    want = os.environ.get("FSDP_SYNC_SGLANG_VERSION")
    if want:
        assert sglang.__version__ == want
    assert torch.version.cuda is None, f"the tier runs on the CPU torch, got {torch.__version__}"


@pytest.mark.timeout(300)
def test_sglang_rebuilds_our_payloads_bit_exact(sglang_opener, tmp_path):
    named = mixed_tensors(seed=7)
    with sg.flattened_bucket_payloads(named, 2) as payloads:
        results = open_with_sglang(sglang_opener, tmp_path, payloads, "bytes")
    assert len(results) == 2
    for r in results:
        assert r["keys"] == ["flattened_tensor", "metadata"]
        assert r["digests"] == fake.digests(named)


@pytest.mark.timeout(300)
def test_sglang_rebuilds_base64_payloads_bit_exact(sglang_opener, tmp_path):
    named = mixed_tensors(seed=8)
    with sg.flattened_bucket_payloads(named, 1, output_str=True) as payloads:
        (result,) = open_with_sglang(sglang_opener, tmp_path, payloads, "b64")
    assert result["digests"] == fake.digests(named)


@pytest.mark.timeout(60)
def test_our_globals_are_on_sglangs_allow_list():
    refused = sorted(g for g in fake.ALLOWED_GLOBALS if not unpickler_allows(*g))
    assert not refused, refused


@pytest.mark.timeout(60)
def test_sglang_refuses_our_classes_and_takes_simplenamespace_metadata():
    entry = BucketEntry("w", torch.float32, (2,), 0, 8)
    with pytest.raises(Exception, match="Blocked unsafe"):   # "global" / "class loading" by release
        MultiprocessingSerializer.deserialize(pickle.dumps([entry]))
    with sg.flattened_bucket_payloads(mixed_tensors()[:2], 1) as payloads:
        obj = MultiprocessingSerializer.deserialize(payloads[0])     # in process, opened once
        assert [m.name for m in obj["metadata"]] == payloads.names
        del obj


# --------------------------------------------------------------------------- signatures

def _ast_signature(fn: ast.FunctionDef) -> inspect.Signature:
    a, params, marker = fn.args, [], object()
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = (inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs)
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params.append(inspect.Parameter(arg.arg, kind, default=inspect.Parameter.empty
                                        if d is None else marker))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=inspect.Parameter.empty if d is None else marker))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _class_node(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name} in {path}")


def engine_signatures(names) -> tuple[dict[str, inspect.Signature], str]:
    """``sglang.Engine``'s signatures: imported if it imports, else read from its source."""
    try:
        from sglang.srt.entrypoints.engine import Engine
        return {n: inspect.signature(getattr(Engine, n)) for n in names}, "imported"
    except Exception as e:   # noqa: BLE001 - e.g. torchvision missing on a CPU torch
        why = f"{type(e).__name__}: {e}"
    cls = _class_node(SRT / "entrypoints" / "engine.py", "Engine")
    defs = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = [n for n in names if n not in defs]
    assert not missing, f"sglang.Engine {sglang.__version__} has no {missing}"
    return {n: _ast_signature(defs[n]) for n in names}, f"read from source ({why})"


LORA_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def drive_adapter(target) -> None:
    """A whole sync step through the adapter, as the sharding manager drives it."""
    a = sg.SGLangEngine(target) if not isinstance(target, str) else sg.SGLangEngine(
        base_url=target, retry_backoff_s=0.01, timeout_s=10)
    named = mixed_tensors()
    _ = a.tp_size
    a.release_memory_occupation(["kv_cache", "weights"])
    a.resume_memory_occupation(["weights"])
    a.begin_weight_update()
    a.update_weights_from_bucket(named[:3], flush_cache=False)
    a.update_weights_from_tensor([(n, t) for n, t in named[3:]], load_format=None)
    a.init_weights_update_group("127.0.0.1", 29999, 1, 1 + a.tp_size, "weight_update_group", "gloo")
    a.update_weights_from_distributed([named[0][0]], [str(named[0][1].dtype).removeprefix("torch.")],
                                      [list(named[0][1].shape)],
                                      "weight_update_group", flush_cache=False,
                                      load_format="flattened_bucket")
    a.destroy_weights_update_group("weight_update_group")
    a.end_weight_update()
    with tempfile.TemporaryDirectory() as d:     # the disk method: a checkpoint SGLang reloads
        from safetensors.torch import save_file

        save_file(dict(named[:2]), os.path.join(d, "model.safetensors"))
        # a server takes weight_version in the body; sglang.Engine's method cannot (refused)
        a.update_weights_from_disk(d, **({"weight_version": "v1"} if a.is_http else {}))
    a.resume_memory_occupation(["kv_cache"])
    a.generate([[1, 2, 3]], max_new_tokens=3)
    a.get_weights_by_name(named[0][0], truncate_size=2)
    a.load_lora_adapter_from_tensors("sync", dict(named[:2]), dict(LORA_CONFIG))   # LoRA
    a.available_models()
    a.unload_lora_adapter("sync")
    if a.is_http:       # verify's probe: SGLang serves /weights_checker over HTTP only
        skip = {"skip_tensor_list": ["rotary_emb"]} if "skip_tensor_list" in \
            a.features.weights_checker_fields else {}
        a.weights_checker("checksum", **skip)
    a.flush_cache()
    a.release_memory_occupation()
    a.shutdown()


@pytest.mark.timeout(60)
def test_adapter_calls_bind_to_installed_engine(record_property):
    eng = (fake.FakeSGLangEngine if FAKE_VERSION == "0.5.23" else fake.Fake0512Engine)(tp_size=2)
    drive_adapter(eng)
    called = sorted({name for name, _ in eng.calls})
    sigs, how = engine_signatures(called)
    record_property("engine_signatures", how)
    print(f"sglang.Engine {sglang.__version__} signatures: {how}")
    assert called and set(called) <= set(sigs), (called, sorted(sigs))
    for name, kwargs in eng.calls:
        sigs[name].bind(None, **kwargs)                 # None stands for self


def _routes() -> dict[str, set[str]]:
    tree = ast.parse((SRT / "entrypoints" / "http_server.py").read_text())
    routes: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in node.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and isinstance(d.func.value, ast.Name) and d.func.value.id == "app"
                    and d.args and isinstance(d.args[0], ast.Constant)):
                continue
            verb = d.func.attr
            if verb == "api_route":
                methods = next((ast.literal_eval(k.value) for k in d.keywords
                                if k.arg == "methods"), ["GET"])
            elif verb in ("get", "post", "put", "delete"):
                methods = [verb.upper()]
            else:
                continue
            routes.setdefault(d.args[0].value, set()).update(methods)
    return routes


def _fields(cls_name: str, path: Path | None = None) -> set[str]:
    """Annotated fields (dataclass / msgspec Struct / pydantic) and ``__init__`` arguments of a
    class (default: in io_struct.py, else utils/weight_checker.py, where 0.5.12 keeps the
    checker's answer models)."""
    if path is None:
        paths = [SRT / "managers" / "io_struct.py", SRT / "utils" / "weight_checker.py"]
        path = next((p for p in paths if f"class {cls_name}(" in p.read_text()), paths[0])
    cls = _class_node(path, cls_name)
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
             and isinstance(n.target, ast.Name)}
    for n in cls.body:
        if isinstance(n, ast.FunctionDef) and n.name == "__init__":
            names |= {a.arg for a in n.args.args + n.args.kwonlyargs}
    return names


def _sampling_params() -> set[str]:
    return _fields("SamplingParams", SRT / "sampling" / "sampling_params.py")


REQUEST_CLASSES = {
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/generate": "GenerateReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


@pytest.mark.timeout(60)
def test_adapter_http_requests_match_installed_server():
    with fake.FakeSGLangServer(tp_size=2, version=FAKE_VERSION) as srv:
        drive_adapter(srv.url)
        requests = list(srv.requests)
    if not INSTALLED.weight_update_session:
        assert not {p for _, p, _ in requests} & {"/begin_weight_update", "/end_weight_update"}
    routes = _routes()
    for method, path, body in requests:
        assert method in routes.get(path, set()), f"{method} {path} not served by sglang " \
            f"{sglang.__version__} (routes: {sorted(routes.get(path, []))})"
        if body and path in REQUEST_CLASSES:
            unknown = set(body) - _fields(REQUEST_CLASSES[path])
            assert not unknown, f"{path} body fields {sorted(unknown)} unknown to sglang"
        if path == "/generate":
            assert set(body["sampling_params"]) <= _sampling_params()


# What the installed TP worker does with the LoRA request's payload field, each rank in a process
# of its own (forked from one that imported SGLang): 0.5.12's ``TpModelWorker
# .load_lora_adapter_from_tensors`` deserializes the one ``serialized_tensors`` on every rank;
# 0.5.23's ``deserialize_own_rank`` takes ``serialized_named_tensors[tp_rank]`` (base64 decoded
# by the request model, ``normalize_serialized_named_tensor_payload`` here) after
# ``monkey_patch_torch_reductions``. Both hand the result to the LoRA manager as ``tensors``.
OPEN_LORA = r"""
import gc, hashlib, json, os, sys
import torch
from sglang.srt.utils import MultiprocessingSerializer
field, tp, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path) as f:
    value = json.load(f)
out = []
for rank in range(tp):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            if field == "serialized_tensors":
                tensors = MultiprocessingSerializer.deserialize(value)
            else:
                from sglang.srt.utils.common import normalize_serialized_named_tensor_payload
                from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
                monkey_patch_torch_reductions()
                tensors = MultiprocessingSerializer.deserialize(
                    normalize_serialized_named_tensor_payload(value[rank]))
            answer = {"type": type(tensors).__name__, "digests": {
                n: [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(
                    t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                for n, t in tensors.items()}}
            del tensors
            gc.collect()            # the mappings closed (and counted) before the exit
            with os.fdopen(w, "w") as f:
                json.dump(answer, f)
            code = 0
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out.append(json.loads(data) if code == 0 else {"error": f"rank {rank} exit {code}"})
print("RESULT " + json.dumps(out))
"""


def _lora_request() -> tuple[dict[str, str], set[str]]:
    """``LoadLoRAAdapterFromTensorsReqInput``'s fields (annotation text) and its required ones."""
    cls = _class_node(SRT / "managers" / "io_struct.py", "LoadLoRAAdapterFromTensorsReqInput")
    fields = {n.target.id: ast.unparse(n.annotation) for n in cls.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    required = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.value is None}
    return fields, required


@pytest.mark.timeout(180)
def test_lora_http_body_is_the_installed_request_and_sglang_opens_it(tmp_path):
    """The adapter's ``/load_lora_adapter_from_tensors`` body against the installed release: every
    required field there, no field the request lacks, the payload field the release reads with
    its type (0.5.12: one ``str``; 0.5.23: a list, one per TP rank); and SGLang's deserializer,
    called as the installed TP worker calls it, gives each rank the ``{name: tensor}`` dict sent,
    bit for bit (while the adapter still holds the payloads' segments)."""
    fields, required = _lora_request()
    field = INSTALLED.lora_tensors_field
    opened: list = []

    class SGLangOpensFirst(fake.FakeSGLangServer):
        def _load_lora(self, body):
            if field in body:
                path = tmp_path / "lora_payload.json"
                path.write_text(json.dumps(body[field]))
                proc = subprocess.run([sys.executable, "-c", OPEN_LORA, field,
                                       str(self.engine.tp_size), str(path)],
                                      capture_output=True, text=True, timeout=120)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                opened.append(json.loads(line[7:]) if line else {"error": proc.stderr[-3000:]})
            # SGLang's workers were the TP ranks: each opening gave back the one reference the
            # adapter counted for it, so the fake opens nothing more (it would over-count)
            return 200, "application/json", json.dumps({"success": True, "error_message": None})

    named = mixed_tensors(seed=5)
    with SGLangOpensFirst(tp_size=2, version=FAKE_VERSION) as srv:
        a = sg.SGLangEngine(base_url=srv.url, timeout_s=150)
        a.load_lora_adapter_from_tensors("a", named, dict(LORA_CONFIG), pinned=True,
                                         added_tokens_config={"<t>": 7})
        (body,) = [b for _, p, b in srv.requests if p == "/load_lora_adapter_from_tensors"]
    assert required <= set(body) <= set(fields), (sorted(body), sorted(fields), sorted(required))
    assert field in required, (field, sorted(required))
    if "List[" in fields[field]:          # one payload per TP rank
        assert isinstance(body[field], list) and len(body[field]) == 2, type(body[field])
        assert all(isinstance(p, str) for p in body[field])
    else:
        assert fields[field] == "str" and isinstance(body[field], str), (fields[field], type(body[field]))
    assert body["pinned"] is True and body["added_tokens_config"] == {"<t>": 7}
    assert len(opened) == 1 and isinstance(opened[0], list), opened
    assert [r.get("type") for r in opened[0]] == ["dict", "dict"], opened[0]
    for r in opened[0]:
        assert r["digests"] == fake.digests(named)


def _assigns_self(node: ast.AST, attr: str) -> bool:
    """Whether ``node`` (a class) assigns ``self.<attr>`` anywhere."""
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, ast.Store)
               and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(node))


@pytest.mark.timeout(60)
def test_in_process_adapter_list_is_the_engines_lora_registry():
    """In process, `SGLangEngine.available_models` reads what the installed ``/v1/models`` route
    reads: ``Engine.tokenizer_manager`` (``lora_registry``, ``served_model_name``), not a
    ``lora_adapters`` the Engine lacks; the real ``LoRARegistry``, filled as the tokenizer manager
    fills it for an adapter loaded from tensors, is listed card for card (the installed
    ``ModelCard``'s fields) and emptied by its unregister; the fake's registry holds the installed
    ``LoRARef``'s fields."""
    import asyncio

    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry

    engine_src = (SRT / "entrypoints" / "engine.py").read_text()
    engine = _class_node(SRT / "entrypoints" / "engine.py", "Engine")
    assert _assigns_self(engine, "tokenizer_manager") and "lora_adapters" not in engine_src
    tm = _class_node(SRT / "managers" / "tokenizer_manager.py", "TokenizerManager")
    assert _assigns_self(tm, "lora_registry") and _assigns_self(tm, "served_model_name")
    route = next(n for n in ast.walk(ast.parse((SRT / "entrypoints" / "http_server.py").read_text()))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == "available_models")
    route_src = ast.unparse(route)
    assert "tokenizer_manager.lora_registry" in route_src and ".get_all_adapters()" in route_src
    mixin = (SRT / "managers" / "tokenizer_control_mixin.py").read_text()
    assert 'lora_path="__tensor__"' in mixin          # what the fake registers tensors under

    registry = LoRARegistry()
    asyncio.run(registry.register(LoRARef(lora_name="sync", lora_path="__tensor__")))
    eng = (fake.FakeSGLangEngine if FAKE_VERSION == "0.5.23" else fake.Fake0512Engine)(tp_size=2)
    eng.tokenizer_manager.lora_registry = registry
    a = sg.SGLangEngine(eng)
    cards = a.available_models()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("fake-model", "fake-model", None), ("sync", "__tensor__", "fake-model")]
    card_fields = _fields("ModelCard", SRT / "entrypoints" / "openai" / "protocol.py")
    assert all(set(c) == card_fields for c in cards), (cards, card_fields)
    asyncio.run(registry.unregister("sync"))
    assert [c["id"] for c in a.available_models()["data"]] == ["fake-model"]

    ours = fake.FakeLoRARegistry()
    ours.register("sync")
    (ref,) = ours.get_all_adapters().values()
    assert set(vars(ref)) == _fields("LoRARef", SRT / "lora" / "lora_registry.py")


@pytest.mark.timeout(60)
def test_weights_checker_request_and_answer_are_sglangs():
    """The fake's /weights_checker takes exactly SGLang's request fields and answers its shape
    (per rank: ChecksumInfo with ParallelismInfo), so the adapter's reading of it holds."""
    fields = (fake.FakeSGLangServer.CHECK_WEIGHTS_FIELDS if FAKE_VERSION == "0.5.23"
              else fake.FakeSGLangServer.CHECK_WEIGHTS_FIELDS_0512)
    assert set(fields) == _fields("CheckWeightsReqInput")
    assert "POST" in _routes()["/weights_checker"]
    with fake.FakeSGLangServer(tp_size=2, version=FAKE_VERSION) as srv:
        srv.engine.weights = dict(mixed_tensors()[:2])
        report = sg.SGLangEngine(base_url=srv.url).weights_checker()
    answer = {"success", "message", "ranks"} | (
        {"per_engine_checksum"} if FAKE_VERSION == "0.5.23" else set())
    assert answer == set(report)
    source = (SRT / "entrypoints" / "http_server.py").read_text()
    assert ('"per_engine_checksum"' in source) == ("per_engine_checksum" in report)
    for info in report["ranks"]:
        assert set(info) == _fields("ChecksumInfo")
        assert set(info["parallelism_info"]) == _fields("ParallelismInfo")


@pytest.mark.timeout(60)
def test_local_serialized_tensor_is_where_the_adapter_looks():
    """`SerializedPerRank` values become SGLang's LocalSerializedTensor, imported lazily from here."""
    found = []
    for module in ("model_executor/model_runner_components/weight_updater.py",
                   "model_executor/model_runner.py"):
        path = SRT / module
        if path.exists():
            tree = ast.parse(path.read_text())
            found += [module for n in tree.body
                      if isinstance(n, ast.ClassDef) and n.name == "LocalSerializedTensor"]
    assert found, "no LocalSerializedTensor where fsdp_sync.engines.sglang looks for it"
    assert any(unpickler_allows(f"sglang.srt.{f[:-3].replace('/', '.')}", "LocalSerializedTensor")
               for f in found)


@pytest.mark.timeout(60)
def test_a_server_gets_local_serialized_tensor_under_its_releases_path():
    """Over HTTP `SerializedPerRank` values go as LocalSerializedTensor under the path of the
    release the server reports (the trainer may run another release, or none): the path this
    release defines the class at, and one its unpickler lets through, with the values intact."""
    import io
    import pickle

    from fsdp_sync.engines.base import SerializedPerRank
    from fsdp_sync.weights import handles

    with fake.FakeSGLangServer(tp_size=2, version=FAKE_VERSION) as srv:
        obj = sg.SGLangEngine(base_url=srv.url)._to_sglang(SerializedPerRank(values=[b"r0", b"r1"]))
    named: list = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            if name == "LocalSerializedTensor":
                named.append((module, name))
                return type(name, (), {})
            return super().find_class(module, name)

    lease = handles.make_payloads([("w", obj)], 1, tagged=False)
    try:
        ((_, got),) = Recording(io.BytesIO(lease.payloads[0])).load()
    finally:
        lease.release(require_ack=False, unopened=[0])
    ((module, name),) = named
    path = SRT.parent / (module.removeprefix("sglang.").replace(".", "/") + ".py")
    assert path.exists(), path
    assert any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.parse(path.read_text()).body)
    assert unpickler_allows(module, name) and got.values == [b"r0", b"r1"]


@pytest.mark.timeout(60)
def test_release_table_matches_installed_sglang():
    """`versions.features(sglang.__version__)` against the installed code: what the adapter skips
    or refuses for this release is what the release lacks."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    f = INSTALLED
    routes = _routes()
    engine = _class_node(SRT / "entrypoints" / "engine.py", "Engine")
    methods = {n.name for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name in ("begin_weight_update", "end_weight_update"):
        assert (f"/{name}" in routes) is f.weight_update_session, (name, sglang.__version__)
        assert (name in methods) is f.weight_update_session, (name, sglang.__version__)
    assert set(f.weights_checker_fields) == _fields("CheckWeightsReqInput")
    lora = _class_node(SRT / "managers" / "io_struct.py", "LoadLoRAAdapterFromTensorsReqInput")
    annotations = {n.target.id: ast.unparse(n.annotation) for n in lora.body
                   if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert f.lora_tensors_field in annotations, sorted(annotations)
    # 0.5.12: ``str`` (one payload for every rank); 0.5.23: ``Annotated[List[bytes], ...]``
    assert ("List[" in annotations[f.lora_tensors_field]) is f.lora_tensors_per_rank
    assert hasattr(FlattenedTensorBucket, "empty") is f.distributed_bucket_prechecked
    assert sglang.__version__ in versions.CHECKED


@pytest.mark.timeout(60)
def test_release_table_flush_after_a_retract_pause():
    """`versions.SGLangFeatures.retract_kills_flush` against the installed scheduler: a retract
    pause puts the running requests back on the waiting queue (``_add_request_to_queue``), which
    ``is_fully_idle`` counts; the scheduler's ``flush_cache`` ignores that queue while paused
    exactly where the table calls a retract pause safe (0.5.21 on), and where it does not, an
    update's failed flush is an ``assert`` (the server dies: refused before the sync)."""
    sched = _class_node(SRT / "managers" / "scheduler.py", "Scheduler")
    fn = {n.name: ast.unparse(n) for n in sched.body if isinstance(n, ast.FunctionDef)}
    assert "_add_request_to_queue" in fn["pause_generation"] and "retract" in fn["pause_generation"]
    assert "len(self.waiting_queue) == 0" in fn["is_fully_idle"]
    assert ("ignore_waiting=self._engine_paused" in fn["flush_cache"]) is not INSTALLED.retract_kills_flush
    updaters = [SRT / "managers" / "scheduler_update_weights_mixin.py",
                SRT / "managers" / "scheduler_components" / "weight_updater.py"]
    src = "".join(p.read_text() for p in updaters if p.exists())
    assert ("assert flush_cache_success" in src) is INSTALLED.retract_kills_flush, sglang.__version__


@pytest.mark.timeout(60)
def test_release_table_weights_checker_ranks():
    """`versions.SGLangFeatures.checker_every_tp_rank` against the installed scheduler: its
    ``check_weights`` gathers every TP rank's checksums over the TP group (0.5.20 on), or answers
    with its own (0.5.12: and only attention-TP rank 0's scheduler answers the tokenizer), so
    ``verify`` at TP > 1 is refused before the sync."""
    updaters = [SRT / "managers" / "scheduler_update_weights_mixin.py",
                SRT / "managers" / "scheduler_components" / "weight_updater.py"]
    bodies = [ast.unparse(n) for p in updaters if p.exists() for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.FunctionDef) and n.name == "check_weights"]
    assert len(bodies) == 1, (sglang.__version__, len(bodies))
    gathers = "all_gather_object" in bodies[0] and "tp_cpu_group" in bodies[0]
    assert gathers is INSTALLED.checker_every_tp_rank, sglang.__version__


@pytest.mark.timeout(60)
def test_sglangs_end_weight_update_ignores_an_abort_field():
    """`SGLangEngine.end_weight_update(abort=True)` sends ``{"abort": true}``, which ``fsdp-sync
    serve`` takes to drop the session. The installed SGLang's request model has no such field and
    its HTTP schema (SGLang's own ``msgspec_struct_pydantic_core_schema``, with which ``BaseReq``
    builds every request's pydantic schema) ignores fields it does not know: the request is taken
    as a plain end that closes the session, not refused (a refusal would leave it open)."""
    if not INSTALLED.weight_update_session:
        pytest.skip(f"sglang {sglang.__version__} has no weight-update session")
    import msgspec
    import pydantic
    from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema

    io_struct = SRT / "managers" / "io_struct.py"
    end = _class_node(io_struct, "EndWeightUpdateReqInput")
    assert [b.id for b in end.bases if isinstance(b, ast.Name)] == ["BaseReq"]
    assert "abort" not in _fields("EndWeightUpdateReqInput")
    base = _class_node(io_struct, "BaseReq")
    hook = next(n for n in base.body if isinstance(n, ast.FunctionDef) and n.name == "__get_pydantic_core_schema__")
    assert "msgspec_struct_pydantic_core_schema(cls, handler)" in ast.unparse(hook)
    assert _fields("BaseReq") == {"rid", "http_worker_ipc"}

    class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):     # io_struct's, as parsed above
        rid: str | None = None
        http_worker_ipc: str | None = None

        @classmethod
        def __get_pydantic_core_schema__(cls, source, handler):
            return msgspec_struct_pydantic_core_schema(cls, handler)

    class EndWeightUpdateReqInput(BaseReq, kw_only=True):
        pass

    taken = pydantic.TypeAdapter(EndWeightUpdateReqInput).validate_json(b'{"abort": true}')
    assert isinstance(taken, EndWeightUpdateReqInput)
