"""`fsdp-sync serve`'s LoRA routes (SGLang's ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``, ``/load_lora_adapter``, ``lora_path`` in ``/generate``, the adapters in
``/v1/models``) and fsdp_sync's ``/fsdp_sync/lora_checksums``, driven through `SGLangEngine`'s LoRA
calls over HTTP, as the verl adapter drives them: the served adapter generates what the engine
generates with the same adapter loaded directly, reads back bit for bit, and a refused load changes
nothing. A TP-2 engine, so the wire's one payload per TP rank is exercised.
"""

from __future__ import annotations

import http.client
import json

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError, SGLangUpdateError
from fsdp_sync.models import build_model, load_config
from fsdp_sync.verify import tensor_digest
from test_lora_engine import PROMPTS, make_adapter

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("adapters")
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2) as eng:
        eng.update_weights_from_tensor(list(tiny.state_dict().items()))
        with EngineServer(eng, allowed_disk_dirs=[str(allowed)], update_wait_s=30.0) as srv:
            client = SGLangEngine(base_url=f"http://{srv.host}:{srv.port}")
            yield eng, srv, client, allowed


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read().decode())
    finally:
        conn.close()


def test_adapter_over_http_generates_and_reads_back_as_loaded_directly(served, tiny):
    eng, srv, client, _ = served
    tensors, config = make_adapter(tiny, r=4, alpha=16, seed=1)
    base = eng.generate(PROMPTS, max_new_tokens=6)
    client.load_lora_adapter_from_tensors("a", tensors, config)
    try:
        assert "a" in eng.lora_adapters
        ids = [c["id"] for c in client.available_models()["data"]]
        assert ids[1:] == ["a"], ids
        # /generate with lora_path, one prompt at a time as verl's server sends them
        got = [_post(srv, "/generate", {"input_ids": p, "lora_path": "a",
                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
               for p in PROMPTS]
        assert all(s == 200 for s, _ in got), got
        direct = eng.generate(PROMPTS, max_new_tokens=6, lora_path="a")
        assert [o["output_ids"] for _, o in got] == direct
        assert direct != base                  # the adapter changes the tokens (B is nonzero)
        # read back: each tensor's digest in the engine's dtype equals the sent tensor's
        sums, dtype = client.lora_checksums("a")
        want = {n.removeprefix("base_model.model."): t.to(getattr(torch, dtype)) for n, t in tensors.items()}
        assert sums == {n: tensor_digest(n, t) for n, t in want.items()}
        # the same name again is refused (SGLang's rule), nothing changes
        with pytest.raises(SGLangUpdateError, match="already loaded"):
            client.load_lora_adapter_from_tensors("a", make_adapter(tiny, r=4, seed=2)[0], config)
        assert client.lora_checksums("a")[0] == sums
    finally:
        client.unload_lora_adapter("a")
    assert "a" not in eng.lora_adapters
    assert [c["id"] for c in client.available_models()["data"]][1:] == []
    status, out = _post(srv, "/generate", {"input_ids": PROMPTS[0], "lora_path": "a"})
    assert status == 400 and "not a loaded LoRA adapter" in out["message"], out


def test_refusals_name_the_field_and_change_nothing(served, tiny):
    eng, srv, client, allowed = served
    tensors, config = make_adapter(tiny, r=4)
    with pytest.raises(SGLangUpdateError, match="target_modules"):
        client.load_lora_adapter_from_tensors("b", tensors, dict(config, target_modules=["q_proj"]))
    with pytest.raises(SGLangUpdateError, match="unload_lora_adapter.*no such adapter"):
        client.unload_lora_adapter("b")
    assert eng.lora_adapters == {}
    status, out = _post(srv, "/load_lora_adapter_from_tensors",
                        {"lora_name": "b", "config_dict": config, "serialized_named_tensors": ["x"]})
    assert status == 400 and "serialized_named_tensors must be 2" in out["message"], out
    status, out = _post(srv, "/load_lora_adapter", {"lora_name": "b", "lora_path": "/etc"})
    assert status == 403 and "outside the allowed" in out["message"], out
    status, out = _post(srv, "/fsdp_sync/lora_checksums", {"lora_name": "b"})
    assert status == 400 and "no LoRA adapter 'b'" in out["message"], out
    status, out = _post(srv, "/generate", {"input_ids": PROMPTS[0], "lora_path": 3})
    assert status == 400 and "lora_path" in out["message"], out
    assert eng.lora_adapters == {}


def test_load_from_allowed_directory(served, tiny):
    from safetensors.torch import save_file

    eng, srv, client, allowed = served
    tensors, config = make_adapter(tiny, r=2, seed=5)
    d = allowed / "adapter"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(config))
    status, out = _post(srv, "/load_lora_adapter", {"lora_name": "disk", "lora_path": str(d)})
    assert status == 200 and out["success"], out
    try:
        sums, _ = client.lora_checksums("disk")
        assert sums == {n.removeprefix("base_model.model."): tensor_digest(n.removeprefix("base_model.model."), t)
                        for n, t in tensors.items()}
    finally:
        client.unload_lora_adapter("disk")


def test_lora_checksums_need_fsdp_sync_serve():
    """Against a server without fsdp_sync's route (SGLang), verify cannot read an adapter back:
    the call says so and what to set."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        client = SGLangEngine(base_url=f"http://127.0.0.1:{srv.server_port}", tp_size=1)
        with pytest.raises(SGLangError, match="verify=off"):
            client.lora_checksums("x")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_manager_adapter_mode_into_serve_over_http_verified_by_digest(tmp_path):
    """`SyncConfig(lora="adapter")` with `SGLangEngine` in front of ``fsdp-sync serve``: the base by
    the disk method (inside --allowed-disk-dir), then the adapter alone through SGLang's LoRA
    route, verified digest for digest (`lora_sync.check_digests`); a spoiled adapter in the engine
    fails the next verify naming the tensor."""
    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.cli.lora_model import add_lora

    model = add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=8, seed=1)
    with torch.no_grad():                    # B nonzero: the adapter changes the tokens
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    with ReferenceEngine("tiny", tp_size=2, seed=4) as eng, \
            EngineServer(eng, allowed_disk_dirs=[str(tmp_path)]) as srv:
        client = SGLangEngine(base_url=f"http://{srv.host}:{srv.port}")
        manager = FSDPShardingManager(model, client, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="x", verify="full"))
        with manager:
            assert manager.stats.extra["base_bytes"] > 10 * manager.stats.bytes
        assert list(eng.lora_adapters) == ["x"]
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_A." in n:
                    p.mul_(1.5)
        with manager:                        # the adapter alone, checked by digest
            assert "base_bytes" not in manager.stats.extra
        got = eng.generate(PROMPTS, max_new_tokens=4, lora_path="x")
        assert got != eng.generate(PROMPTS, max_new_tokens=4)
        load = eng.load_lora_adapter_from_tensors

        def spoiled(name, tensors, config, *a, **kw):   # the engine takes a wrong copy
            tensors = [(n, t + 1 if n.endswith("layers.1.mlp.up_proj.lora_B.weight") else t)
                       for n, t in tensors]
            return load(name, tensors, config, *a, **kw)

        eng.load_lora_adapter_from_tensors = spoiled
        try:
            with pytest.raises(Exception, match=r"verify.*'model\.layers\.1\.mlp\.up_proj\.lora_B\.weight'"):
                with manager:
                    pass
        finally:
            del eng.load_lora_adapter_from_tensors
        manager.close()


def test_a_server_without_the_lora_route_gets_nothing_opened_and_the_segments_back(served, tiny):
    """A 404 (the server has no ``load_lora_adapter_from_tensors``) means SGLang opened none of
    the payloads: the error says so (``opened`` False) and the sender's shared-memory copies are
    given back at once (the conftest leftover check sees none), nothing is loaded."""
    eng, _, client, _ = served
    tensors, config = make_adapter(tiny, r=4, alpha=16, seed=5)
    eng.load_lora_adapter_from_tensors = None        # serve answers 404: no such method here
    try:
        with pytest.raises(SGLangUpdateError, match="404") as ei:
            client.load_lora_adapter_from_tensors("gone", tensors, config)
    finally:
        del eng.load_lora_adapter_from_tensors
    assert ei.value.opened is False and ei.value.status == 404
    assert "gone" not in eng.lora_adapters
