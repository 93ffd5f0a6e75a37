"""A recording stand-in for SGLang 0.5.23, and a reader of its flattened-bucket wire format.

- `open_flattened_bucket(payload)`: what an SGLang TP worker does with its payload: unpickle with
  a restricted unpickler (an exact allow-list, each entry of which SGLang 0.5.23's
  ``SafeUnpickler.ALLOWED_GLOBALS`` in ``python/sglang/srt/utils/common.py`` also allows), then
  rebuild every tensor as ``flat[start_idx:end_idx].view(dtype).reshape(shape)``, like its
  ``FlattenedTensorBucket.reconstruct_tensors`` (``srt/weight_sync/tensor_bucket.py``).
  ``python tests/fake_sglang.py read FILE...`` does it in a process of its own and prints JSON
  digests, one list per file.
- `FakeSGLangEngine`: methods with ``sglang.Engine``'s 0.5.23 signatures (`SGLANG_SIGNATURES`),
  SGLang's weight-update session rule (0.5.21+: updates only between begin/end), and a record of
  every call. `OldFakeSGLangEngine` has no begin/end, like SGLang before 0.5.21.
  `Fake0512Engine`: SGLang 0.5.12 (verl 0.9.1's pin): the distributed calls, no session at all.
- `FakeSGLangServer`: the same engine behind SGLang's HTTP routes, on 127.0.0.1 in a thread, with
  a switch for the begin/end routes (404 on an older server) and scripted failures;
  ``version="0.5.12"`` answers as 0.5.12 does (no session routes, its narrower /weights_checker
  answering TP rank 0 only).

Kept free of pytest: the reader runs as a script in an independent process.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import json
import pickle
import sys
import threading
import types
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

# --------------------------------------------------------------------------- the reader

_DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int16", "int8",
           "uint8", "bool", "float8_e4m3fn", "float8_e5m2")

# The globals an fsdp_sync flattened-bucket payload may name: builtins, SimpleNamespace, torch
# dtypes/Size/Tensor/storages and torch's CPU (shared file) and CUDA rebuild functions.
ALLOWED_GLOBALS = frozenset(
    {("builtins", n) for n in ("dict", "list", "tuple", "int", "float", "str", "bytes", "bool")}
    | {("types", "SimpleNamespace")}
    | {("torch", d) for d in _DTYPES}
    | {("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch", "UntypedStorage"),
       ("torch.storage", "UntypedStorage"), ("torch.nn.parameter", "Parameter")}
    | {("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_storage_filename", "rebuild_storage_empty",
        "rebuild_typed_storage", "rebuild_cuda_tensor")}
)


class Blocked(pickle.UnpicklingError):
    pass


class RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global outside `ALLOWED_GLOBALS`; records the ones it loaded."""

    def __init__(self, file) -> None:
        super().__init__(file)
        self.loaded: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise Blocked(f"blocked global {module}.{name}")
        self.loaded.add((module, name))
        return super().find_class(module, name)


def unpickle(payload: bytes | str) -> tuple[Any, set]:
    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    u = RestrictedUnpickler(io.BytesIO(data))
    return u.load(), u.loaded


def rebuild(obj: dict) -> list[tuple[str, torch.Tensor]]:
    """SGLang's reconstruction: attribute access on each metadata entry, byte offsets, no copy."""
    flat = obj["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
            for m in obj["metadata"]]


def open_flattened_bucket(payload: bytes | str) -> list[tuple[str, torch.Tensor]]:
    obj, _ = unpickle(payload)
    missing = {"flattened_tensor", "metadata"} - set(obj)
    if missing:
        raise KeyError(f"flattened-bucket payload lacks {sorted(missing)}")
    return rebuild(obj)


def mixed_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """bf16, fp16, fp32, int64 with odd sizes: bf16[3] then int64 needs the alignment padding."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.a.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.b.int64", torch.randint(-2**62, 2**62, (5,), generator=g, dtype=torch.int64)),
        ("model.c.fp16", torch.randn(7, 3, generator=g).to(torch.float16)),
        ("model.d.fp32", torch.randn(2, 3, 5, generator=g)),
        ("model.e.bf16", torch.randn(1, generator=g).to(torch.bfloat16)),
        ("model.f.int64", torch.arange(3, dtype=torch.int64)),
    ]


def digest(t: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the bytes]: equal digests mean bit-identical tensors."""
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def digests(named) -> dict[str, list]:
    return {n: digest(t) for n, t in named}


