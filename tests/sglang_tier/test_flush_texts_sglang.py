"""``fsdp-sync serve``'s ``/flush_cache`` answers (`serve_cache.FLUSHED`, `REFUSED` and the
scheduler's refusals) are the installed SGLang's own texts: read from its ``http_server.flush_cache``
and its flush wrapper's source, not imported (its HTTP server module pulls in the whole runtime).
The default tier's tests/test_serve_h2_flush_answers.py checks serve answers with these texts."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from fsdp_sync.engines.reference.serve_cache import FLUSHED, REFUSED

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(60)]


def test_sglangs_own_texts_are_serves():
    root = Path(importlib.util.find_spec("sglang").origin).parent / "srt"
    server = root / "entrypoints" / "http_server.py"
    src = server.read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.AsyncFunctionDef) and n.name == "flush_cache")
    texts = [n.value.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(
        n.value, ast.Constant) and getattr(n.targets[0], "id", "") == "content"]
    assert texts == [FLUSHED]
    block = ast.get_source_segment(src, fn)
    assert repr(REFUSED).replace("'", '"') in block and "HTTPStatus.BAD_REQUEST" in block
    wrapper = (root / "managers" / "scheduler_components" / "flush_wrapper.py").read_text()
    for words in ("Another flush_cache is already in progress.", "Timed out waiting for idle state."):
        assert f'"{words}"' in wrapper
