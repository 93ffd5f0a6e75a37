"""The bench's over-budget line names the process that is over and holds it to its own budget.

A disaggregated CPU row (distributed, disk) measures each process (``peak_extra_by_process``) and
`methods.flag_over_budget` holds a trainer rank to the trainer's rule and an engine worker to the
engine's (`targets.process_ratios`). The line printed under the table compared the row's
``peak_extra_bytes`` (the largest peak of any process) with the trainer's budget instead, so a row
over budget only through an engine worker printed '3.3 MiB > 4.0 MiB' (plan3 audit, bench of
tiny-fp8-moe): true neither of the number nor of the process. The two rows below are those of that
audit (tiny-fp8-moe FP8 and small, distributed:per_tensor, 2 trainer ranks, TP 2, CPU).
"""

from __future__ import annotations

import re

from fsdp_sync.cli.bench.methods import flag_over_budget, over_budget_line

ENGINE_RULE = "max(bucket, largest tensor) + its shard (staged until the commit)"


def _row(peaks: dict, budget: int, engine_budget: int, rule: str) -> dict:
    return {"strategy": "distributed:per_tensor", "peak_extra_bytes": max(peaks.values()),
            "memory_budget_bytes": budget, "memory_budget_rule": rule,
            "engine_memory_budget_bytes": engine_budget, "engine_memory_budget_rule": ENGINE_RULE,
            "peak_extra_by_process": dict(peaks), "gpu_memory": None}


def _inequality_holds(line: str) -> None:
    m = re.search(r"([\d.]+) MiB > its budget ([\d.]+) MiB", line)
    assert m, line
    assert float(m.group(1)) > float(m.group(2)), line


def test_only_an_engine_worker_over_names_it_against_its_own_budget():
    fp8moe = _row({"trainer rank 0": 3424256, "trainer rank 1": 544768, "engine worker 0": 2334720,
                   "engine worker 1": 2162688}, 4198592, 2299632,
                  "2 x max(bucket, largest tensor) + largest tensor + 2 quantized buckets + the quantizer's scratch")
    [r] = flag_over_budget([fp8moe])
    assert r["over_budget"]                  # the engine worker 0 is over its 2.19 MiB, the trainers within
    line = over_budget_line(r)
    assert line == f"distributed:per_tensor: engine worker 0 2.23 MiB > its budget 2.19 MiB = {ENGINE_RULE}", line
    assert "3.3" not in line and "4.0" not in line, line       # the trainer's peak and budget are not compared
    _inequality_holds(line)


def test_the_worst_engine_worker_is_named_not_the_largest_peak_against_the_trainers_budget():
    small = _row({"trainer rank 0": 8531968, "trainer rank 1": 1466368, "engine worker 0": 13221888,
                  "engine worker 1": 13561856}, 12582912, 13116928, "2 x max(bucket, largest tensor) + largest tensor")
    line = over_budget_line(flag_over_budget([small])[0])
    assert line.startswith("distributed:per_tensor: engine worker 1 12.9 MiB > its budget 12.5 MiB = max(bucket"), line
    _inequality_holds(line)


def test_a_trainer_rank_over_is_held_to_the_trainers_rule():
    row = _row({"trainer rank 0": 5 << 20, "trainer rank 1": 1 << 20, "engine worker 0": 1 << 20},
               4 << 20, 3 << 20, "2 x max(bucket, largest tensor) + largest tensor")
    line = over_budget_line(flag_over_budget([row])[0])
    assert line == ("distributed:per_tensor: trainer rank 0 5.0 MiB > its budget 4.0 MiB = "
                    "2 x max(bucket, largest tensor) + largest tensor"), line


def test_a_row_without_per_process_peaks_compares_its_device_peak():
    row = {"strategy": "flattened", "peak_extra_bytes": 5 << 20, "memory_budget_bytes": 4 << 20,
           "memory_budget_rule": "2 x max(bucket, largest tensor) + largest tensor"}
    line = over_budget_line(flag_over_budget([row])[0])
    assert line == "flattened: 5.0 MiB > 4.0 MiB = 2 x max(bucket, largest tensor) + largest tensor", line