# --------------------------------------------------------------------------- the fake engine

# sglang.Engine's signatures in 0.5.23 (python/sglang/srt/entrypoints/engine.py), for the methods
# the adapter calls. The optional tier checks the adapter's calls against the installed ones.
SGLANG_SIGNATURES = {
    "update_weights_from_tensor": "(named_tensors, load_format=None, flush_cache=True)",
    "update_weights_from_disk": "(model_path, load_format=None)",
    "begin_weight_update": "(selector='all')",
    "end_weight_update": "()",
    "release_memory_occupation": "(tags=None)",
    "resume_memory_occupation": "(tags=None)",
    "flush_cache": "()",
    "get_weights_by_name": "(name, truncate_size=100)",
    "get_server_info": "()",
    "shutdown": "()",
    "init_weights_update_group": "(master_address, master_port, rank_offset, world_size, group_name, "
                                 "backend='nccl')",
    "update_weights_from_distributed": "(names, dtypes, shapes, group_name='weight_update_group', "
                                       "flush_cache=True, load_format=None)",
    "destroy_weights_update_group": "(group_name)",
    # the same in 0.5.12: no pinned / added_tokens_config (the HTTP request's fields only)
    "load_lora_adapter_from_tensors": "(lora_name, tensors, config_dict, load_format=None)",
    "unload_lora_adapter": "(lora_name)",
}


