"""`fsdp-sync demo --method distributed|disk` end to end, as a user runs it (issue 10's "Done when").

Each run is the real command in a process of its own (tiny model, 2 ranks, a TP-2 engine, 2 steps):
exit code 0, and in its JSON every step's engine logits and greedy tokens match the trainer's and
changed since the step before. The disk run gets no ``--disk-dir``: its temp directory (under the
TMPDIR we give it) must be gone afterwards. Both run on a default group without a CPU backend
(``--backend cuda:gloo``, `test_nccl_only_group`'s emulation of ``init_process_group("nccl")``),
the disk run with FSDP1: one run each covers the plain CLI path and issue 35's NCCL-only group.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from _util import run_output


def _demo(tmp_path, method: str, *extra: str) -> dict:
    out = tmp_path / f"demo-{method}.json"
    tmp = tmp_path / f"tmp-{method}"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = run_output(
        [sys.executable, "-m", "fsdp_sync.cli", "demo", "--method", method, "--steps", "2",
         "--no-progress", "--json", str(out), *extra],
        timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["method"] == method and result["ok"]
    assert result["config"]["backend"] == "cuda:gloo"
    assert [s["step"] for s in result["steps"]] == [0, 1]
    for s in result["steps"]:
        assert s["tokens_exact"] and s["tokens_match"], s
        assert s["max_abs_logit_diff"] <= s["atol"] and s["changed_since_last_step"], s
        assert s["bytes"] > 0 and s["engine_calls"] >= 1
    # every file the run made in TMPDIR is gone (the disk versions included)
    assert not [p for p in tmp.iterdir() if p.name.startswith("fsdp-sync")], list(tmp.iterdir())
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method,extra", [
    ("distributed", ()),                 # the update group beside the user's group
    ("disk", ("--fsdp", "1")),           # FSDP1, the checkpoint written per rank
], ids=["distributed", "disk-fsdp1"])
def test_demo_method_end_to_end(tmp_path, method, extra):
    _demo(tmp_path, method, "--backend", "cuda:gloo", *extra)


def test_demo_disk_dir_flag():
    from fsdp_sync.cli.app import _demo_options, build_parser

    args = build_parser().parse_args(["demo", "--method", "disk", "--disk-dir", "/x/y"])
    opts = _demo_options(args)
    assert (opts.method, opts.disk_dir) == ("disk", "/x/y")
