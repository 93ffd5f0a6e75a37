"""The SGLang adapter without sglang: payloads, call order, begin/end detection, errors, retries.

Payloads are rebuilt in independent processes by `fake_sglang`'s reader (SGLang's allow-list and
reconstruction); the adapter runs against `FakeSGLangEngine` (in process) and `FakeSGLangServer`
(HTTP on 127.0.0.1). `make test-sglang` checks the same payloads and calls against real SGLang.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.weights import handles
from fsdp_sync.weights.bucket import ALIGNMENT
from fsdp_sync.engines.base import Engine, EngineClosedError, EngineStateError
from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import allocator as sg_allocator
from fsdp_sync.engines.sglang import client as sgc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang as fake  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


mixed_tensors = fake.mixed_tensors


def read_in_process_of_its_own(tmp_path: Path, payloads: list, tag: str) -> list[dict]:
    """Each payload opened once, each in a fresh python process started by subprocess."""
    results = []
    for rank, p in enumerate(payloads):
        path = tmp_path / f"{tag}-rank{rank}.{'b64' if isinstance(p, str) else 'bin'}"
        path.write_bytes(p.encode("ascii") if isinstance(p, str) else p)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run([sys.executable, str(TESTS / "fake_sglang.py"), "read", str(path)],
                             capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        results.extend(json.loads(out.stdout))
    return results


def recorded_bind(cls, name: str, kwargs: dict) -> None:
    inspect.signature(getattr(cls, name)).bind(None, **kwargs)    # None stands for self


# --------------------------------------------------------------------------- payloads

@pytest.mark.timeout(60)
def test_payloads_rebuild_bit_exact_in_independent_processes(tmp_path):
    named = mixed_tensors()
    expected = fake.digests(named)
    with sg.flattened_bucket_payloads(named, 2) as payloads:
        assert isinstance(payloads, list) and len(payloads) == 2
        assert all(isinstance(p, bytes) for p in payloads)
        results = read_in_process_of_its_own(tmp_path, payloads, "bytes")
    for r in results:
        assert r["keys"] == ["flattened_tensor", "metadata"]     # untagged: SGLang's two keys
        assert r["digests"] == expected
        assert {tuple(g.rsplit(".", 1)) for g in r["globals"]} <= fake.ALLOWED_GLOBALS


@pytest.mark.timeout(60)
def test_base64_payload_for_http_rebuilds_bit_exact(tmp_path):
    named = mixed_tensors(seed=1)
    with sg.flattened_bucket_payloads(dict(named), 1, output_str=True) as payloads:
        assert isinstance(payloads[0], str)
        (result,) = read_in_process_of_its_own(tmp_path, payloads, "b64")
    assert result["digests"] == fake.digests(named)


@pytest.mark.timeout(30)
def test_metadata_is_sglang_form_and_aligned():
    named = mixed_tensors()
    with sg.flattened_bucket_payloads(named, 1) as payloads:
        obj, loaded = fake.unpickle(payloads[0])
        assert set(obj) == {"flattened_tensor", "metadata"}
        flat = obj["flattened_tensor"]
        assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == payloads.nbytes
        for m, (name, t) in zip(obj["metadata"], named):
            assert isinstance(m, SimpleNamespace)
            assert (m.name, m.dtype, tuple(m.shape)) == (name, t.dtype, tuple(t.shape))
            assert m.start_idx % ALIGNMENT == 0
            assert m.end_idx - m.start_idx == m.numel == t.numel() * t.element_size()
        # bf16[3] is 6 bytes; the int64 after it starts at 16, not 6
        assert [m.start_idx for m in obj["metadata"][:2]] == [0, 16]
        del obj, flat


@pytest.mark.timeout(30)
def test_unaligned_layout_fails_to_rebuild():
    """Why the padding: SGLang's reconstruction cannot view an int64 at byte offset 6."""
    flat = torch.zeros(14, dtype=torch.uint8)
    meta = [SimpleNamespace(name="a", shape=torch.Size([3]), dtype=torch.bfloat16, start_idx=0,
                            end_idx=6, numel=6),
            SimpleNamespace(name="b", shape=torch.Size([1]), dtype=torch.int64, start_idx=6,
                            end_idx=14, numel=8)]
    with pytest.raises(RuntimeError, match="divisible"):
        fake.rebuild({"flattened_tensor": flat, "metadata": meta})


@pytest.mark.timeout(30)
def test_payload_errors_and_lease():
    with pytest.raises(ValueError, match="at least one tensor"):
        sg.flattened_bucket_payloads([], 2)
    with pytest.raises(ValueError, match="tp_size"):
        sg.flattened_bucket_payloads(mixed_tensors(), 0)
    with pytest.raises(TypeError, match="expected a torch.Tensor|unsupported dtype"):
        sg.flattened_bucket_payloads([("x", torch.zeros(2, dtype=torch.complex64))], 1)
    p = sg.flattened_bucket_payloads(mixed_tensors(), 3)
    assert len(p) == 3 and p.names[0] == "model.a.bf16" and not p.released
    import pickle
    assert type(pickle.loads(pickle.dumps(p))) is list      # gather_object carries no buffer
    p.release(unopened=True)                                 # nobody opened them
    assert p.released and len(p) == 0
    p.release()                                              # idempotent


@pytest.mark.timeout(30)
def test_sglang_is_imported_lazily():
    code = ("import sys, fsdp_sync, fsdp_sync.engines.sglang as m; "
            "assert 'sglang' not in sys.modules, 'sglang imported'; print('ok')")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --------------------------------------------------------------------------- in-process engine

@pytest.mark.timeout(60)
def test_fake_has_sglang_0_5_23_signatures():
    for name, sig in fake.SGLANG_SIGNATURES.items():
        assert str(inspect.signature(getattr(fake.FakeSGLangEngine, name))).replace(
            "self, ", "").replace("(self)", "()") == sig, name


