"""`fsdp-sync plan`'s cluster line says when its figures are a preset's (audit H19): the h100-node
and h200-node figures are nominal spec-sheet ones, never measured, and a plan printed on them
said so only in ``--help`` and the JSON's ``source``; the printed line read like a measurement."""

from __future__ import annotations

import dataclasses

from fsdp_sync.cli.plan import cluster_line
from fsdp_sync.plan import CLUSTERS


def test_a_presets_line_says_it_is_a_preset_and_a_changed_one_does_not():
    for name, c in CLUSTERS.items():
        line = cluster_line(c)
        assert line.startswith(f"{name}: ") and line.endswith("; a preset: nominal spec-sheet figures, not measured"), line
        # the same name with other figures (a file edited from a preset, a measured GPU host): not a preset
        other = dataclasses.replace(c, d2d_gbps=c.d2d_gbps / 2)
        assert "preset" not in cluster_line(other), name


def test_plan_help_states_each_budget_rule_the_rows_use(capsys):
    """``fsdp-sync plan --help`` states the budget rules as `plan.memory_budget` applies them: the
    distributed per-rank 3 x only when pipelined, the tensor method's buffers that take turns,
    FP8's quantized buckets and scratch, an FSDP1 state dict, a CPU cluster's RAM. Before, it said
    "distributed per-rank buckets 3 x" whatever --pipelined and named none of the others."""
    import pytest

    from fsdp_sync.cli import app as cli

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("pipelined distributed per-rank buckets 3 x", "take turns", "FP8's quantized buckets",
                  "quantizer's scratch", "FSDP1 full or sharded state dict", "memory_budget_rule",
                  "the host's RAM"):
        assert words in text, words


def test_a_cluster_file_is_read_as_documented(tmp_path):
    """`load_cluster`: a plan's JSON (``fsdp-sync plan --json``: its ``cluster`` holds the fields)
    loads as its cluster; JSON's ``80e9`` for an integer field is the integer, ``8.5`` GPUs is
    refused naming the field and the value; a negative ``collective_s`` (as a negative ``call_s``)
    is refused naming it. Killed: the plan JSON's ``cluster`` not unwrapped (refused as unknown
    fields), the whole-number check dropped (8.5 GPUs per node planned), collective_s unchecked."""
    import json

    import pytest

    from fsdp_sync.plan import load_cluster

    good = CLUSTERS["h100-node"].to_dict()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"cluster": good, "rows": []}))
    assert load_cluster(str(plan)) == CLUSTERS["h100-node"]
    c = load_cluster({**good, "memory_per_gpu": 80e9})
    assert c.memory_per_gpu == 80 * 10**9 and isinstance(c.memory_per_gpu, int)
    with pytest.raises(ValueError, match=r"gpus_per_node must be a whole number, got 8\.5"):
        load_cluster({**good, "gpus_per_node": 8.5})
    for f in ("call_s", "collective_s"):
        with pytest.raises(ValueError, match=r"call_s and collective_s must be >= 0.*-1\.0"):
            load_cluster({**good, f: -1.0})