class OldFakeSGLangEngine:
    """SGLang before 0.5.21: no weight-update session. Records ``(method, kwargs)`` in ``calls``.

    ``tp_size`` ranks each open their own flattened-bucket payload once (in this process). Set
    ``fail_next_update`` to a message to answer the next update with ``success=False`` after
    loading, as SGLang does when a model's ``load_weights`` raises.
    """

    VERSION = "0.5.20"

    def __init__(self, tp_size: int = 2) -> None:
        self.tp_size = tp_size
        self.calls: list[tuple[str, dict]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_next_update: str | None = None
        self.fail_next_flush: str | None = None
        self.opened_payloads = 0
        self.lock = threading.Lock()
        self.offload_tags: set[str] = set()     # a launched engine holds everything

    def _record(self, method: str, /, **kwargs: Any) -> None:
        with self.lock:
            self.calls.append((method, kwargs))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _session_ok(self) -> str | None:
        return None

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._record("update_weights_from_tensor", named_tensors=named_tensors,
                     load_format=load_format, flush_cache=flush_cache)
        refusal = self._session_ok()
        if refusal:
            return False, refusal
        if load_format == "flattened_bucket":
            if len(named_tensors) != self.tp_size:
                return False, f"expected {self.tp_size} payloads, got {len(named_tensors)}"
            loaded = {}
            for rank in range(self.tp_size):          # each TP worker opens its own payload
                for name, t in open_flattened_bucket(named_tensors[rank]):
                    loaded[name] = t.clone()
                self.opened_payloads += 1
        elif named_tensors and isinstance(named_tensors[0], (bytes, str)):
            # over HTTP: one serialized copy of the whole [(name, tensor)] list per TP rank
            loaded = {}
            for rank in range(self.tp_size):
                named, _ = unpickle(named_tensors[rank])
                loaded.update((n, t.clone()) for n, t in named)
                self.opened_payloads += 1
                del named
        else:
            loaded = {n: t.detach().clone() for n, t in named_tensors}
        if self.fail_next_update:
            msg, self.fail_next_update = self.fail_next_update, None
            return False, msg
        self.weights.update(loaded)
        return True, "Success"

    def update_weights_from_disk(self, model_path, load_format=None):
        """SGLang 0.5.23's rules: a non-directory is refused (it would be a Hub id), the index
        decides the files, a missing indexed shard fails before loading, only present names load.
        Answers ``(success, message, num_paused_requests)``; ``fail_next_update`` fails after
        loading, like SGLang when ``load_weights`` raises midway (weights partly updated)."""
        import os

        from safetensors.torch import load_file

        self._record("update_weights_from_disk", model_path=model_path, load_format=load_format)
        if not os.path.isdir(model_path):
            return False, f"Failed to get weights iterator: {model_path} is not a local directory", 0
        index = os.path.join(model_path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            for name in files:
                if not os.path.exists(os.path.join(model_path, name)):
                    return False, (f"Failed to get weights iterator: Cannot find any model weights "
                                   f"with {model_path}/{name}"), 0
        else:
            files = sorted(n for n in os.listdir(model_path) if n.endswith(".safetensors"))
        for name in files:
            self.weights.update(load_file(os.path.join(model_path, name)))
        if self.fail_next_update:
            msg, self.fail_next_update = self.fail_next_update, None
            return False, msg, 0
        return True, "Succeeded to update model weights.", 0

    # SGLang's scheduler keeps the released tags in a set (``offload_tags``, both 0.5.12 and
    # 0.5.23): release adds them, resume removes them with ``set.remove``, so resuming a tag it
    # holds raises KeyError, which kills a real server (its scheduler process quits). None or []
    # means every tag, as there.
    def release_memory_occupation(self, tags=None):
        self._record("release_memory_occupation", tags=tags)
        for tag in tags or ("weights", "kv_cache", "cuda_graph"):
            self.offload_tags.add(tag)

    def resume_memory_occupation(self, tags=None):
        self._record("resume_memory_occupation", tags=tags)
        for tag in tags or ("weights", "kv_cache", "cuda_graph"):
            self.offload_tags.remove(tag)

    def flush_cache(self):
        self._record("flush_cache")
        if self.fail_next_flush:
            msg, self.fail_next_flush = self.fail_next_flush, None
            return types.SimpleNamespace(success=False, message=msg)
        return types.SimpleNamespace(success=True, message="")

    def get_weights_by_name(self, name, truncate_size=100):
        self._record("get_weights_by_name", name=name, truncate_size=truncate_size)
        t = self.weights.get(name)
        return None if t is None else t.to(torch.float32).tolist()[:truncate_size]

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                 return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 token_ids_logprob=None, lora_path=None, custom_logit_processor=None,
                 return_hidden_states=False, stream=False, bootstrap_host=None,
                 bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None):
        self._record("generate", input_ids=input_ids, sampling_params=sampling_params)
        n = (sampling_params or {}).get("max_new_tokens", 16)
        batch = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
        outs = [{"text": "", "output_ids": [(sum(p) + i) % 97 for i in range(n)],
                 "meta_info": {"completion_tokens": n}} for p in batch]
        return outs if batch is input_ids else outs[0]

    def get_server_info(self):
        self._record("get_server_info")
        layout = getattr(self, "layout", None)
        return {"tp_size": self.tp_size, "version": self.VERSION, "device": "cpu",
                "ep_size": layout.ep if layout is not None else 1,
                "internal_states": [{"memory_usage": {"weight": 0.0, "kvcache": 0.0}}]}

    def shutdown(self):
        self._record("shutdown")

    # LoRA. In process (0.5.12 and 0.5.23 alike) ``Engine.load_lora_adapter_from_tensors``
    # serializes ``tensors`` itself and every TP worker hands what it deserializes to
    # ``LoRAManager.load_lora_adapter_from_tensors``, which reads ``tensors.items()`` and answers
    # ``LoRAUpdateOutput(success=False, error_message=str(exc))`` when that raises. ``loras``:
    # name -> {"tensors", "config", "pinned", "added_tokens_config", "ranks"} as loaded.
    # ``tokenizer_manager.lora_registry``: what the Engine lists (sglang.Engine has no
    # ``lora_adapters``; the tokenizer manager registers an adapter once every worker loaded it
    # and unregisters it before they drop it, both releases).
    @property
    def loras(self) -> dict:
        return self.__dict__.setdefault("_loras", {})

    @property
    def tokenizer_manager(self) -> "FakeTokenizerManager":
        return self.__dict__.setdefault("_tokenizer_manager", FakeTokenizerManager())

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self._record("load_lora_adapter_from_tensors", lora_name=lora_name, tensors=tensors,
                     config_dict=config_dict, load_format=load_format)
        if load_format == "flattened_bucket":
            return lora_update(False, "the fake reads no flattened-bucket LoRA payloads")
        return self.load_lora(lora_name, [tensors] * self.tp_size, config_dict)

    def load_lora(self, lora_name, per_rank, config_dict, pinned=False, added_tokens_config=None):
        """What every TP worker does with the value it deserialized (``per_rank[rank]``)."""
        if lora_name in self.loras:
            return lora_update(False, f"Failed to load LoRA adapter {lora_name} because it is "
                                      f"already loaded")
        try:
            ranks = [{n: t.detach().clone() for n, t in value.items()} for value in per_rank]
        except AttributeError as exc:      # SGLang's str(exc) of ``tensors.items()``
            return lora_update(False, str(exc))
        self.loras[lora_name] = {"tensors": ranks[0], "config": dict(config_dict),
                                 "pinned": pinned, "added_tokens_config": added_tokens_config,
                                 "ranks": len(ranks)}
        self.tokenizer_manager.lora_registry.register(lora_name, pinned)
        return lora_update(True)

    def unload_lora_adapter(self, lora_name):
        self._record("unload_lora_adapter", lora_name=lora_name)
        self.tokenizer_manager.lora_registry.unregister(lora_name)
        if self.loras.pop(lora_name, None) is None:
            return lora_update(False, f"LoRA adapter {lora_name} is not loaded")
        return lora_update(True)


class FakeLoRARegistry:
    """SGLang's ``LoRARegistry`` (srt/lora/lora_registry.py) as read from outside:
    ``get_all_adapters()``, a copy of ``{lora_name: LoRARef(lora_id, lora_name, lora_path,
    pinned)}``; adapters loaded from tensors are registered with ``lora_path="__tensor__"``.
    (SGLang's ``register`` / ``unregister`` are coroutines under its tokenizer manager's lock.)"""

    def __init__(self) -> None:
        self._registry: dict[str, types.SimpleNamespace] = {}

    def register(self, lora_name: str, pinned: bool = False) -> None:
        self._registry[lora_name] = types.SimpleNamespace(
            lora_id=uuid.uuid4().hex, lora_name=lora_name, lora_path="__tensor__", pinned=pinned)

    def unregister(self, lora_name: str) -> None:
        self._registry.pop(lora_name, None)

    def get_all_adapters(self) -> dict:
        return dict(self._registry)


class FakeTokenizerManager:
    """``sglang.Engine.tokenizer_manager``, the parts read here: ``served_model_name`` and
    ``lora_registry``."""

    def __init__(self) -> None:
        self.served_model_name = "fake-model"
        self.lora_registry = FakeLoRARegistry()


def lora_update(success: bool, error_message: str | None = None) -> types.SimpleNamespace:
    """SGLang's ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``)."""
    return types.SimpleNamespace(success=success, error_message=error_message, loaded_adapters=None)


class FakeSGLangEngine(OldFakeSGLangEngine):
    """SGLang 0.5.21+: tensor updates are refused outside begin/end, without opening anything."""

    VERSION = "0.5.23"

    def __init__(self, tp_size: int = 2) -> None:
        super().__init__(tp_size)
        self.session_open = False

    def _session_ok(self) -> str | None:
        if not self.session_open:
            return ("update_weights_from_tensor must run between begin_weight_update() and "
                    "end_weight_update()")
        return None

    def begin_weight_update(self, selector="all"):
        self._record("begin_weight_update", selector=selector)
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        self._record("end_weight_update")
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    # update_weights_from_distributed: SGLang's answers, without a broadcast (nothing joins a
    # group here; the SGLang tier receives a real broadcast with SGLang's own code)
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name, backend="nccl"):
        self._record("init_weights_update_group", master_address=master_address,
                     master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                     group_name=group_name, backend=backend)
        self.groups = getattr(self, "groups", {})
        self.groups[group_name] = (rank_offset, world_size, backend)
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self._record("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                     group_name=group_name, flush_cache=flush_cache, load_format=load_format)
        if self._session_ok() is not None:
            return False, ("update_weights_from_distributed must run between begin_weight_update() "
                           "and end_weight_update()")
        if group_name not in getattr(self, "groups", {}):
            return False, f"Group {group_name} not in {list(getattr(self, 'groups', {}))}. " \
                          f"Please call `init_weights_update_group` first."
        bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            return False, f"Failed to update parameter online: module 'torch' has no attribute {bad[0]!r}"
        return True, "Succeeded to update parameter online from distributed."

    def destroy_weights_update_group(self, group_name):
        self._record("destroy_weights_update_group", group_name=group_name)
        if group_name not in getattr(self, "groups", {}):
            return False, "The group to be destroyed does not exist."
        del self.groups[group_name]
        return True, "Succeeded to destroy custom process group."


class PausingFakeSGLangEngine(FakeSGLangEngine):
    """With SGLang's generation pause: ``paused`` is the mode of ``pause_generation`` (None while
    generating); both calls are recorded. Subclasses add what their test drives (flush refusals,
    failed commits)."""

    paused = None

    def pause_generation(self, mode="abort"):
        self._record("pause_generation", mode=mode)
        self.paused = mode

    def continue_generation(self):
        self._record("continue_generation")
        self.paused = None


class Fake0512Engine(FakeSGLangEngine):
    """SGLang 0.5.12 (``verl[sglang]==0.9.1``'s pin): the distributed calls with 0.5.23's
    arguments, but no weight-update session: no begin/end methods, nothing refused outside one."""

    VERSION = "0.5.12"
    begin_weight_update = None      # not callable: the adapter sees no such method
    end_weight_update = None

    def _session_ok(self) -> str | None:
        return None


# --------------------------------------------------------------------------- the fake server

class FakeSGLangServer:
    """SGLang's HTTP routes over a fake engine, on 127.0.0.1 (an ephemeral port) in a thread.

    ``session_routes=False`` answers 404 on /begin_weight_update and /end_weight_update, like a
    server before 0.5.21. ``script[path]`` is a list of ``(status, body)`` answers served before
    the engine is asked. ``requests`` records ``(method, path, json body)``; ``hits`` counts them
    per path.
    """

    def __init__(self, tp_size: int = 2, *, session_routes: bool = True, layout: Any = None,
                 version: str | None = None) -> None:
        if version not in (None, "0.5.12", "0.5.23"):
            raise ValueError(f"the fake answers as SGLang 0.5.12 or 0.5.23, not {version!r}")
        self.version = version
        if version == "0.5.12":
            self.engine = Fake0512Engine(tp_size)
            session_routes = False
        else:
            self.engine = FakeSGLangEngine(tp_size) if session_routes else OldFakeSGLangEngine(tp_size)
        # with a layout (`layout.TPLayout`), /weights_checker hashes each TP rank's own engine
        # parameters cut from the full tensors the fake holds, as SGLang on CPU does
        self.engine.layout = layout
        self.session_routes = session_routes
        self.script: dict[str, list[tuple[int, str]]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.hits: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):   # keep test output clean
                pass

            def _serve(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                status, ctype, text = outer._route(method, self.path, body)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.timeout = 5
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, name="fake-sglang-http",
                                       daemon=True)

    def __enter__(self) -> "FakeSGLangServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def _route(self, method: str, path: str, body: Any) -> tuple[int, str, str]:
        path = path.split("?")[0]
        with self.engine.lock:
            self.requests.append((method, path, body))
            self.hits[path] = self.hits.get(path, 0) + 1
            scripted = self.script.get(path)
            if scripted:
                status, text = scripted.pop(0)
                return status, "text/plain", text
        e = self.engine
        ok = lambda obj: (200, "application/json", json.dumps(obj))           # noqa: E731
        bad = lambda obj: (400, "application/json", json.dumps(obj))          # noqa: E731
        not_found = (404, "application/json", json.dumps({"detail": "Not Found"}))
        if path in ("/begin_weight_update", "/end_weight_update") and not self.session_routes:
            return not_found
        if path == "/health":
            return 200, "text/plain", ""
        if path in ("/get_server_info", "/server_info"):
            return ok(e.get_server_info())
        if path == "/update_weights_from_tensor":
            success, message = e.update_weights_from_tensor(
                body["serialized_named_tensors"], load_format=body.get("load_format"),
                flush_cache=body.get("flush_cache", True))
            return (ok if success else bad)({"success": success, "message": message})
        if path == "/update_weights_from_disk":     # flush_cache: to an engine that models it
            flush = {"flush_cache": body.get("flush_cache", True)} if "flush_cache" in \
                inspect.signature(e.update_weights_from_disk).parameters else {}
            success, message, paused = e.update_weights_from_disk(
                body["model_path"], load_format=body.get("load_format"), **flush)
            return (ok if success else bad)({"success": success, "message": message,
                                             "num_paused_requests": paused})
        if path == "/begin_weight_update":
            success, message = e.begin_weight_update(**(body or {}))
            return (ok if success else bad)({"success": success, "message": message})
        if path == "/end_weight_update":
            success, message = e.end_weight_update()
            return (ok if success else bad)({"success": success, "message": message})
        if path in ("/init_weights_update_group", "/update_weights_from_distributed",
                    "/destroy_weights_update_group") and hasattr(e, path[1:]):
            success, message = getattr(e, path[1:])(**body)
            return (ok if success else bad)({"success": success, "message": message})
        if path in ("/pause_generation", "/continue_generation") and hasattr(e, path[1:]):
            getattr(e, path[1:])(**(body or {}))     # an engine that models SGLang's pause
            done = "paused" if path == "/pause_generation" else "continued"
            return ok({"message": f"Generation {done} successfully.", "status": "ok"})
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            getattr(e, path[1:])(tags=(body or {}).get("tags"))
            return ok(None)
        if path == "/flush_cache":
            out = e.flush_cache()
            return (200 if out.success else 400), "text/plain", (
                "Cache flushed.\n" if out.success else out.message)
        if path == "/get_weights_by_name":
            value = e.get_weights_by_name(body["name"], body.get("truncate_size", 100))
            if value is None:
                return bad({"error": {"message": "Get parameter by name failed"}})
            return ok(value)
        if path == "/weights_checker" and (self.session_routes or self.version == "0.5.12"):
            return self._weights_checker(body or {})     # OldFakeSGLangEngine's server: no route
        if path == "/update_weight_version":     # SGLang 0.5.23's UpdateWeightVersionReqInput
            e._record("update_weight_version", **(body or {}))
            e.weight_version = str((body or {}).get("new_version"))
            return ok({"success": True, "message": "Success", "new_version": e.weight_version})
        if path == "/generate":
            return ok(e.generate(input_ids=body.get("input_ids"),
                                 sampling_params=body.get("sampling_params")))
        if path == "/load_lora_adapter_from_tensors":
            return self._load_lora(body or {})
        if path == "/unload_lora_adapter":
            out = e.unload_lora_adapter((body or {}).get("lora_name"))
            return (ok if out.success else bad)(vars(out))
        if path == "/v1/models" and method == "GET":      # the served model, then each adapter
            served = e.tokenizer_manager.served_model_name  # as registered (the route reads that)
            return ok({"object": "list", "data": [{"id": served, "object": "model"}] + [
                {"id": ref.lora_name, "object": "model", "root": ref.lora_path, "parent": served}
                for ref in e.tokenizer_manager.lora_registry.get_all_adapters().values()]})
        return not_found


    # LoadLoRAAdapterFromTensorsReqInput (io_struct.py): 0.5.23 takes one payload per TP rank
    # (base64 over HTTP), 0.5.12 ONE payload (a str) that every TP worker deserializes
    LORA_FIELDS = ("lora_name", "config_dict", "serialized_named_tensors", "pinned",
                   "added_tokens_config", "lora_id", "load_format", "expected_checksums")
    LORA_FIELDS_0512 = ("lora_name", "config_dict", "serialized_tensors", "pinned",
                        "added_tokens_config", "lora_id", "load_format")

    def _load_lora(self, body: dict) -> tuple[int, str, str]:
        """``/load_lora_adapter_from_tensors`` as the release does it: 422 for a missing required
        field or a payload field of the wrong type (unknown fields are ignored, as its request
        model does), then each TP worker opens its payload (0.5.23: ``[tp_rank]``; 0.5.12: the one
        ``serialized_tensors``) and loads the dict it holds; 400 with ``LoRAUpdateOutput``."""
        old = self.version == "0.5.12"
        field = "serialized_tensors" if old else "serialized_named_tensors"
        missing = [f for f in ("lora_name", "config_dict", field) if f not in body]
        value = body.get(field)
        wrong = (not isinstance(value, str)) if old else not (
            isinstance(value, list) and all(isinstance(p, str) for p in value))
        if missing or wrong:
            return 422, "application/json", json.dumps(
                {"detail": f"missing fields {missing}" if missing else
                 f"{field}: expected {'a string' if old else 'a list of base64 strings'}, got "
                 f"{type(value).__name__}"})
        e = self.engine
        if not old and len(value) < e.tp_size:      # its worker indexes [tp_rank]
            return 400, "application/json", json.dumps(vars(lora_update(
                False, f"list index out of range ({len(value)} payloads for {e.tp_size} ranks)")))
        per_rank = []
        for rank in range(e.tp_size):
            obj, _ = unpickle(value if old else value[rank])
            per_rank.append(obj)
            e.opened_payloads += 1
        out = e.load_lora(body["lora_name"], per_rank, body["config_dict"],
                          pinned=bool(body.get("pinned", False)),
                          added_tokens_config=body.get("added_tokens_config"))
        del per_rank, obj
        return (200 if out.success else 400), "application/json", json.dumps(vars(out))

    # SGLang 0.5.23's CheckWeightsReqInput fields (io_struct.py)
    CHECK_WEIGHTS_FIELDS = ("action", "allow_quant_error", "skip_tensor_list", "selector")
    CHECK_WEIGHTS_FIELDS_0512 = ("action",)

    def _weights_checker(self, body: dict) -> tuple[int, str, str]:
        """``/weights_checker`` as 0.5.23 answers ``checksum``: per TP rank, a 16-hex hash of each
        of its own tensors (here: the whole tensors the fake holds) and their overall hash. As
        0.5.12: fields beyond ``action`` dropped without a word (FastAPI's dataclass body), the
        answer without ``per_gpu_checksum``, ``per_engine_checksum``, ``role``, and with TP rank
        0's entry only (only it answers the tokenizer, gathering nothing from the others)."""
        old = self.version == "0.5.12"
        if old:
            body = {k: v for k, v in body.items() if k in self.CHECK_WEIGHTS_FIELDS_0512}
        unknown = sorted(set(body) - set(self.CHECK_WEIGHTS_FIELDS))
        if unknown:
            return 422, "application/json", json.dumps({"detail": f"unknown fields {unknown}"})
        action = body.get("action", "checksum")
        if action != "checksum":
            return 400, "application/json", json.dumps(
                {"success": False, "message": f"Unsupported action={action!r}"})
        e = self.engine

        def sha(t):   # SGLang's tensor_hash on CPU: sha256 of the bytes, the first 8 bytes
            return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

        def rank_sums(r):
            if e.layout is None:       # whole tensors under their own names
                return {n: sha(t) for n, t in e.weights.items()}
            from fsdp_sync.weights.layout import shard_state_dict
            return {n: sha(t) for n, t in shard_state_dict(e.weights, e.layout, r).items()}

        ranks = []
        for r in range(e.tp_size):
            checksums = rank_sums(r)
            overall = hashlib.sha256("".join(f"{n}{checksums[n]}" for n in sorted(checksums))
                                     .encode()).hexdigest()
            ranks.append({"checksums": checksums, "per_gpu_checksum": overall,
                          "parallelism_info": {"role": "target", "tp_rank": r, "tp_size": e.tp_size,
                                               "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                                               "rank": r, "size": e.tp_size}})
        if old:
            ranks = [entry for entry in ranks if entry["parallelism_info"]["tp_rank"] == 0]
            for entry in ranks:
                del entry["per_gpu_checksum"], entry["parallelism_info"]["role"]
            return 200, "application/json", json.dumps({"success": True, "message": "Success.", "ranks": ranks})
        return 200, "application/json", json.dumps(
            {"success": True, "message": "Success.", "ranks": ranks,
             "per_engine_checksum": hashlib.sha256("".join(x["per_gpu_checksum"] for x in ranks)
                                                   .encode()).hexdigest()})


# --------------------------------------------------------------------------- script entry

def _main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "read":
        print("usage: fake_sglang.py read PAYLOAD_FILE...", file=sys.stderr)
        return 2
    out = []
    for path in argv[1:]:
        with open(path, "rb") as f:
            data = f.read()
        payload = data.decode("ascii") if path.endswith(".b64") else data
        obj, loaded = unpickle(payload)
        named = rebuild(obj)
        out.append({"keys": sorted(obj), "digests": digests(named),
                    "globals": sorted(f"{m}.{n}" for m, n in loaded)})
        del named, obj     # drop the mappings before the next payload
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
