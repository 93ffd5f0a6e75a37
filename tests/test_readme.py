"""The Python snippets of README.md and docs/*.md as written: an excerpt of an example (first line
``# examples/NAME.py``) must be that file's lines, in order (the example itself is run by
test_launchers); every other snippet runs as it stands in a fresh interpreter, except one that
needs a running SGLang server, which must compile and name only what exists. Every relative link
in those pages (pages, data files, figures, scripts) must point at a file of the repository."""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

import pytest

from _util import run_output

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RECIPES = sorted((ROOT / "fsdp_sync/recipes").rglob("*.yaml")) + sorted((ROOT / "recipes").rglob("*.yaml"))
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
    r = run_output([sys.executable, "-c", block], cwd=ROOT, env=env, timeout=100)
    assert r.returncode == 0, f"{page} block {i} failed:\n{block}\n{r.stderr[-3000:]}"


# ------------------------------------------------------------- the Layout section (docs/layout.md)
# Issue 36 item 10 (when it was README.md's): it named fsdp_sync/serve.py and fsdp_sync/sglang_loader.py (neither existed),
# left `plan` out of cli/ and listed 4 of the 14 model recipes.

LAYOUT_PAGE = ROOT / "docs" / "layout.md"
_PATH = re.compile(r"(?<![\w/.`-])([\w.-]+(?:/[\w.-]+)*(?:\.py|\.md|\.sh|\.yaml|/))(?![\w/-])")


def _layout_block() -> str:
    text = LAYOUT_PAGE.read_text()
    m = re.search(r"^## Layout\n+```\n(.*?)^```$", text, re.S | re.M)
    assert m, "docs/layout.md has no ## Layout section with a code block"
    return m.group(1)


def _layout_entries() -> list[tuple[str, Path, list[Path], str]]:
    """(token, the folder it is read in, the folders of its entry it may also be read in, line):
    a line at column 0 is read from the repository root; an indented one inside ``fsdp_sync/``;
    a token may also name a file inside a folder its entry named before it (``engines/ ...
    reference/ ... serve.py``), on the entry's line or its continuation lines."""
    out = []
    context: list[Path] = []
    for line in _layout_block().splitlines():
        indent = len(line) - len(line.lstrip())
        base = ROOT if indent == 0 else ROOT / "fsdp_sync"
        if indent <= 2:                      # a new entry (continuation lines are indented deeper)
            context = []
        for token in _PATH.findall(line):
            out.append((token, base, list(context), line.strip()))
            for folder in [base] + context:
                if token.endswith("/") and (folder / token).is_dir():
                    context.append(folder / token)
                    break
    return out


def test_readme_layout_names_only_paths_that_exist():
    entries = _layout_entries()
    assert len(entries) > 20, entries
    missing = [f"{token!r} in {line!r}" for token, base, context, line in entries
               if not any((folder / token).exists() for folder in [base] + context)]
    assert not missing, f"docs/layout.md's Layout names paths that do not exist: {missing}"


def test_readme_layout_lists_every_module_and_package():
    named = {(base / token).resolve() for token, base, _, _ in _layout_entries()}
    pkg = ROOT / "fsdp_sync"
    want = {p.resolve() for p in pkg.glob("*.py")} | {p.resolve() for p in pkg.iterdir()
                                                       if p.is_dir() and p.name != "__pycache__"}
    absent = sorted(str(p.relative_to(ROOT.resolve())) for p in want - named)
    assert not absent, f"docs/layout.md's Layout leaves out {absent}"


def test_readme_layout_names_every_command_and_model_recipe():
    from fsdp_sync.cli.app import build_parser
    from fsdp_sync.models import model_recipes

    block = _layout_block()
    commands = re.search(r"`fsdp-sync ([^`]*)`", block).group(1)
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert [c.strip() for c in commands.split("|")] == list(sub.choices), commands
    listed = re.search(r"models/ \(([^)]*)\)", block, re.S).group(1)
    names = [n.strip() for n in " ".join(listed.split()).split(",")]
    assert sorted(names) == model_recipes(), (names, model_recipes())


