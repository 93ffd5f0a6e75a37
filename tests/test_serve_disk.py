"""`fsdp-sync serve`'s ``update_weights_from_disk`` never says success for a wrong model (issue 36
item 2): a directory holding only ``model.norm.weight`` (zeros) answered ``200 {"success": true}``
and generate then returned all zeros; a tied checkpoint (no ``lm_head.weight``) into an untied
server succeeded too, serving new layers with the old head. Both are refused now, as is a
checkpoint whose ``config.json`` describes another model; the old weights keep serving (the same
generate output, the same checksum), and a complete checkpoint loads and says how many tensors.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(180)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    allowed = tmp_path_factory.mktemp("ckpts")
    with ReferenceEngine("tiny", tp_size=2, seed=3) as eng, \
            EngineServer(eng, allowed_disk_dirs=[str(allowed)]) as srv:
        yield eng, srv, allowed


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read().decode())
    finally:
        conn.close()


def _greedy(srv) -> list[int]:
    status, out = _post(srv, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0}})
    assert status == 200, out
    return out["output_ids"]


def _save(d: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
    d.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(d / "model.safetensors"))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _new_weights(eng, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(eng.layout.full_shape(n), generator=g) * 0.05 for n in eng.hf_names()}


def test_a_partial_or_other_model_checkpoint_is_refused_and_the_old_weights_serve(served):
    eng, srv, allowed = served
    assert eng.spec.tie_word_embeddings is False and "lm_head.weight" in eng.hf_names()
    before_out, before_sum = _greedy(srv), eng.weights_checksum()
    norm = eng.layout.full_shape("model.norm.weight")
    full = _new_weights(eng, seed=7)
    config = eng.config.to_dict()
    cases = [
        # the case: one tensor of zeros, which made generate answer all zeros
        ("norm_only", {"model.norm.weight": torch.zeros(norm)}, None,
         [f"lacks {len(full) - 1} of the {len(full)} tensors", "'model.embed_tokens.weight'"]),
        # a tied checkpoint (no lm_head) into this untied engine: new layers, the old head
        ("tied", {n: t for n, t in full.items() if n != "lm_head.weight"}, None,
         ["lacks 1 of the", "'lm_head.weight'", "tied checkpoint"]),
        # every tensor, but config.json describes another model (other norm epsilon)
        ("other_config", full, dict(config, rms_norm_eps=1e-2),
         ["config.json describes another model", "rms_norm_eps: checkpoint 0.01"]),
    ]
    for name, tensors, cfg, words in cases:
        status, out = _post(srv, "/update_weights_from_disk",
                             {"model_path": _save(allowed / name, tensors, cfg)})
        assert status == 400 and out["success"] is False, (name, status, out)
        for w in words:
            assert w in out["message"], (name, w, out["message"])
        assert eng.weights_checksum() == before_sum, name        # nothing of it was loaded
        assert _greedy(srv) == before_out, name                   # and generate did not change

    # a complete checkpoint with the served model's config loads, and says how much it loaded
    status, out = _post(srv, "/update_weights_from_disk",
                        {"model_path": _save(allowed / "complete", full, config)})
    assert status == 200 and out["success"] is True, out
    assert out["tensors_loaded"] == len(full) and f"{len(full)} tensors" in out["message"], out
    for n, t in full.items():
        assert torch.equal(eng.get_weights_by_name(n), t), n
    assert _greedy(srv) != before_out


def test_the_in_process_engine_keeps_sglangs_partial_loads_but_checks_config(served, tmp_path):
    """Only the server asks for a complete checkpoint (``require_complete``); in process the
    engine loads the names present, as SGLang does, but a config.json of another model is
    refused there too."""
    eng, _, _ = served
    norm = eng.layout.full_shape("model.norm.weight")
    new = torch.full(norm, 0.5)
    with pytest.raises(ValueError, match="lacks"):
        eng.update_weights_from_disk(_save(tmp_path / "a", {"model.norm.weight": new}),
                                     require_complete=True)
    eng.update_weights_from_disk(_save(tmp_path / "b", {"model.norm.weight": new}))
    assert torch.equal(eng.get_weights_by_name("model.norm.weight"), new)
    assert eng.disk_tensors_loaded == 1
    other = dict(eng.config.to_dict(), num_hidden_layers=eng.config.num_hidden_layers + 1)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        eng.update_weights_from_disk(_save(tmp_path / "c", {"model.norm.weight": new * 2}, other))
    assert torch.equal(eng.get_weights_by_name("model.norm.weight"), new)
