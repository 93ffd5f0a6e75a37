"""`bench.methods.flag_over_budget` (H65's mutation pass; both mutants survived the CPU tier, the
CUDA rows' check being in test_gpu, which needs a GPU): a CUDA row is judged by its GPU's
allocator rise (``gpu_memory.within_budget``), not by the host's RSS, either way; a peak exactly
at its budget is within it ("over its budget": above)."""

from __future__ import annotations

from fsdp_sync.cli.bench.methods import flag_over_budget, over_budget_line

MiB = 2**20


def _row(**kw) -> dict:
    return {"strategy": "flattened", "method": "tensor", "peak_extra_bytes": 10 * MiB,
            "memory_budget_bytes": 10 * MiB, "memory_budget_rule": "2 x max(bucket, largest tensor) + largest tensor",
            **kw}


def test_a_peak_at_its_budget_is_within_it():
    at, above = flag_over_budget([_row(), _row(peak_extra_bytes=10 * MiB + 1)])
    assert at["over_budget"] is False and above["over_budget"] is True


def test_a_cuda_row_is_judged_by_its_gpus_rise_not_the_hosts_rss():
    gpu_over = {"within_budget": False, "device_peak_allocated_mib": 12.5, "trainer_peak_allocated_mib": 8.0}
    gpu_ok = dict(gpu_over, within_budget=True)
    over, ok = flag_over_budget([_row(peak_extra_bytes=0, gpu_memory=gpu_over),
                                 _row(peak_extra_bytes=99 * MiB, gpu_memory=gpu_ok)])
    assert over["over_budget"] is True and ok["over_budget"] is False
    assert over_budget_line(over) == ("flattened: GPU 12.5 MiB (trainer 8.0 + its GPU's engine worker) > 10.0 MiB "
                                      "= 2 x max(bucket, largest tensor) + largest tensor")
