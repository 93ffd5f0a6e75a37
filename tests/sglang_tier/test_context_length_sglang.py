"""The reference engine's context length (`rollout.sglang_context_length`, what `fsdp-sync serve`
holds requests to) against SGLang's own ``get_context_length`` of the installed release, for every
config of the default tier's cases (tests/test_serve_h2_context_length.py): linear / dynamic / yarn
/ llama3 rope scaling, the keys SGLang reads before ``max_position_embeddings``.

SGLang's function is compiled from its installed source: importing its module pulls in sglang's
multimodal stack, which needs torchvision (not in the tier's venv).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_serve_h2_context_length import CASES, config  # noqa: E402

from fsdp_sync.engines.reference.rollout import CONTEXT_LENGTH_KEYS, sglang_context_length  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]


def _sglang_get_context_length():
    root = Path(importlib.util.find_spec("sglang").origin).parent
    src = root / "srt" / "utils" / "hf_transformers" / "common.py"
    assert src.is_file(), f"SGLang's get_context_length moved (no {src}): read it again"
    tree = ast.parse(src.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.Assign) and any(
        getattr(t, "id", "") == "CONTEXT_LENGTH_KEYS" for t in n.targets)) or (
        isinstance(n, ast.FunctionDef) and n.name == "get_context_length")]
    assert len(keep) == 2, "SGLang's get_context_length moved: read it again"
    ns: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(src), "exec"), ns)
    return ns["get_context_length"], tuple(ns["CONTEXT_LENGTH_KEYS"])


def test_every_case_agrees_with_the_installed_sglang():
    theirs, keys = _sglang_get_context_length()
    assert keys == CONTEXT_LENGTH_KEYS
    for name, (kw, want) in CASES.items():
        cfg = config(**kw)
        assert (name, theirs(cfg)) == (name, want) == (name, sglang_context_length(cfg))
