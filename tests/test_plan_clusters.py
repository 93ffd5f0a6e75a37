"""The GPU presets hold the memory a card reports (torch's ``total_memory``, what SGLang's
--mem-fraction-static is a fraction of), not the spec sheet's "80 GB" / "141 GB" read as 10**9
bytes: h100-node was 74.5 GiB per GPU against the 79.2 GiB an H100 80GB HBM3 reports, and
plan_moe_h100 refused a 4 GiB bucket of full tensors that fits."""

from __future__ import annotations

from fsdp_sync.plan import CLUSTERS, GiB, PlanJob, plan_row


def test_the_gpu_presets_hold_the_memory_torch_reports():
    assert 79 * GiB <= CLUSTERS["h100-node"].memory_per_gpu <= 80 * GiB
    # the H200 this project measured (docs/data/issue35-h200/run1/this_machine.json)
    assert CLUSTERS["h200-node"].memory_per_gpu == 150_109_880_320      # 139.8 GiB
    for c in CLUSTERS.values():
        assert "total_memory" in c.source


def test_a_bucket_that_fits_an_h100_is_not_refused():
    """plan_moe_h100's tensor/full 4096 MiB row: 2 x 4 GiB + 594 MiB = 8.6 GiB beside the trainer's
    14.2 GiB fp32 shard at gpu_memory_utilization 0.7: 9.5 GiB left of 79.2 GiB (8.1 GiB of 74.5)."""
    row = plan_row(PlanJob("qwen3-30b-a3b", "tensor", "full", 4096 * 2**20, "bfloat16", ranks=8, tp=8,
                           gpu_memory_utilization=0.7), "h100-node")
    assert row["memory_budget_bytes"] <= row["memory_free_bytes"]
    assert 9.5 * GiB < row["memory_free_bytes"] < 9.6 * GiB


def test_the_cli_and_the_docs_agree_on_how_long_this_machine_takes(capsys):
    """--cluster this-machine times copies and then real syncs: tens of seconds (54 s measured on a
    loaded 2-core host), which docs/plan.md said while `plan --help` and cli/plan.py said a few."""
    import pytest

    from fsdp_sync.cli import app as cli
    from fsdp_sync.cli import plan as cli_plan

    from _util import ROOT

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for where in (text, cli_plan.__doc__, (ROOT / "docs/plan.md").read_text()):
        said = " ".join(where.split())
        assert "tens of seconds" in said and "a few seconds" not in said, said[:300]