def _stated_counts(comment: str) -> list[tuple[str, float, float]]:
    """(what the comment says, the count it states, how far off it may be): ``139,840
    parameters`` exactly; ``~0.2M`` / ``1.54 B parameters`` to half its last digit or 1 %."""
    out = []
    for digits in re.findall(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+|\d+) parameters", comment):
        out.append((f"{digits} parameters", float(digits.replace(",", "")), 0.0))
    for num, unit in re.findall(r"~?(\d+(?:\.\d+)?) ?([MB]) parameters", comment):
        scale = {"M": 1e6, "B": 1e9}[unit]
        last = 10 ** -len(num.split(".")[1]) if "." in num else 1
        value = float(num) * scale
        out.append((f"{num}{unit} parameters", value, max(last * scale / 2, 0.01 * value)))
    return out


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "fsdp_sync/recipes/models").glob("*.yaml")))
def test_model_recipe_comments_state_their_parameter_count(name):
    """tiny.yaml said about 0.2 M parameters; it has 139,840 (counted on the meta device)."""
    from fsdp_sync.models import count_params
    from fsdp_sync.plan import meta_model

    text = (ROOT / "fsdp_sync/recipes/models" / f"{name}.yaml").read_text()
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    params = count_params(meta_model(name)[1])[0]
    for said, value, slack in _stated_counts(comment):
        assert abs(value - params) <= slack, f"{name}.yaml says {said}; it has {params:,}"


