"""The refusal `transport.sessions.begin` takes over as SGLang's session left open
(`sessions.LEFT_OPEN`) is the installed SGLang's own: read from the scheduler's
``begin_weight_update`` (its module pulls in the whole runtime, torchvision included, so it is
parsed, not imported). SGLang 0.5.12 (the older release the tier keeps beside it) has no session
at all: no route, no scheduler method, and `versions` says so (`SGLangEngine` skips the calls).
The default tier's tests/test_h8_sessions.py runs `begin` on these texts as the engines deliver
them."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from fsdp_sync.engines.sglang import versions
from fsdp_sync.transport.sessions import LEFT_OPEN

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(60)]


def _messages(fn: ast.AST) -> list[str]:
    return [kw.value.value for n in ast.walk(fn) if isinstance(n, ast.Call) for kw in n.keywords
            if kw.arg == "message" and isinstance(kw.value, ast.Constant)]


def test_sglangs_session_refusal_is_the_text_taken_over():
    root = Path(importlib.util.find_spec("sglang").origin).parent / "srt"
    src = (root / "managers" / "scheduler_components" / "weight_updater.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "begin_weight_update")
    assert [m for m in _messages(fn) if m != "Success"] == [LEFT_OPEN[0]]
    assert '@app.post("/begin_weight_update")' in (root / "entrypoints" / "http_server.py").read_text()


def test_sglang_0_5_12_has_no_session():
    old = Path(sys.prefix) / "sglang-0.5.12" / "sglang" / "srt"
    if not old.is_dir():
        pytest.skip(f"{old} not built (SGLANG_OLD_VERSIONS without 0.5.12)")
    for path in old.rglob("*.py"):
        assert "begin_weight_update" not in path.read_text(errors="replace"), path
    assert not versions.features("0.5.12").weight_update_session
