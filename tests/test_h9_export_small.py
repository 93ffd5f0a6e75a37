"""Small export contracts the H9 mutation pass found untested (in-process, a plain module).

- `export_checks.model_entries` carries the config's ``tie_word_embeddings``: two ranks whose
  models export the same tensors but whose configs tie differently must not agree (one would run
  the tied-head check's gathers alone). With that entry dropped, tests/test_tied_mismatch.py still
  passed (its tied and untied models differ in names too).
- `export.iter_params(names=...)` gathers and yields only those tensors: verify="sample" relies on
  it to gather a sample, not the model (dropping the filter survived test_verify_sample_cost)."""

from __future__ import annotations

import types

import torch
from torch import nn

from fsdp_sync.weights import export, export_checks


def _model(tie: bool) -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    m.config = types.SimpleNamespace(tie_word_embeddings=tie)
    return m


def test_the_tie_setting_is_part_of_what_the_ranks_compare():
    cfg = types.SimpleNamespace(dtype=None, lora="off")
    a, b = export_checks.model_entries(_model(True), cfg), export_checks.model_entries(_model(False), cfg)
    assert [e for e in a if not e[0].startswith("(config)")] == [e for e in b if not e[0].startswith("(config)")]
    assert export_checks.digest_of(a) != export_checks.digest_of(b)
    text = export_checks.describe_difference([a, b])
    assert "model.config.tie_word_embeddings is False on rank 1, True on rank 0" in text, text


def test_iter_params_yields_only_the_names_asked_for():
    m = _model(False)
    got = list(export.iter_params(m, names={"1.weight", "0.bias"}))
    assert [n for n, _ in got] == ["0.bias", "1.weight"]          # in export order
    assert torch.equal(got[1][1], m[1].weight)
    assert list(export.iter_params(m, names=set())) == []