def _commands() -> list[tuple[str, str]]:
    """Every ``fsdp-sync ...`` command the pages show: inline code and lines of shell blocks (a
    trailing comment, a ``$ `` prompt and ``\\`` continuations taken off); and those the shipped
    recipes' comments show (inline code, or a comment line that is one, after ``Run:``)."""
    out = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        out += [(name, m) for m in re.findall(r"`(fsdp-sync [^`]+)`", text)]
        for block in re.findall(r"^```(?:bash|sh|shell|console)?\n(.*?)^```$", text, re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("fsdp-sync "):
                    out.append((name, line.split(" #")[0].strip()))
    for recipe in RECIPES:
        name = recipe.relative_to(ROOT).as_posix()
        comments = [line.strip().lstrip("#").strip() for line in recipe.read_text().splitlines()
                    if line.strip().startswith("#")]
        out += [(name, m) for m in re.findall(r"`(fsdp-sync [^`]+)`", "\n".join(comments))]
        out += [(name, c.removeprefix("Run:").strip()) for c in comments
                if c.removeprefix("Run:").strip().startswith("fsdp-sync ")]
    return out


def _literal(command: str) -> bool:
    """A command shown as typed, not a pattern: no placeholder (PATH, N, <x>, $VAR, [--opt],
    a|b, ...), no GPU where this machine has none, no path that is the reader's own."""
    import shlex

    import torch

    if any(c in command for c in ("<", "$", "...", "|", "[", ">", "&&")):
        return False
    words = shlex.split(command)
    if any(re.fullmatch(r"[A-Z][A-Z_]*", w) or re.search(r"(^|/)[A-Z]+(/|$)", w) for w in words):
        return False
    if not torch.cuda.is_available() and ("cuda" in words or "gpu" in words):
        return False
    paths = {"--cluster", "--config-json", "--allowed-disk-dir", "--disk-dir"}
    return not any(a in paths and "/" in b and not (ROOT / b).exists() for a, b in zip(words, words[1:]))


def test_the_commands_the_pages_show_are_accepted(capsys):
    """Each command the README, docs/ and the shipped recipes' comments show, typed as shown,
    passes the CLI's checks (the ones made before anything starts): `fsdp-sync demo --tp 4 --ep 2`
    in docs/models.md was refused (--ranks 2, and tiny has no experts), `serve --quantization fp8`
    refused tiny's FP8 split, bucket_sweep.yaml's `--recipe recipes/memory_tuning/bucket_sweep.yaml`
    named no file (`--recipe bucket_sweep` is the shipped sweep). Patterns (PATH, N, $KEY, a|b) and GPU commands on a machine without one are left out;
    at least 40 commands are checked."""
    import shlex

    from fsdp_sync.cli import app as cli

    checked = []
    for page, command in _commands():
        if not _literal(command):
            continue
        capsys.readouterr()
        try:
            cli.parse_args(shlex.split(command)[1:])
        except SystemExit as exc:
            assert not exc.code, f"{page}: `{command}` is refused: {capsys.readouterr().err.strip()}"
        checked.append(command)
    assert len(checked) >= 40, checked


def test_the_plan_check_table_gives_the_plans_bounds_of_today():
    """docs/plan.md's plan/bench table and its data/plan-qwen2-160m.json hold the figures
    `plan_row` gives now for that job (on the saved cluster they were timed with): the per-rank
    disk row's engine worker kept 404 MiB, the staged rule, after the reference engine stopped
    staging per-rank files (848d864: max(bucket, largest tensor), 94 MiB)."""
    import json

    from fsdp_sync.plan import PlanJob, load_cluster, plan_row

    data = json.loads((ROOT / "docs/data/plan-qwen2-160m.json").read_text())
    cluster = load_cluster(str(ROOT / "docs/data/cluster-this-machine.json"))
    page = (ROOT / "docs/plan.md").read_text()
    section = page[page.index("## Checked against the bench"):page.index("## Beside published figures")]
    for r in data["rows"]:
        now = plan_row(PlanJob("qwen2-160m", r["method"], r["layout"], r["bucket_bytes"], r["dtype"], None,
                               r["ranks"], 2, r["tp"], engine="reference"), cluster)
        where = (r["method"], r["layout"])
        for k in ("bytes", "engine_rank_bytes_in", "memory_budget_bytes", "engine_memory_budget_bytes"):
            assert r[k] == now[k], (where, k, r[k], now[k])
        # ... | trainer peak / budget MiB | engine worker peak / budget MiB |
        cells = re.search(rf"^\| {r['method']} \| {r['layout']} \|(.*)$", section, re.M).group(1).split("|")
        trainer, engine = cells[-3].strip(), cells[-2].strip()
        assert trainer.split(" / ")[1].split()[0] == f"{now['memory_budget_bytes'] / 2**20:.0f}", (where, trainer)
        if r["method"] != "tensor":
            assert engine.split(" / ")[1] == f"{now['engine_memory_budget_bytes'] / 2**20:.0f}", (where, engine)


def test_the_package_docstring_lists_every_public_name():
    """`fsdp_sync`'s docstring is its API list: every name it exports is on it (SyncStats, exported
    as what `manager.stats` is, was not)."""
    import fsdp_sync

    listed = set(re.findall(r"\b\w+\b", fsdp_sync.__doc__.split("Public API", 1)[1]))
    missing = [n for n in fsdp_sync.__all__ if not n.startswith("__") and n not in listed]
    assert not missing, f"exported but not in fsdp_sync's docstring: {missing}"


def test_the_readme_headline_names_every_method_whose_budget_is_three_buckets():
    """README's first paragraph gives the memory rule; it said 3 × for the disk method only, while
    `plan.memory_budget` (the rule the bench and the plan hold syncs to) holds the distributed
    method's pipelined per-rank buckets to 3 × too (trainer rank 0 assembles every engine rank's
    buffer)."""
    from fsdp_sync.config import METHODS
    from fsdp_sync.plan import memory_budget

    three = {(m, lay, piped) for m in METHODS for lay in ("full", "engine") for piped in (True, False)
             if memory_budget(m, 4, 1, layout=lay, pipelined=piped)["memory_budget_bytes"] == 3 * 4 + 1}
    assert three == {("disk", "full", True), ("disk", "full", False), ("disk", "engine", True),
                     ("disk", "engine", False), ("distributed", "engine", True)}, three
    head = " ".join((ROOT / "README.md").read_text().split("```", 1)[0].split())
    clause = head.split("3 ×", 1)[1].split(";", 1)[0]
    for words in ("disk method", "distributed method's per-rank buckets, pipelined"):
        assert words in clause, (words, clause)


def test_the_bucket_sweep_table_is_its_json():
    """docs/benchmarks.md's bucket_sweep table gives the rows of data/bench-bucket-sweep-small.json
    (the recipe's run), each with the layout it ran: the recipe leaves ``layout`` at auto, so its
    flattened rows cut per-rank buckets (engine), which the table did not say (its 2026-11-22
    figures had no JSON beside them)."""
    import json

    rows = json.loads((ROOT / "docs/data/bench-bucket-sweep-small.json").read_text())["rows"]
    page = (ROOT / "docs/benchmarks.md").read_text()
    section = page[page.index("## Memory tuning: bucket size"):page.index("## Disk method at its floor")]
    table = re.findall(r"^\| (\w+) \((\w+)\) \| (–|[\d.]+ MiB) \| (on|off) \| ([\d.]+) \|[^|]+\| ([\d.]+) MiB \| (\d+) MiB \| (\d+) \|$",
                       section, re.M)
    assert len(table) == len(rows) == 14, (len(table), len(rows))
    for r, (strategy, layout, bucket, ms, secs, peak, budget, calls) in zip(rows, table):
        assert (strategy, layout, ms == "on") == (r["strategy"], r["layout"], r["multi_stage"]), (r["strategy"], strategy)
        assert bucket == "–" if strategy == "per_tensor" else float(bucket.split()[0]) == r["bucket_bytes"] / 2**20
        assert float(secs) == round(r["seconds"], 3) and float(peak) == round(r["peak_extra_bytes"] / 2**20, 1)
        assert int(budget) == r["memory_budget_bytes"] / 2**20 and int(calls) == r["engine_calls"]
        assert not r["over_budget"]
    assert {r["layout"] for r in rows if r["strategy"] == "flattened"} == {"engine"}


# dotted names in backquotes that are not fsdp_sync's code: other projects' names, config keys,
# loggers, engine parameters (checked by their own tests)
_NOT_OURS = {"torch", "sglang", "verl", "transformers", "peft", "os", "sys", "np", "numpy", "ray",
             "accelerate", "dist", "json", "manager", "stats", "engine", "self", "cfg", "model",
             "module", "args", "a", "config", "row", "rollout", "actor", "actor_rollout_ref",
             "trainer", "custom", "algorithm", "data", "SyncConfig", "FSDPShardingManager",
             "ReferenceEngine", "SGLangEngine", "lora", "experts"}
_LOGGERS = {"fsdp_sync.verl"}


def _resolves(name: str, modules: set[str]) -> bool:
    """``name`` is a module of fsdp_sync (by its full dotted path or a tail of it, as the pages
    write them: ``wire.per_rank_bucket_plan``), then attributes of it. A module that imports an
    optional dependency absent here (verl's adapter) counts by its file."""
    import importlib

    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        found = [m for m in modules if m == head or m.endswith("." + head)]
        for mod in found:
            try:
                obj = importlib.import_module(mod)
            except ImportError:
                return True
            rest = parts[k:]
            while rest and hasattr(obj, rest[0]):
                obj, rest = getattr(obj, rest[0]), rest[1:]
            if not rest:
                return True
        if found:
            return False
    return True          # names no module of ours: not a claim about our code


def test_the_dotted_names_the_pages_give_exist():
    """Every `module.function` a page names resolves in the code: docs/methods.md named
    `transport.group.per_rank_bucket_plan` after the function had moved to `wire`."""
    modules = set()
    for path in (ROOT / "fsdp_sync").rglob("*.py"):
        m = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules.add(m[: -len(".__init__")] if m.endswith(".__init__") else m)
    bad = []
    for page in PAGES:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for name in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", line):
                if (name.split(".")[0] in _NOT_OURS or name in _LOGGERS
                        or name.endswith((".py", ".md", ".json", ".yaml", ".sh", ".safetensors"))):
                    continue
                if not _resolves(name, modules):
                    bad.append(f"{page.relative_to(ROOT)}:{i}: {name}")
    assert not bad, bad
