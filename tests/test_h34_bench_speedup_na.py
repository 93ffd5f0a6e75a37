"""``fsdp-sync bench --preset targets`` where no per_tensor baseline row ran (``--strategies
flattened``): the speedup is not known, and the lines under the table say so; they printed
``targets: speedup 0.00× (≥3: False)`` and ``distributed: 0.00× its per-tensor format``, a figure
never measured. Pure: the rows are written here."""

from __future__ import annotations

from fsdp_sync.cli.bench.table import targets_lines
from fsdp_sync.cli.bench.targets import check_targets

MiB = 2**20


def _row(**kw) -> dict:
    row = {"method": "tensor", "strategy": "flattened", "layout": "full", "seconds": 0.004,
           "floor_seconds": 0.0035, "floor_shared_seconds": 0.001, "baseline_seconds": None,
           "peak_extra_bytes": 600_000, "memory_budget_bytes": 2_228_224, "bucket_bytes": MiB,
           "share_host_memory": False}
    row.update(kw)
    return row


def test_no_per_tensor_row_prints_no_speedup_figure():
    rows = [_row(), _row(method="distributed", strategy="distributed:flattened_bucket", seconds=0.005,
                         floor_seconds=0.004)]
    lines = targets_lines({"judged": True, **check_targets(rows)})
    text = "\n".join(lines)
    assert "0.00" not in text, text
    assert lines[0].startswith("targets: speedup n/a (no per_tensor baseline row ran), 1.14× its floor"), text
    dist = next(x for x in lines if x.startswith("distributed:"))
    assert dist.startswith("distributed: speedup n/a (no per_tensor baseline row ran), 1.25× its floor"), dist
    # with the baseline measured the figures and verdicts are printed as before
    rows = [_row(baseline_seconds=0.016), _row(method="distributed", strategy="distributed:flattened_bucket",
                                              seconds=0.005, floor_seconds=0.004, baseline_seconds=0.01)]
    lines = targets_lines({"judged": True, **check_targets(rows)})
    assert lines[0].startswith("targets: speedup 4.00× (≥3: True), 1.14× its floor"), lines
    assert next(x for x in lines if x.startswith("distributed:")).startswith(
        "distributed: 2.00× its per-tensor format (≥3: False), 1.25× its floor"), lines
