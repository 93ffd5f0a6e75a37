"""`fsdp-sync demo --method distributed|disk` end to end, as a user runs it (issue 10's "Done when").

Each run is the real command in a process of its own (tiny model, 2 ranks, a TP-2 engine, 2 steps):
exit code 0, and in its JSON every step's engine logits and greedy tokens match the trainer's and
changed since the step before. The disk run gets no ``--disk-dir``: its temp directory (under the
TMPDIR we give it) must be gone afterwards. Both run on a default group without a CPU backend
(``--backend cuda:gloo``, `test_nccl_only_group`'s emulation of ``init_process_group("nccl")``),
the disk run with FSDP1: one run each covers the plain CLI path and issue 35's NCCL-only group.
"""

from __future__ import annotations

import re

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from _util import run_output


def _demo(tmp_path, method: str, *extra: str) -> dict:
    out = tmp_path / f"demo-{method}.json"
    # a TMPDIR of its own, short (in the test process's own): under pytest's tmp_path it would be
    # too long for a forkserver's socket, and the ranks would start as fresh interpreters, each
    # importing torch and transformers (test_nccl_only_group's demo runs that way on purpose)
    tmp = Path(tempfile.mkdtemp(prefix=f"demo-{method}-"))
    try:
        proc = run_output(
            [sys.executable, "-m", "fsdp_sync.cli", "demo", "--method", method, "--steps", "2",
             "--no-progress", "--json", str(out), *extra],
            timeout=200, env=dict(os.environ, TMPDIR=str(tmp)))
        # every file the run made in TMPDIR is gone (the disk versions included)
        left = [p.name for p in tmp.iterdir() if p.name.startswith("fsdp-sync")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not left, left
    result = json.loads(out.read_text())
    assert result["config"]["method"] == method and result["ok"]
    assert result["config"]["backend"] == "cuda:gloo"
    assert [s["step"] for s in result["steps"]] == [0, 1]
    for s in result["steps"]:
        assert s["tokens_exact"] and s["tokens_match"], s
        assert s["max_abs_logit_diff"] <= s["atol"] and s["changed_since_last_step"], s
        assert s["bytes"] > 0 and s["engine_calls"] >= 1
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


class _Stop(Exception):
    """Ends a rank's demo once the engine (or, on a rank without one, the manager) is made."""


def _engine_gpus(rank: int, world: int, method: str, tp: int):
    """Run `demo_rank` with ``--device cuda`` on a CPU machine up to the engine it makes: the
    mesh built on gloo, the trainer left unwrapped, and `ReferenceEngine` a recorder."""
    import fsdp_sync.engines as engines
    import fsdp_sync.manager as manager
    import fsdp_sync.topology as topology
    from fsdp_sync.cli import demo, trainer

    made = []
    real_mesh = topology.make_mesh

    def record(**kwargs):
        made.append(kwargs)
        raise _Stop

    def stop(*args, **kwargs):
        raise _Stop

    topology.make_mesh = lambda dp, infer_tp, device_type="cpu": real_mesh(dp, infer_tp, "cpu")
    trainer.wrap_fsdp = lambda model, fsdp, device: model
    engines.ReferenceEngine = record
    manager.FSDPShardingManager = stop
    opts = demo.DemoOptions(ranks=world, tp=tp, steps=1, device="cuda", method=method, progress=False)
    try:
        demo.demo_rank(rank, world, opts)
    except _Stop:
        pass
    return {k: made[0][k] for k in ("base_gpu_id", "tp_size", "device")} if made else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method, world, tp, want", [
    # colocated: one engine per TP group, on that group's GPUs (trainer rank r is on cuda:r)
    ("tensor", 4, 2, {0: 0, 2: 2}),
    ("tensor", 2, 1, {0: 0, 1: 1}),
    # disaggregated: one engine, on the GPUs after the trainer ranks'
    ("distributed", 2, 2, {0: 2}),
])
def test_demo_puts_each_engine_on_its_own_gpus(method, world, tp, want):
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    got = run_ranks(_engine_gpus, world, method, tp, timeout_s=100, env=spawn_env())
    engines = {r: g for r, g in enumerate(got) if g is not None}
    assert {r: g["base_gpu_id"] for r, g in engines.items()} == want, engines
    assert all(g["tp_size"] == tp and g["device"] == "cuda" for g in engines.values()), engines


@pytest.mark.timeout(120)
def test_a_demo_past_its_deadline_is_one_line_and_its_deadline_scales_with_the_work(capsys):
    """The demo's deadline was a hidden 600 s whatever --steps or the model: a run that reached it
    printed a RankError traceback. Now --timeout-s sets it (by default it grows with the steps and
    the parameters), and a run past it, or a rank that fails, is one line and exit code 1."""
    from _util import cli_here

    res = cli_here(capsys, "demo", "--steps", "1", "--no-progress", "--timeout-s", "0.5")
    err = res.stderr.strip()
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("fsdp-sync demo: error: ranks "), err
    # the ranks are stopped at the deadline; one may finish a step in the seconds a stop takes
    assert re.search(r"deadline of demo_rank \(--timeout-s 0\.5; (no step finished|1 of 1 steps finished, "
                     r"shown above): give it more\)", err), err
    from fsdp_sync.cli.demo import DemoOptions, default_timeout_s

    three, many = default_timeout_s(DemoOptions(steps=3)), default_timeout_s(DemoOptions(steps=30))
    assert three == pytest.approx(600 + 0.013984 + 3 * (60 + 0.013984)) and many > three + 1500
    assert default_timeout_s(DemoOptions(steps=3, model="qwen2-1500m")) > three + 500


@pytest.mark.timeout(120)
def test_a_demo_stopped_by_a_failure_keeps_the_steps_every_rank_finished(capsys, monkeypatch, tmp_path):
    """The ranks returned their records only at the end, so a run stopped at its deadline or by a
    failed rank lost every finished step. Now each step's record is kept as it ends: the second
    sync made to fail (``FSDP_SYNC_FAULT_AFTER=1``) leaves step 0 in the table and the JSON
    (``ok`` false, ``incomplete`` the error), and the one-line error says how many finished."""
    import json

    from _util import cli_here

    monkeypatch.setenv("FSDP_SYNC_FAULT", "trainer:0:sync_weights:raise")
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "1")
    out = tmp_path / "demo.json"
    res = cli_here(capsys, "demo", "--steps", "3", "--no-progress", "--json", str(out))
    err = res.stderr.strip()
    assert res.returncode == 1 and len(err.splitlines()) == 1, res.stderr[-3000:]
    assert "injected fault: trainer 0 at sync_weights (1 of 3 steps finished, shown above)" in err, err
    assert "weight sync per training step" in res.stdout
    got = json.loads(out.read_text())
    assert got["ok"] is False and "rank" in got["incomplete"] and [s["step"] for s in got["steps"]] == [0]
    assert got["steps"][0]["tokens_match"] and got["steps"][0]["bytes"] > 0
