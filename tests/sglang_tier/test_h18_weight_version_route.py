"""Where `SGLangEngine.get_weight_version` reads the version over HTTP, against the installed
server's source (`make test-sglang`): ``/get_weight_version`` is gone (0.5.21 on) or answers 404
(0.5.12: "deprecated, use /model_info"), so the adapter falls back to ``GET /get_model_info``,
whose handler answers a ``weight_version``. The default tier (``test_h18_adapter_gaps``) checks
the adapter takes that fallback and not ``/get_server_info`` (0.5.23's launch record).

Read from the installed ``http_server.py`` with ``ast`` (on a CPU-only torch the server module
does not import); runs against whichever release is first on the path.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

SERVER = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / \
    "entrypoints" / "http_server.py"


def _handlers() -> tuple[dict[str, ast.AST], dict[str, ast.AST]]:
    """``{route: handler}`` for GET routes and ``{function name: node}``."""
    tree = ast.parse(SERVER.read_text())
    routes, funcs = {}, {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        funcs[node.name] = node
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and isinstance(d.func.value, ast.Name) and d.func.value.id == "app"
                    and d.args and isinstance(d.args[0], ast.Constant)):
                methods = (["GET"] if d.func.attr == "get" else
                           next((ast.literal_eval(k.value) for k in d.keywords if k.arg == "methods"),
                                ["GET"]) if d.func.attr == "api_route" else [])
                if "GET" in methods:
                    routes[d.args[0].value] = node
    return routes, funcs


def test_the_weight_version_is_read_from_get_model_info():
    routes, funcs = _handlers()
    assert "/get_model_info" in routes, "GET /get_model_info not served: the adapter's fallback"
    handler = routes["/get_model_info"]
    seen = {handler.name}
    # /get_model_info awaits model_info() in both releases read: follow plain calls by name
    todo = [handler]
    while todo:
        node = todo.pop()
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                    and call.func.id in funcs and call.func.id not in seen:
                seen.add(call.func.id)
                todo.append(funcs[call.func.id])
    keys = {k.value for name in seen for d in ast.walk(funcs[name]) if isinstance(d, ast.Dict)
            for k in d.keys if isinstance(k, ast.Constant)}
    assert "weight_version" in keys, f"/get_model_info ({sorted(seen)}) answers no weight_version"
    old = routes.get("/get_weight_version")
    if old is not None:    # 0.5.12: kept only to say it is deprecated, with a 404
        text = ast.unparse(old)
        assert "HTTPException" in text and "404" in text, text
