"""The house rules of fsdp_sync's layout (docs/DESIGN: the restructure issue), checked on the
source itself: no import cycle among its modules (imports inside functions count), nothing outside
``fsdp_sync/cli`` imports the CLI, no private name imported across modules, one builder of the
wire's flattened-bucket payload, and ``import`` of the library's core pulls in neither the CLI nor
``rich``/``matplotlib``."""

from __future__ import annotations

import ast
import subprocess
import sys

import torch

from _util import ROOT

PKG = ROOT / "fsdp_sync"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text()))
    return out


def _imports(name: str, path, tree) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in the module, function-level ones included."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, tree) in mods.items():
        for mod, names in _imports(name, path, tree):
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods] or [mod]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):   # a package's own __init__
                    graph[name].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_cycle_and_nothing_outside_cli_imports_it():
    graph = _graph()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    into_cli = sorted(f"{m} -> {t}" for m, ts in graph.items() if not m.startswith("fsdp_sync.cli")
                      for t in ts if t == "fsdp_sync.cli" or t.startswith("fsdp_sync.cli."))
    assert into_cli == []
    # the engines and transports do not import each other's modules (transports: the protocol only)
    cross = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                   if (m.startswith("fsdp_sync.engines") and t.startswith("fsdp_sync.transport"))
                   or (m.startswith("fsdp_sync.transport") and t.startswith("fsdp_sync.engines")
                       and t not in ("fsdp_sync.engines", "fsdp_sync.engines.base")))
    assert cross == []


def test_no_private_name_imported_across_modules():
    mods = _modules()
    bad = []
    for name, (path, tree) in mods.items():
        for mod, names in _imports(name, path, tree):
            if mod.startswith("fsdp_sync") and mod != name:
                bad += [f"{name}: from {mod} import {n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_the_flattened_payload_is_built_in_one_place():
    """Every dict literal keyed ``"flattened_tensor"`` (the payload SGLang opens) is in wire.py."""
    holders = sorted({str(path.relative_to(ROOT)) for _, (path, tree) in _modules().items()
                      for node in ast.walk(tree) if isinstance(node, ast.Dict)
                      and any(isinstance(k, ast.Constant) and k.value == "flattened_tensor"
                              for k in node.keys)})
    assert holders == ["fsdp_sync/wire.py"]


def test_one_send_loop_gathers_payloads_to_the_engine():
    """Payloads reach infer-TP rank 0 in one place, the tensor transport's send loop (issue 22
    item 5): no other module calls ``gather_object`` / ``gather_to_src`` (topology defines the
    latter), and the verl adapter agrees and gathers nothing itself."""
    def called(tree) -> set[str]:
        return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                for n in ast.walk(tree) if isinstance(n, ast.Call)}

    mods = _modules()
    gatherers = sorted(str(path.relative_to(ROOT)) for _, (path, tree) in mods.items()
                       if called(tree) & {"gather_object", "gather_to_src"})
    assert gatherers == ["fsdp_sync/topology.py", "fsdp_sync/transport/tensor.py"]
    path, tree = mods["fsdp_sync.integrations.verl.adapter"]
    collectives = called(tree) & {"agree", "all_reduce", "broadcast_object_list", "broadcast",
                                  "gather_object", "gather_to_src", "update_weights_from_tensor"}
    assert collectives == set() and "send" in called(tree)


def test_importing_the_library_pulls_in_neither_the_cli_nor_its_packages():
    code = ("import sys, fsdp_sync.manager, fsdp_sync.engines.reference, fsdp_sync.engines.reference.worker, "
            "fsdp_sync.transport.tensor, fsdp_sync.transport.distributed, fsdp_sync.transport.disk, "
            "fsdp_sync.verify, fsdp_sync.weights.reshard, fsdp_sync.wire, fsdp_sync.faultpoint\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'matplotlib') "
            "or m.startswith('fsdp_sync.cli')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_wire_flattened_bucket_round_trip_and_errors():
    import pytest

    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets
    from fsdp_sync.wire import flattened_bucket, open_flattened_bucket

    named = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([1, 2, 3], dtype=torch.int64),
             "c": torch.ones(5, dtype=torch.bfloat16)}
    (bkt,) = plan_buckets([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named.items()], 1 << 20)
    reused = torch.zeros(bkt.nbytes + 100, dtype=torch.uint8)    # a bigger, reused buffer
    flatten(bkt, named, out=reused[:bkt.nbytes])
    obj = flattened_bucket(reused, bkt)
    assert obj["flattened_tensor"].numel() == bkt.nbytes
    assert obj["flattened_tensor"].data_ptr() == reused.data_ptr()   # a view, no copy
    assert [m.name for m in obj["metadata"]] == ["a", "b", "c"]
    got = dict(open_flattened_bucket(obj))
    for n, t in named.items():
        assert torch.equal(got[n], t) and got[n].dtype == t.dtype
    with pytest.raises(ValueError, match=f"of {bkt.nbytes} bytes cannot be read from a buffer of 8"):
        flattened_bucket(reused[:8], bkt)
    with pytest.raises(ValueError, match="'flattened_tensor' and 'metadata', got list"):
        open_flattened_bucket([1])
    with pytest.raises(ValueError, match="bad flattened bucket"):
        open_flattened_bucket({"flattened_tensor": reused, "metadata": [object()]})
