"""The Python snippets of README.md and docs/*.md as written: an excerpt of an example (first line
``# examples/NAME.py``) must be that file's lines, in order (the example itself is run by
test_launchers); every other snippet runs as it stands in a fresh interpreter, except one that
needs a running SGLang server, which must compile and name only what exists. Every relative link
in those pages (pages, data files, figures, scripts) must point at a file of the repository."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
          for block in re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.S | re.M)]
NEEDS_SERVER = 'SGLangEngine(base_url="http://'
README_MAX_BYTES = 20 * 1024


def _code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_readme_has_the_snippets():
    readme = [b for page, b in BLOCKS if page == "README.md"]
    assert len(readme) >= 3
    assert any(b.startswith("# examples/") and "with manager:" in b for b in readme)


def test_docs_pages_have_snippets_too():
    """The topic pages are checked as the README is: the weight path and the reference engine
    snippets live in docs/methods.md now."""
    docs = [page for page, _ in BLOCKS if page.startswith("docs/")]
    assert "docs/methods.md" in docs and len(docs) >= 2, docs


def test_readme_is_for_users():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to docs/"
    text = (ROOT / "README.md").read_text()
    for command in ("make demo", "make test", "make test-sglang", "make test-verl"):
        assert command in text, f"README.md must name {command!r} (.ci/run runs what it names)"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    path = ROOT / page
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if "://" in target:
            continue
        dest = path.parent / target if target else path
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{page} links to files or headings that do not exist: {missing}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"{p}-{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_readme_snippet(i):
    page, block = BLOCKS[i]
    first = block.splitlines()[0]
    if first.startswith("# examples/"):
        lines = _code_lines((ROOT / first[2:].strip()).read_text())
        pos = 0
        for line in _code_lines(block):
            assert line in lines[pos:], f"{page} line not in {first[2:]} (in order): {line!r}"
            pos = lines.index(line, pos) + 1
        return
    compile(block, f"{page} block", "exec")
    if NEEDS_SERVER in block:
        from fsdp_sync.engines.sglang import SGLangEngine

        params = inspect.signature(SGLangEngine).parameters
        assert "base_url" in params and list(params)[0] != "base_url"
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, f"{page} block {i} failed:\n{block}\n{r.stderr[-3000:]}"
