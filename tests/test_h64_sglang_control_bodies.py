"""H64: the bodies `SGLangEngine`'s generation controls send over HTTP, as SGLang 0.5.23's request
models read them (io_struct: ``PauseGenerationReqInput.mode`` defaults to "abort",
``UpdateWeightVersionReqInput.abort_all_requests`` to True, and the server drops no field it
knows): a pause names its mode (else a "retract" or "in_place" pause would abort every request in
flight), a weight version says whether to abort (else SGLang aborts them all). The same bodies
against the installed SGLang's own models: tests/sglang_tier/test_sgladapt_bodies.py."""

from __future__ import annotations

import json

import pytest

import fake_sglang as fake
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError
from fsdp_sync.engines.sglang.control import PAUSE_MODES

pytestmark = pytest.mark.timeout(60)


def test_pause_names_its_mode_and_a_weight_version_says_whether_to_abort():
    with fake.FakeSGLangServer(tp_size=1, version="0.5.23") as srv:
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        for call in ("pause", "continue"):       # SGLang's answers (the fake's engine has no pause)
            srv.script[f"/{call}_generation"] = [(200, json.dumps(
                {"message": f"Generation {call}d successfully.", "status": "ok"}))] * len(PAUSE_MODES)
        for mode in PAUSE_MODES:
            a.pause_generation(mode)
            a.continue_generation()
        a.update_weight_version("v1")
        a.update_weight_version("v2", abort_all_requests=True)
        sent = [(path, body) for method, path, body in srv.requests
                if path in ("/pause_generation", "/continue_generation", "/update_weight_version")]
        assert sent == [("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}),
                        ("/pause_generation", {"mode": "retract"}), ("/continue_generation", {}),
                        ("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {}),
                        ("/update_weight_version", {"new_version": "v1", "abort_all_requests": False}),
                        ("/update_weight_version", {"new_version": "v2", "abort_all_requests": True})], sent
        with pytest.raises(ValueError, match="mode must be one of 'abort', 'retract', 'in_place', got 'stop'"):
            a.pause_generation("stop")
        assert [p for _, p, _ in srv.requests].count("/pause_generation") == 3   # nothing sent


def test_a_weight_version_refused_raises_naming_the_call_and_the_engines_message():
    class Engine:          # an in-process engine with SGLang's call, answering as SGLang's handler
        def get_server_info(self):
            return {"tp_size": 1}

        def update_weight_version(self, new_version, abort_all_requests):
            return {"success": False, "message": f"Failed to update weight version: {new_version} busy"}

    with pytest.raises(SGLangError, match="SGLang refused update_weight_version: Failed to update "
                                          "weight version: v3 busy"):
        SGLangEngine(Engine()).update_weight_version("v3")
