"""The README's Python snippets as written: an excerpt of an example (first line
``# examples/NAME.py``) must be that file's lines, in order (the example itself is run by
test_launchers); every other snippet runs as it stands in a fresh interpreter, except the one that
needs a running SGLang server, which must compile and name only what exists."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)
NEEDS_SERVER = 'SGLangEngine(base_url="http://'


def _code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 4
    assert any(b.startswith("# examples/") and "with manager:" in b for b in BLOCKS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_snippet(i):
    block = BLOCKS[i]
    first = block.splitlines()[0]
    if first.startswith("# examples/"):
        lines = _code_lines((ROOT / first[2:].strip()).read_text())
        pos = 0
        for line in _code_lines(block):
            assert line in lines[pos:], f"README line not in {first[2:]} (in order): {line!r}"
            pos = lines.index(line, pos) + 1
        return
    compile(block, f"README block {i}", "exec")
    if NEEDS_SERVER in block:
        from fsdp_sync.engines.sglang import SGLangEngine

        params = inspect.signature(SGLangEngine).parameters
        assert "base_url" in params and list(params)[0] != "base_url"
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, f"README block {i} failed:\n{block}\n{r.stderr[-3000:]}"