@pytest.mark.timeout(30)
def test_sync_step_call_order_and_kwargs():
    eng = fake.FakeSGLangEngine(tp_size=2)
    a = sg.SGLangEngine(eng)
    named = mixed_tensors()
    a.release_memory_occupation(["weights", "kv_cache"])     # given out of order
    a.resume_memory_occupation(["weights"])
    a.begin_weight_update()
    with sg.flattened_bucket_payloads(named[:3], a.tp_size) as p1:
        a.update_weights_from_tensor(p1, load_format="flattened_bucket", flush_cache=False)
    a.update_weights_from_bucket(named[3:], flush_cache=True)
    a.end_weight_update()
    a.resume_memory_occupation(["kv_cache"])
    out = a.generate([[1, 2, 3], [4]], max_new_tokens=4)
    a.flush_cache()
    a.release_memory_occupation()
    assert eng.names() == [
        "get_server_info", "release_memory_occupation", "resume_memory_occupation",
        "begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
        "end_weight_update", "resume_memory_occupation", "generate", "flush_cache",
        "release_memory_occupation"]
    kw = [c[1] for c in eng.calls]
    assert kw[1] == {"tags": ["kv_cache", "weights"]}           # SGLang's release order
    assert kw[2] == {"tags": ["weights"]}
    assert kw[4]["load_format"] == "flattened_bucket" and kw[4]["flush_cache"] is False
    assert kw[5]["flush_cache"] is True
    assert kw[-1] == {"tags": ["kv_cache", "weights", "cuda_graph"]}   # None: all it holds
    assert kw[8]["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0}
    assert isinstance(a, Engine)                                 # fsdp_sync's engine protocol
    assert out == [[6, 7, 8, 9], [4, 5, 6, 7]]
    assert eng.opened_payloads == 4                              # 2 updates x 2 ranks, once each
    for name, t in named:
        assert torch.equal(a.get_weights_by_name(name), t.to(torch.float32))
    assert a.session_api is True
    for name, kwargs in eng.calls:                               # every call binds to 0.5.23
        recorded_bind(fake.FakeSGLangEngine, name, kwargs)


@pytest.mark.timeout(30)
def test_resume_order_and_unknown_tags():
    eng = fake.FakeSGLangEngine()
    a = sg.SGLangEngine(eng, tp_size=2)
    a.release_memory_occupation()
    a.resume_memory_occupation(["kv_cache", "weights", "cuda_graph"])
    assert eng.calls[-1] == ("resume_memory_occupation",
                             {"tags": ["cuda_graph", "weights", "kv_cache"]})
    with pytest.raises(ValueError, match="unknown memory tag"):
        a.release_memory_occupation(["weights", "kv"])
    assert len(eng.calls) == 2


@pytest.mark.timeout(30)
def test_memory_calls_send_only_tags_whose_state_changes():
    """SGLang's scheduler keeps released tags in a set and ``remove``s each resumed one: a resume
    of a tag it holds raises there and its server quits (the fake raises the same KeyError). So a
    launched engine is resumed with nothing, a released one with what it released, and an engine
    released before it was wrapped says so (``released_tags``)."""
    eng = fake.FakeSGLangEngine()
    with pytest.raises(KeyError):                   # what SGLang does with a resume of a held tag
        eng.resume_memory_occupation(["weights"])
    eng.calls.clear()
    a = sg.SGLangEngine(eng, tp_size=2)
    a.resume_memory_occupation(["weights"])         # launched: holds everything, nothing sent
    a.resume_memory_occupation()
    assert eng.calls == []
    a.release_memory_occupation(["kv_cache"])
    a.release_memory_occupation(["kv_cache", "weights"])        # kv_cache is released already
    a.resume_memory_occupation()                    # back: exactly the two released
    assert eng.calls == [("release_memory_occupation", {"tags": ["kv_cache"]}),
                         ("release_memory_occupation", {"tags": ["weights"]}),
                         ("resume_memory_occupation", {"tags": ["weights", "kv_cache"]})]
    assert eng.offload_tags == set()
    assert a.memory_skipped == [("resume_memory_occupation", ["weights"]),
                                ("resume_memory_occupation", ["cuda_graph", "weights", "kv_cache"]),
                                ("release_memory_occupation", ["kv_cache"]),
                                ("resume_memory_occupation", ["cuda_graph"])]
    eng2 = fake.FakeSGLangEngine()
    eng2.release_memory_occupation(["kv_cache", "weights"])      # as verl does after launching
    b = sg.SGLangEngine(eng2, tp_size=2, released_tags=["weights", "kv_cache"])
    b.resume_memory_occupation(["weights"])
    assert eng2.offload_tags == {"kv_cache"}
    with pytest.raises(ValueError, match="unknown memory tag"):
        sg.SGLangEngine(eng2, tp_size=2, released_tags=["kv"])
    # verl's adapter: verl's replicas also release SGLang's memory, so its calls go as given
    eng3 = fake.FakeSGLangEngine()
    c = sg.SGLangEngine(eng3, tp_size=2, track_memory=False)
    c.release_memory_occupation()
    c.resume_memory_occupation(["kv_cache", "weights"])
    c.release_memory_occupation(["weights"])
    assert eng3.calls == [("release_memory_occupation", {"tags": None}),
                          ("resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                          ("release_memory_occupation", {"tags": ["weights"]})]
    assert c.memory_skipped == []
    with pytest.raises(ValueError, match="track_memory=True"):
        sg.SGLangEngine(eng3, tp_size=2, track_memory=False, released_tags=["weights"])


@pytest.mark.timeout(30)
def test_a_failed_resume_is_not_asked_again():
    """SGLang's scheduler (0.5.12, 0.5.23) removes the tags from its released set before it maps
    the memory again: after a resume that failed inside SGLang the tag counts as held there, and
    asking again raised KeyError in its scheduler (the server quits). It was asked again; every
    later memory call of that engine is refused now, naming the failed one."""
    class Refusing(fake.FakeSGLangEngine):
        refuse = True

        def resume_memory_occupation(self, tags=None):
            if self.refuse:
                self.refuse = False
                for tag in tags:
                    self.offload_tags.remove(tag)     # as SGLang: first, then the memory
                raise RuntimeError("out of memory")
            super().resume_memory_occupation(tags)

    eng = Refusing()
    a = sg.SGLangEngine(eng, tp_size=2)
    a.release_memory_occupation(["kv_cache", "weights"])
    with pytest.raises(Exception, match="out of memory"):
        a.resume_memory_occupation(["weights"])
    with pytest.raises(sg.SGLangError, match=r"an earlier resume_memory_occupation\(tags=\['weights'\]\) failed "
                                             r"without saying it changed nothing \(RuntimeError: out of memory\)"):
        a.resume_memory_occupation(["weights"])
    assert eng.offload_tags == {"kv_cache"}


@pytest.mark.timeout(30)
def test_old_engine_without_session_is_detected_once():
    eng = fake.OldFakeSGLangEngine(tp_size=1)
    a = sg.SGLangEngine(eng, tp_size=1)
    for _ in range(2):
        a.begin_weight_update()
        a.update_weights_from_bucket(mixed_tensors()[:2])
        a.end_weight_update()
    assert a.session_api is False
    assert eng.names() == ["update_weights_from_tensor"] * 2


@pytest.mark.timeout(30)
def test_update_outside_session_raises_sglang_message_and_frees():
    eng = fake.FakeSGLangEngine(tp_size=2)
    a = sg.SGLangEngine(eng)
    with pytest.raises(sg.SGLangUpdateError, match="must run between begin_weight_update") as ei:
        a.update_weights_from_bucket(mixed_tensors())
    assert ei.value.opened is False and eng.opened_payloads == 0
    # the leftover check in conftest sees no segment: the unopened payloads were given back


@pytest.mark.timeout(30)
def test_success_false_raises_with_message():
    eng = fake.FakeSGLangEngine(tp_size=2)
    a = sg.SGLangEngine(eng)
    a.begin_weight_update()
    eng.fail_next_update = "Failed to update parameter online: shape mismatch for 'model.x'"
    with pytest.raises(sg.SGLangUpdateError, match="shape mismatch for 'model.x'"):
        a.update_weights_from_bucket(mixed_tensors())
    with pytest.raises(EngineStateError, match="already open"):
        a.begin_weight_update()
    eng.fail_next_flush = "requests are still running"
    with pytest.raises(sg.SGLangError, match="requests are still running"):
        a.flush_cache()
    with pytest.raises(ValueError, match="expected 2 flattened-bucket payloads"):
        a.update_weights_from_tensor([b"x"], load_format="flattened_bucket")
    with pytest.raises(sg.SGLangError, match="no parameter 'nope'"):
        a.get_weights_by_name("nope")


class _VersionedDisk(fake.FakeSGLangEngine):
    """An in-process engine with ``update_weight_version`` (as `ReferenceEngine` has), whose disk
    load takes ``flush_cache``: what SGLang's server request takes, in process."""

    def update_weights_from_disk(self, model_path, load_format=None, flush_cache=True):
        self._record("flush", flush_cache=flush_cache)
        return super().update_weights_from_disk(model_path, load_format)

    def update_weight_version(self, new_version, abort_all_requests=False):
        self._record("update_weight_version", new_version=new_version,
                     abort_all_requests=abort_all_requests)
        return True, "Success"


@pytest.mark.timeout(30)
def test_in_process_disk_load_drops_no_option_without_a_word(tmp_path):
    """sglang.Engine.update_weights_from_disk (0.5.12 to 0.5.23) takes only model_path and
    load_format. The adapter passed nothing else and said nothing: a weight_version, a
    flush_cache=False or an abort_all_requests=True asked for was dropped. Now such an option is
    refused before anything loads, naming it; weight_version goes to update_weight_version where
    the engine has one; an option the engine's method takes is passed."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    eng = fake.FakeSGLangEngine(tp_size=1)
    a = sg.SGLangEngine(eng)
    for option, pattern in (({"weight_version": "step-7"}, "can take no weight_version"),
                            ({"flush_cache": False}, "takes no flush_cache"),
                            ({"abort_all_requests": True}, "takes no abort_all_requests")):
        with pytest.raises(sg.SGLangError, match=pattern + ".*nothing was loaded"):
            a.update_weights_from_disk(str(tmp_path), **option)
    assert "update_weights_from_disk" not in eng.names() and not eng.weights
    assert a.takes_weight_version is False        # the disk method loads it unnamed, as told
    a.update_weights_from_disk(str(tmp_path), flush_cache=True, abort_all_requests=False)
    assert eng.calls[-1] == ("update_weights_from_disk",
                             {"model_path": str(tmp_path), "load_format": None})
    recorded_bind(fake.FakeSGLangEngine, *eng.calls[-1])           # sglang.Engine's signature
    # an engine that can name its weights: the version set right after the load; flush passed
    eng = _VersionedDisk(tp_size=1)
    a = sg.SGLangEngine(eng)
    a.update_weights_from_disk(str(tmp_path), weight_version="step-7", flush_cache=False)
    assert [c for c in eng.calls if c[0] != "get_server_info"] == [
        ("flush", {"flush_cache": False}),
        ("update_weights_from_disk", {"model_path": str(tmp_path), "load_format": None}),
        ("update_weight_version", {"new_version": "step-7", "abort_all_requests": False})]
    with pytest.raises(sg.SGLangError, match="takes no abort_all_requests"):
        a.update_weights_from_disk(str(tmp_path), abort_all_requests=True)


def test_which_update_calls_take_weight_version_is_what_base_says():
    """engines/base.py's protocol note: `ReferenceEngine` takes ``weight_version=`` on every update
    call, `SGLangEngine` on ``update_weights_from_disk`` only (it said both, on all of them)."""
    import fsdp_sync.engines.base as base
    from fsdp_sync.engines.reference import ReferenceEngine

    calls = ("update_weights_from_tensor", "update_weights_from_distributed",
             "update_weights_from_disk", "load_rank_bucket")
    takes = lambda cls: {c for c in calls if "weight_version" in inspect.signature(getattr(cls, c)).parameters}  # noqa: E731
    assert takes(ReferenceEngine) == set(calls)
    assert takes(sg.SGLangEngine) == {"update_weights_from_disk"}
    note = " ".join(inspect.getsource(base.Engine).split())
    assert "`SGLangEngine`: # ``update_weights_from_disk`` only" in note


@pytest.mark.timeout(30)
def test_shutdown_closes():
    eng = fake.FakeSGLangEngine(tp_size=1)
    a = sg.SGLangEngine(eng)
    a.shutdown()
    a.shutdown()
    assert eng.names() == ["get_server_info", "shutdown"]
    with pytest.raises(EngineClosedError):
        a.flush_cache()


# --------------------------------------------------------------------------- expandable segments

@pytest.mark.timeout(30)
def test_expandable_segments_noop_on_cpu_recorded():
    a = sg.SGLangEngine(fake.FakeSGLangEngine(), tp_size=2)
    a.resume_memory_occupation(["weights"])
    a.release_memory_occupation()
    if not torch.cuda.is_available():
        assert a.allocator.events[0].startswith("skipped expandable_segments:False")
        assert "no CUDA" in a.allocator.events[0]


@pytest.mark.timeout(30)
def test_expandable_segments_off_while_sglang_holds_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(sg_allocator, "_cuda_available", lambda: True)
    monkeypatch.setattr(sg_allocator, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(sg_allocator, "_allocator_settings", lambda: "expandable_segments:True")
    a = sg.SGLangEngine(fake.FakeSGLangEngine(), tp_size=2)
    a.release_memory_occupation(["kv_cache", "weights"])      # nothing switched yet: no restore
    assert calls == []
    a.resume_memory_occupation(["weights"])
    assert calls == ["expandable_segments:False"]
    a.resume_memory_occupation(["kv_cache"])                  # already off
    a.release_memory_occupation(["kv_cache"])                 # still holds weights
    assert calls == ["expandable_segments:False"]
    a.release_memory_occupation(["weights"])                  # cuda_graph alone does not count
    assert calls == ["expandable_segments:False", "expandable_segments:True"]
    a.resume_memory_occupation()
    a.shutdown()                                              # restored on shutdown too
    assert calls[-2:] == ["expandable_segments:False", "expandable_segments:True"]


# --------------------------------------------------------------------------- HTTP

def http_engine(server, **kw) -> sg.SGLangEngine:
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("timeout_s", 10)
    return sg.SGLangEngine(base_url=server.url, **kw)


@pytest.mark.timeout(30)
def test_http_sync_round_trip():
    named = mixed_tensors(seed=3)
    with fake.FakeSGLangServer(tp_size=2) as srv:
        a = http_engine(srv)
        assert a.tp_size == 2 and a.health()
        a.release_memory_occupation(["kv_cache", "weights"])
        a.resume_memory_occupation(["weights"])
        a.begin_weight_update()
        a.update_weights_from_bucket(named)
        with sg.flattened_bucket_payloads(named[:1], 2) as raw:   # bytes get base64-encoded
            a.update_weights_from_tensor(raw, load_format="flattened_bucket", flush_cache=False)
        a.end_weight_update()
        a.resume_memory_occupation(["kv_cache"])
        assert a.generate([[5, 5]], max_new_tokens=2) == [[10, 11]]
        a.flush_cache()
        for name, t in named:
            assert torch.equal(a.get_weights_by_name(name), t.to(torch.float32))
        paths = [(m, p) for m, p, _ in srv.requests]
        bodies = [b for _, _, b in srv.requests]
    # begin asks the server's TP size first (a server restarted with another: `check_tp_size`)
    assert paths[:8] == [("GET", "/server_info"), ("GET", "/health"),
                         ("POST", "/release_memory_occupation"),
                         ("POST", "/resume_memory_occupation"), ("GET", "/server_info"),
                         ("POST", "/begin_weight_update"),
                         ("POST", "/update_weights_from_tensor"),
                         ("POST", "/update_weights_from_tensor")]
    assert bodies[2] == {"tags": ["kv_cache", "weights"]} and bodies[3] == {"tags": ["weights"]}
    update = bodies[6]
    assert update["load_format"] == "flattened_bucket" and update["flush_cache"] is True
    assert all(isinstance(p, str) for p in update["serialized_named_tensors"])
    assert bodies[7]["flush_cache"] is False


@pytest.mark.timeout(30)
def test_http_plain_tensor_update_serializes_once_per_rank():
    named = mixed_tensors(seed=4)[:3]
    with fake.FakeSGLangServer(tp_size=2) as srv:
        a = http_engine(srv)
        a.begin_weight_update()
        a.update_weights_from_tensor(named, load_format=None)
        a.end_weight_update()
        body = srv.requests[-2][2]
    assert body["load_format"] is None and len(body["serialized_named_tensors"]) == 2
    assert srv.engine.opened_payloads == 2
    for name, t in named:
        assert torch.equal(srv.engine.weights[name], t)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("session_routes", [True, False])
def test_http_begin_end_detection(session_routes):
    with fake.FakeSGLangServer(tp_size=1, session_routes=session_routes) as srv:
        a = http_engine(srv, tp_size=1)
        for _ in range(3):
            a.begin_weight_update()
            a.update_weights_from_bucket(mixed_tensors()[:2])
            a.end_weight_update()
        hits = dict(srv.hits)
    assert a.session_api is session_routes
    if session_routes:
        assert hits["/begin_weight_update"] == 3 and hits["/end_weight_update"] == 3
    else:   # the release begin's TP check reads (0.5.20) decides it: neither is ever sent
        assert "/begin_weight_update" not in hits and "/end_weight_update" not in hits
    assert hits["/update_weights_from_tensor"] == 3


@pytest.mark.timeout(30)
def test_http_update_500_carries_body_and_is_not_retried():
    with fake.FakeSGLangServer(tp_size=2) as srv:
        a = http_engine(srv)
        a.begin_weight_update()
        srv.script["/update_weights_from_tensor"] = [(500, "CUDA error: an illegal memory access")]
        payloads = sg.flattened_bucket_payloads(mixed_tensors(), 2, output_str=True)
        with pytest.raises(sg.SGLangUpdateError, match="HTTP 500.*illegal memory access") as ei:
            a.update_weights_from_tensor(payloads, load_format="flattened_bucket")
        assert ei.value.status == 500 and "illegal memory access" in ei.value.body
        assert ei.value.opened is None            # SGLang may or may not have opened them
        payloads.release(unopened=True)           # here we know: the answer was scripted
        assert srv.hits["/update_weights_from_tensor"] == 1
        # refused by SGLang (400, success=False): its message in the error
        a.end_weight_update()
        with pytest.raises(sg.SGLangUpdateError, match="must run between") as ei:
            a.update_weights_from_bucket(mixed_tensors())
        assert ei.value.status == 400 and ei.value.opened is False


@pytest.mark.timeout(30)
def test_http_update_refused_by_sglangs_validation_opened_nothing():
    """SGLang 0.5.12-0.5.23 answer a body failing the request model with 400 and an ErrorResponse
    (FastAPI's 422 turned into 400), before any handler: the payloads are known unopened (the
    shape is checked against SGLang's own ErrorResponse in the sglang tier). Before: opened None,
    as for any 400. A handler's own 400 stays unknown."""
    with fake.FakeSGLangServer(tp_size=2) as srv:
        a = http_engine(srv)
        a.begin_weight_update()
        refusal = json.dumps({"object": "error", "message": "1 validation error", "type": "Bad Request",
                              "param": None, "code": 400})
        srv.script["/update_weights_from_tensor"] = [(400, refusal),
                                                     (400, json.dumps({"success": False, "message": "x"}))]
        for opened in (False, None):
            payloads = sg.flattened_bucket_payloads(mixed_tensors(), 2, output_str=True)
            with pytest.raises(sg.SGLangUpdateError, match="HTTP 400") as ei:
                a.update_weights_from_tensor(payloads, load_format="flattened_bucket")
            assert ei.value.status == 400 and ei.value.opened is opened, ei.value
            payloads.release(unopened=True)
    assert not sgc.validation_refusal(422, refusal) and not sgc.validation_refusal(400, "Bad Request")


@pytest.mark.timeout(30)
def test_http_idempotent_calls_retry_and_count():
    with fake.FakeSGLangServer(tp_size=1) as srv:
        a = http_engine(srv, tp_size=1, max_retries=2)
        srv.script["/flush_cache"] = [(503, "busy"), (500, "hiccup")]
        a.flush_cache()                                       # third attempt succeeds
        assert srv.hits["/flush_cache"] == 3 and a.http_attempts["/flush_cache"] == 3
        srv.script["/flush_cache"] = [(500, "down 1"), (500, "down 2"), (500, "still down")]
        with pytest.raises(sg.SGLangHTTPError, match="still down.*gave up after 3 attempts"):
            a.flush_cache()
        assert srv.hits["/flush_cache"] == 6
        srv.script["/get_weights_by_name"] = [(502, "bad gateway")]
        with pytest.raises(sg.SGLangError, match="no parameter"):   # retried, then the real 400
            a.get_weights_by_name("missing")
        assert srv.hits["/get_weights_by_name"] == 2
        srv.script["/flush_cache"] = [(400, "Flush cache failed: requests running")]
        with pytest.raises(sg.SGLangHTTPError, match="HTTP 400.*requests running"):
            a.flush_cache()                                   # a refusal is not retried
        assert srv.hits["/flush_cache"] == 7
        srv.script["/generate"] = [(500, "oom")]
        with pytest.raises(sg.SGLangHTTPError, match="oom"):
            a.generate([[1]])
        assert srv.hits["/generate"] == 1                     # not idempotent: one try
        srv.script["/release_memory_occupation"] = [(400, '{"error": {"message": "not idle"}}')]
        with pytest.raises(sg.SGLangHTTPError, match="not idle"):
            a.release_memory_occupation(["kv_cache"])
        assert srv.hits["/release_memory_occupation"] == 1


@pytest.mark.timeout(30)
def test_http_unreachable_server():
    with fake.FakeSGLangServer(tp_size=1) as srv:
        url = srv.url
    a = sg.SGLangEngine(base_url=url, tp_size=1, max_retries=2, retry_backoff_s=0.01, timeout_s=2)
    with pytest.raises(sg.SGLangHTTPError, match="no answer.*gave up after 3 attempts"):
        a.flush_cache()
    assert a.http_attempts["/flush_cache"] == 3
    with pytest.raises(sg.SGLangUpdateError, match="no answer") as ei:
        a.update_weights_from_bucket(mixed_tensors()[:1])
    assert ei.value.opened is False and a.http_attempts["/update_weights_from_tensor"] == 1
    assert not a.health()


@pytest.mark.timeout(30)
def test_a_replica_out_of_service_is_probed_once_per_sync():
    """The fleet's probe (`fleet.problem`): a replica still in service gets the client's retries
    before it is taken out; one already out of service is asked once (the manager probes it every
    sync: a dead one cost each sync the whole backoff, 3.5 s at the default 0.5 s)."""
    from fsdp_sync import fleet

    with fake.FakeSGLangServer(tp_size=1) as srv:
        url = srv.url
    a = sg.SGLangEngine(base_url=url, tp_size=1, max_retries=3, retry_backoff_s=0.2, timeout_s=2)
    t0 = time.monotonic()
    assert "no answer" in fleet.problem(a, once=True)
    assert a.http_attempts["/get_weight_version"] == 1 and time.monotonic() - t0 < 0.2
    assert "gave up after 4 attempts" in fleet.problem(a)
    assert a.http_attempts["/get_weight_version"] == 5


# --------------------------------------------------------------------------- the manager drives it

def _manager_rank(rank: int, world: int, multi_stage: bool = True) -> dict | None:
    """Two FSDP2 ranks (dp 1 x infer-TP 2) sync through FSDPShardingManager into SGLangEngine
    twice, training between: the first `with` on a freshly launched engine (holding all its
    memory), the second on one the first released."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.weights.export import iter_params
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    train_step(module, opt, synthetic_batch(cfg.vocab_size, step=0, rank=rank))
    mesh = make_mesh(1, world)
    src = SyncTopology.from_mesh(mesh).is_tp_src
    eng = fake.FakeSGLangEngine(tp_size=world) if src else None
    adapter = sg.SGLangEngine(eng) if src else None
    config = SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10, strategy="flattened",
                        multi_stage_wake_up=multi_stage)
    manager = FSDPShardingManager(module, adapter, mesh=mesh, config=config)
    per_sync, matches = [], []
    for step in (1, 2):
        before = len(eng.calls) if src else 0
        with manager:
            engine_calls = manager.stats.engine_calls
        expected = fake.digests(iter_params(module, dtype=torch.float32))   # collective: every rank
        if src:
            # get_server_info: tp_size at construction, then the stage timeline's memory probes
            calls = [c for c in eng.calls[before:] if c[0] != "get_server_info"]
            per_sync.append({"calls": [c[0] for c in calls], "tags": [c[1].get("tags") for c in calls]})
            matches.append(fake.digests(eng.weights.items()) == expected)
        train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
    manager.close()
    if not src:
        return None
    return {"syncs": per_sync, "engine_calls": engine_calls, "opened": eng.opened_payloads,
            "match": matches, "n": len(expected), "held_back": sorted(eng.offload_tags),
            "skipped": adapter.memory_skipped}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("multi_stage", [True, False], ids=["multi_stage", "resume_all"])
def test_sharding_manager_drives_the_adapter_unchanged(multi_stage):
    """The manager on a freshly launched SGLang (which holds all its memory) and then on the one
    it released. SGLang's scheduler quits on a resume of a tag it holds (the fake raises as its
    ``set.remove`` does): the first `with` resumes nothing, the second exactly what the first
    released; the cuda_graph pool, never released, is never resumed (``resume_all`` too)."""
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    out = run_ranks(_manager_rank, 2, multi_stage, timeout_s=110, env=spawn_env())[0]
    assert out["match"] == [True, True] and out["n"] > 0     # bit-exact: every tensor SGLang got
    n = out["engine_calls"]
    assert n >= 1 and out["opened"] == 2 * 2 * n  # each TP rank opened its own payload once a sync
    update = ["begin_weight_update"] + ["update_weights_from_tensor"] * n + ["end_weight_update"]
    first, second = out["syncs"]
    assert first["calls"] == update + ["release_memory_occupation"], first
    assert first["tags"][-1] == ["kv_cache", "weights"]
    if multi_stage:
        assert second["calls"] == (["resume_memory_occupation"] + update
                                   + ["resume_memory_occupation", "release_memory_occupation"])
        assert [second["tags"][0], second["tags"][-2]] == [["weights"], ["kv_cache"]]
    else:
        assert second["calls"] == (["resume_memory_occupation"] + update
                                   + ["release_memory_occupation"])
        assert second["tags"][0] == ["weights", "kv_cache"]      # not cuda_graph: SGLang holds it
    assert second["tags"][-1] == ["kv_cache", "weights"]
    assert out["held_back"] == ["kv_cache", "weights"]           # released again at the end
    skipped = [tags for call, tags in out["skipped"] if call == "resume_memory_occupation"]
    assert skipped == ([["weights"], ["kv_cache"]] if multi_stage
                       else [["cuda_graph", "weights", "kv_cache"], ["cuda_graph"]]), out["skipped"]


class _NoSessionSGLang(fake.FakeSGLangEngine):
    """Says yes to begin_weight_update and opens no session: SGLang then refuses every update
    before opening its payloads (`SGLangUpdateError.opened` is False)."""

    def begin_weight_update(self, selector="all"):
        self._record("begin_weight_update", selector=selector)
        return True, "Success"


class _RefusingBegin(fake.FakeSGLangEngine):
    """Refuses begin_weight_update for a reason of its own (a session left open by a dead trainer
    is no refusal: the transport aborts it and begins its own, `transport.sessions.begin`)."""

    def begin_weight_update(self, selector="all"):
        self._record("begin_weight_update", selector=selector)
        return False, "scripted refusal: the engine cannot open an update now"


def _refused_rank(rank: int, world: int, refuse: str) -> dict:
    """The manager syncs into an SGLang that refuses ``refuse`` ("begin": begin_weight_update,
    "unopened": the first update, unopened); what each rank saw and which of its shared-memory
    segments outlived the sync."""
    import gc

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp
    from _util import shm_segments

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
    mesh = make_mesh(1, world)
    src = SyncTopology.from_mesh(mesh).is_tp_src
    eng = None
    if src:
        eng = _NoSessionSGLang(tp_size=world) if refuse == "unopened" else _RefusingBegin(world)
    config = SyncConfig(dtype=torch.float32, bucket_bytes=64 << 10, strategy="flattened",
                        memory_probe="off")
    mine = f"torch_{os.getpid()}_"
    before = {x for x in shm_segments() if x.startswith(mine)}
    error = None
    try:
        with FSDPShardingManager(module, sg.SGLangEngine(eng) if src else None, mesh=mesh,
                                 config=config):
            pass
    except SyncError as exc:
        error = str(exc)
    gc.collect()
    return {"error": error, "left": sorted(x for x in shm_segments() - before if x.startswith(mine)),
            "calls": [c[0] for c in eng.calls if c[0] != "get_server_info"] if src else None,
            "opened": eng.opened_payloads if src else None}


def _refused_ranks(rank: int, world: int, refusals: tuple[str, ...]) -> dict:
    """`_refused_rank` for each refusal in turn, on the same ranks (each with its own module,
    engine and manager; each sync fails on every rank before the next begins)."""
    return {refuse: _refused_rank(rank, world, refuse) for refuse in refusals}


# One launch for both refusals: once two (deadline 60 s each), now one that pays two rank
# start-ups instead of four; the test that starts it waits for both.
REFUSED_DEADLINE = 120


@pytest.fixture(scope="module")
def refused(leftovers_check):
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    with leftovers_check():
        out = run_ranks(_refused_ranks, 2, ("begin", "unopened"), timeout_s=REFUSED_DEADLINE,
                        pg_timeout_s=20, env=spawn_env())
    return {refuse: [r[refuse] for r in out] for refuse in ("begin", "unopened")}


@pytest.mark.timeout(REFUSED_DEADLINE + 30)
def test_refused_begin_fails_the_sync_on_every_rank(refused):
    """A refused begin_weight_update on infer-TP rank 0 is a SyncError on every rank (it hung the
    other ranks in the payload gather before the bracket agreed), and nothing is sent."""
    out = refused["begin"]
    assert out[0]["error"] == out[1]["error"]
    assert "begin_weight_update" in out[0]["error"] and "scripted refusal" in out[0]["error"]
    assert "update_weights_from_tensor" not in out[0]["calls"] and out[0]["opened"] == 0
    assert out[0]["left"] == out[1]["left"] == []


@pytest.mark.timeout(REFUSED_DEADLINE + 30)
def test_update_refused_unopened_gives_every_rank_its_segments_back(refused):
    """SGLang refused the first bucket before opening it: the SyncError names its message on
    every rank, and every rank gives back the shared-memory references its payloads took (the
    untagged payloads cannot tell; infer-TP rank 0 heard SGLang's answer and tells the others)."""
    out = refused["unopened"]
    assert out[0]["error"] == out[1]["error"]
    assert "must run between begin_weight_update" in out[0]["error"], out[0]["error"]
    assert out[0]["calls"].count("update_weights_from_tensor") == 1 and out[0]["opened"] == 0
    assert out[0]["left"] == out[1]["left"] == []


def test_distributed_calls_in_process_and_over_http():
    """init/update/destroy of the weight-update group: SGLang's kwargs in process, its JSON bodies
    over HTTP, every refusal (no session, unknown group, bad dtype) raised with SGLang's message."""
    names, dtypes, shapes = ["model.norm.weight"], ["bfloat16"], [[64]]
    eng = fake.FakeSGLangEngine(tp_size=2)
    with fake.FakeSGLangServer(tp_size=2) as srv:
        for a in (sg.SGLangEngine(eng), sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)):
            a.init_weights_update_group("10.0.0.1", 1234, 1, 3, "weight_update_group", "gloo")
            with pytest.raises(sg.SGLangUpdateError, match="begin_weight_update"):
                a.update_weights_from_distributed(names, dtypes, shapes, "weight_update_group",
                                                  flush_cache=False, load_format="flattened_bucket")
            a.begin_weight_update()
            a.update_weights_from_distributed(names, dtypes, shapes, "weight_update_group",
                                              flush_cache=False, load_format="flattened_bucket")
            with pytest.raises(sg.SGLangUpdateError, match="Group other not in"):
                a.update_weights_from_distributed(names, dtypes, shapes, "other", flush_cache=False)
            with pytest.raises(ValueError, match="attribute names"):
                a.update_weights_from_distributed(names, ["torch.bfloat16"], shapes)
            a.end_weight_update()
            a.destroy_weights_update_group("weight_update_group")
            with pytest.raises(sg.SGLangError, match="does not exist"):
                a.destroy_weights_update_group("weight_update_group")
        body = next(b for m, p, b in srv.requests if p == "/update_weights_from_distributed")
        init = next(b for m, p, b in srv.requests if p == "/init_weights_update_group")
    assert body == {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "weight_update_group",
                    "flush_cache": False, "load_format": "flattened_bucket"}
    assert init == {"master_address": "10.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 3,
                    "group_name": "weight_update_group", "backend": "gloo"}
    calls = [c for c in eng.calls if c[0] == "update_weights_from_distributed"]
    assert calls[1][1] == {**{k: v for k, v in body.items()}}


# --------------------------------------------------------------------------- LoRA

LORA_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def lora_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = "base_model.model.model.layers.0.self_attn"
    return [(f"{base}.{m}.lora_{ab}.weight", torch.randn(*shape, generator=g).to(torch.bfloat16))
            for m in ("q_proj", "v_proj") for ab, shape in (("A", (4, 16)), ("B", (16, 4)))]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("engine_cls", [fake.FakeSGLangEngine, fake.Fake0512Engine],
                         ids=["0.5.23", "0.5.12"])
def test_lora_in_process_calls_sglangs_engine_with_a_dict(engine_cls):
    """``Engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format)``
    (0.5.12 and 0.5.23): the kwargs bind, ``tensors`` is the {name: tensor} dict its workers read,
    each TP rank holds every tensor bit for bit; pinned / added_tokens_config, which that Engine
    cannot take, are refused by name and release before anything is called; SGLang's
    ``error_message`` reaches the error."""
    eng = engine_cls(tp_size=2)
    a = sg.SGLangEngine(eng)
    named = lora_tensors()
    assert a.load_lora_adapter_from_tensors("a", named, LORA_CONFIG) == {"success": True}
    (name, kwargs), = [c for c in eng.calls if c[0] == "load_lora_adapter_from_tensors"]
    recorded_bind(engine_cls, name, kwargs)
    assert isinstance(kwargs["tensors"], dict) and kwargs["config_dict"] == LORA_CONFIG
    held = eng.loras["a"]
    assert held["ranks"] == 2 and fake.digests(held["tensors"].items()) == fake.digests(named)
    for kw, shown in (({"pinned": True}, "pinned=True"),
                      ({"added_tokens_config": {"<t>": 7}}, "added_tokens_config={'<t>': 7}")):
        with pytest.raises(sg.SGLangError, match=f"{shown}.*{engine_cls.VERSION}.*without "
                                                 f"{shown.split('=')[0]}"):
            a.load_lora_adapter_from_tensors("b", named, LORA_CONFIG, **kw)
    assert len([c for c in eng.calls if c[0] == "load_lora_adapter_from_tensors"]) == 1
    with pytest.raises(sg.SGLangUpdateError, match="Failed to load LoRA adapter a because it is "
                                                   "already loaded"):
        a.load_lora_adapter_from_tensors("a", dict(named), LORA_CONFIG)
    with pytest.raises(ValueError, match="load_format='flattened_bucket'"):
        a.load_lora_adapter_from_tensors("c", named, LORA_CONFIG, load_format="flattened_bucket")
    a.unload_lora_adapter("a")
    assert eng.loras == {}
    with pytest.raises(sg.SGLangUpdateError, match="LoRA adapter a is not loaded"):
        a.unload_lora_adapter("a")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", ["0.5.23", "0.5.12"])
def test_lora_over_http_sends_the_releases_payload_field(version):
    """0.5.23: ``serialized_named_tensors``, one base64 payload per TP rank; 0.5.12 (verl 0.9.1's
    pin): ``serialized_tensors``, ONE payload every TP rank opens. Each rank loads every tensor
    bit for bit, pinned / added_tokens_config arrive, no segment is left (the autouse check: one
    reference per opening), and the server's error_message reaches the error."""
    named = lora_tensors(seed=1)
    with fake.FakeSGLangServer(tp_size=2, version=version) as srv:
        a = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        a.load_lora_adapter_from_tensors("a", named, LORA_CONFIG, pinned=True,
                                         added_tokens_config={"<t>": 7})
        assert [m["id"] for m in a.available_models()["data"]] == ["fake-model", "a"]
        with pytest.raises(sg.SGLangUpdateError, match="already loaded"):
            a.load_lora_adapter_from_tensors("a", named, LORA_CONFIG)
        a.unload_lora_adapter("a")
        bodies = [b for _, p, b in srv.requests if p == "/load_lora_adapter_from_tensors"]
        held = srv.engine.loras
        opened = srv.engine.opened_payloads
    field, other = (("serialized_named_tensors", "serialized_tensors") if version == "0.5.23"
                    else ("serialized_tensors", "serialized_named_tensors"))
    body = bodies[0]
    assert other not in body
    assert set(body) <= set(fake.FakeSGLangServer.LORA_FIELDS if version == "0.5.23"
                            else fake.FakeSGLangServer.LORA_FIELDS_0512)
    if version == "0.5.23":
        assert isinstance(body[field], list) and len(body[field]) == 2
    else:
        assert isinstance(body[field], str)
    assert body["pinned"] is True and body["added_tokens_config"] == {"<t>": 7}
    assert held == {} and opened == 4          # two loads, each opened by both TP ranks


@pytest.mark.timeout(30)
def test_lora_over_http_loads_bit_exact_and_refuses_an_unread_release():
    named = lora_tensors(seed=2)
    with fake.FakeSGLangServer(tp_size=2, version="0.5.12") as srv:
        a = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        a.load_lora_adapter_from_tensors("a", dict(named), LORA_CONFIG)
        assert fake.digests(srv.engine.loras["a"]["tensors"].items()) == fake.digests(named)
        assert srv.engine.loras["a"]["ranks"] == 2
    with fake.FakeSGLangServer(tp_size=2) as srv:
        srv.engine.VERSION = "0.5.15"        # between 0.5.12 and 0.5.20: its field was not read
        a = sg.SGLangEngine(base_url=srv.url, retry_backoff_s=0.01, timeout_s=10)
        with pytest.raises(sg.SGLangError, match="SGLang 0.5.15.*not read.*nothing was sent"):
            a.load_lora_adapter_from_tensors("a", named, LORA_CONFIG)
        assert "/load_lora_adapter_from_tensors" not in srv.hits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine_cls", [fake.FakeSGLangEngine, fake.Fake0512Engine],
                         ids=["0.5.23", "0.5.12"])
def test_two_lora_syncs_under_one_name_into_an_in_process_engine(engine_cls):
    """`lora_sync.sync_adapter` twice under the same name into an in-process ``sglang.Engine``:
    ``available_models`` lists the first adapter from the Engine's LoRA registry (what
    ``/v1/models`` reads; the Engine has no ``lora_adapters``), so the second sync unloads it
    before loading again instead of failing with SGLang's "already loaded"; the engine then holds
    the second adapter's tensors bit for bit, and its cards have ``/v1/models``' shape."""
    from fsdp_sync import lora_sync
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import agree

    module = add_lora(build_model(load_config("tiny"), seed=0), 4, 8, ["q_proj", "v_proj"], seed=1)
    config = SyncConfig(lora="adapter", lora_name="policy", verify="off")
    eng = engine_cls(tp_size=2)
    a = sg.SGLangEngine(eng)
    assert not hasattr(eng, "lora_adapters")
    for step in range(2):
        with torch.no_grad():
            for n, p in module.named_parameters():
                if ".lora_" in n:
                    p.add_(0.25 * (step + 1))
        lora_sync.sync_adapter(module, config, [a], None, {}, agree)
    want = [(n.replace(".default.", "."), p.detach()) for n, p in module.named_parameters()
            if ".lora_" in n]                    # peft's names as saved: no adapter segment
    assert [c[0] for c in eng.calls if "lora" in c[0]] == [
        "load_lora_adapter_from_tensors", "unload_lora_adapter", "load_lora_adapter_from_tensors"]
    assert fake.digests(eng.loras["policy"]["tensors"].items()) == fake.digests(want)
    cards = a.available_models()
    assert cards["object"] == "list"
    base, card = cards["data"]
    assert (base["id"], base["root"], base["parent"]) == ("fake-model", "fake-model", None)
    assert (card["id"], card["root"], card["parent"], card["object"]) == (
        "policy", "__tensor__", "fake-model", "model")
    a.unload_lora_adapter("policy")
    assert [c["id"] for c in a.available_models()["data"]] == ["fake-model"]
    del eng.tokenizer_manager.lora_registry      # not an sglang.Engine: refused, not "none loaded"
    with pytest.raises(sg.SGLangError, match="no tokenizer_manager.lora_registry"):
        a.available_models()


class _Recording(pickle.Unpickler):
    """Opens a per-tensor HTTP payload as a server would, recording the class path it names for
    SGLang's LocalSerializedTensor (any other global: the standard lookup)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.named: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str):
        if name == "LocalSerializedTensor":
            self.named.append((module, name))
            return type(name, (), {})
        return super().find_class(module, name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version, module", [
    ("0.5.12", "sglang.srt.model_executor.model_runner"),
    ("0.5.23", "sglang.srt.model_executor.model_runner_components.weight_updater"),
])
def test_per_rank_values_go_under_the_servers_release_path(version, module):
    """`SerializedPerRank` values (per-tensor updates, the engine-layout loader) go to a server as
    SGLang's LocalSerializedTensor, which moved between releases: under the path of the release
    the server reports, not the trainer's (which may run another release or, as here, none)."""
    from fsdp_sync.engines.base import SerializedPerRank

    with fake.FakeSGLangServer(tp_size=2, version=version) as srv:
        a = http_engine(srv)
        obj = a._to_sglang(SerializedPerRank(values=[b"rank0", b"rank1"]))
    lease = handles.make_payloads([("w", obj)], 1, tagged=False)
    try:
        u = _Recording(lease.payloads[0])
        ((name, got),) = u.load()
    finally:
        lease.release(require_ack=False, unopened=[0])
    assert u.named == [(module, "LocalSerializedTensor")]
    assert name == "w" and got.values == [b"rank0", b"rank1"]


@pytest.mark.timeout(30)
def test_per_rank_values_for_an_unread_release_are_refused_before_sending():
    from fsdp_sync.engines.base import SerializedPerRank

    with fake.FakeSGLangServer(tp_size=2) as srv:
        srv.engine.VERSION = "0.5.15"        # between 0.5.12 and 0.5.20: not read
        a = http_engine(srv)
        with pytest.raises(sg.SGLangError, match="0.5.15.*LocalSerializedTensor was not read"):
            a.update_weights_from_tensor([("w", SerializedPerRank(values=["a", "b"]))])
        assert not [p for _, p, _ in srv.requests if p == "/update_weights_from_tensor"]


def test_in_process_weight_version_is_the_live_one_not_the_launch_record():
    """sglang.Engine 0.5.23's get_server_info answers its launch record, whose weight_version
    stays the launch value after updates; get_model_info answers the live one. The adapter read
    get_server_info, so an in-process 0.5.23 engine updated to '7' was said to serve 'default'.
    0.5.12 has no get_model_info: its get_server_info reads the server args updates change."""

    class Engine0523(fake.FakeSGLangEngine):
        def get_server_info(self):
            return {**super().get_server_info(), "weight_version": "default"}

        def get_model_info(self):
            return {"model_path": "m", "weight_version": "7"}

    class Engine0512(fake.FakeSGLangEngine):
        def get_server_info(self):
            return {**super().get_server_info(), "weight_version": "6"}

    assert sg.SGLangEngine(Engine0523(tp_size=1)).get_weight_version() == "7"
    assert sg.SGLangEngine(Engine0512(tp_size=1)).get_weight_version() == "6"
