"""`engines.sglang.client.validation_refusal` reads SGLang's own answer to a body failing its
request model: the installed SGLang's ``ErrorResponse``, built as its ``RequestValidationError``
handler builds it (400, ``type`` "Bad Request"), and that handler's source in 0.5.23 and in the
0.5.12 beside it (`http_server.py` pulls in the whole runtime, so it is read, not imported). Such
an update answer means no payload was opened (`test_sglang_adapter`'s
``test_http_update_refused_by_sglangs_validation_opened_nothing``)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from http import HTTPStatus
from pathlib import Path

import pytest

from fsdp_sync.engines.sglang.client import validation_refusal

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(60)]


def _handler(src: str) -> str:
    start = src.index("@app.exception_handler(RequestValidationError)")
    end = src.index("\n\n\n", start)
    return src[start:end]


def _error_response(root: Path, **given) -> dict:
    """What ``ErrorResponse(**given).model_dump()`` gives: its fields in order, defaults where not
    given (protocol.py imports openai, which the tier does not install: read, not imported)."""
    src = (root / "srt" / "entrypoints" / "openai" / "protocol.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "ErrorResponse")
    out = {}
    for st in cls.body:
        if isinstance(st, ast.AnnAssign):
            name = st.target.id
            out[name] = given[name] if name in given else ast.literal_eval(st.value)
    return out


def test_sglangs_validation_answer_is_read_as_unopened():
    # a handler's own refusal of an update (SGLang's {"success": false, ...}) is not
    assert not validation_refusal(400, json.dumps({"success": False, "message": "Failed to update"}))
    roots = [Path(importlib.util.find_spec("sglang").origin).parent]
    old = Path(sys.prefix) / "sglang-0.5.12" / "sglang"
    if old.is_dir():
        roots.append(old)
    for root in roots:
        err = _error_response(root, message="1 validation error", type=HTTPStatus.BAD_REQUEST.phrase,
                              code=HTTPStatus.BAD_REQUEST.value)
        assert validation_refusal(400, json.dumps(err)), (root, err)
        handler = _handler((root / "srt" / "entrypoints" / "http_server.py").read_text())
        assert "ErrorResponse(" in handler and "type=HTTPStatus.BAD_REQUEST.phrase" in handler, root
        assert "status_code=400" in handler and "content=err.model_dump()" in handler, root
