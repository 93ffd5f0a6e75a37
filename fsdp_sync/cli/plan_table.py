"""`fsdp-sync plan`'s printing: the table of its rows (`plan_table`, a LoRA adapter's syncs in a
column of their own where rows carry them), the refusals under it, the cluster in one line, and
bytes in the unit that shows them (`size`, the bench's tables' too).

Not here: the rows (`fsdp_sync.plan`, `fsdp_sync.plan_lora`), the command (`fsdp_sync.cli.plan`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["size", "refusals", "plan_table", "cluster_line"]

MiB = 2**20


def size(n: float) -> str:
    """Bytes in the unit that shows them: 3 figures in GiB, MiB or KiB (a tiny model's kilobytes
    are not 0.00 GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.{0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2}f} {unit}"
    return f"{int(n)} B"


def refusals(rows: list[dict]) -> list[str]:
    """The reasons of the refused rows, each once, in the order of the rows."""
    return list(dict.fromkeys(r["refused"] for r in rows if r.get("refused")))


def plan_table(rows: list[dict]) -> Any:
    """The rich table of `plan_rows`'s rows: a refused row names its reason, `refusals`, which
    follow the table."""
    from rich.table import Table

    reasons = refusals(rows)
    table = Table(title="weight sync plan: bytes exact, memory a bound, seconds an estimate")
    cols = ("method", "layout", "model", "sent", "ranks", "tp", "bucket MiB", "buckets", "calls",
            "engine rank in", "trainer rank in", "budget trainer / engine", "free trainer / engine",
            "est. s", "slowest phase")
    lora = any(r.get("lora_r") for r in rows)
    if lora:      # --lora-r: an adapter-only sync beside each base sync
        cols += ("adapter sync: sent, calls, est. s",)
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        name = Path(str(r["model"])).stem if "/" in str(r["model"]) else str(r["model"])
        tp = str(r["tp"]) + (f" ep{r['ep']}" if r["ep"] > 1 else "")
        if r.get("refused"):
            table.add_row(r["method"], r["layout"], name, "-", str(r["ranks"]), tp,
                          f"{r['bucket_bytes'] / MiB:g}", "-", "-", "-", "-", "-", "-", "[red]refused[/]",
                          f"why: ({reasons.index(r['refused']) + 1}) below", *(("-",) if lora else ()))
            continue
        slow = max(r["phases"], key=lambda p: p["seconds"])
        table.add_row(r["method"], r["layout"], name, size(r["bytes"]), str(r["ranks"]), tp,
                      f"{r['bucket_bytes'] / MiB:g}", str(r["buckets"]), str(r["engine_calls"]),
                      size(r["engine_rank_bytes_in"]), size(r.get("trainer_rank_bytes_in") or 0),
                      f"{size(r['memory_budget_bytes'])} / {size(r['engine_memory_budget_bytes'])}",
                      f"{size(r['trainer_memory_free_bytes'])} / {size(r['engine_memory_free_bytes'])}",
                      f"{r['seconds']:.3f}", f"{slow['what']} ({slow['link']})",
                      *((f"{size(r['adapter_bytes'])} ({100 * r['adapter_bytes_ratio']:.1f} %), "
                         f"{r['adapter_engine_calls']}, {r['adapter_seconds']:.4f}",) if lora else ()))
    return table


def cluster_line(c: Any) -> str:
    """The cluster a plan ran on, in one line: a CPU host as one host (its cores, its RAM; its
    ``gpus_per_node`` is no limit there, `cluster_of`), GPU nodes by GPUs and memory; then links
    and costs. A preset (`plan.CLUSTERS`, or a file holding one's figures) says so: its figures
    are nominal spec-sheet ones, not measured."""
    from ..plan import CLUSTERS

    preset = "; a preset: nominal spec-sheet figures, not measured" if CLUSTERS.get(c.name) == c else ""
    where = ("one host, " + (f"{c.cores} cores, " if c.cores else "") + f"{c.memory_per_gpu / 2**30:.0f} GiB RAM"
             if c.device == "cpu" else f"{c.gpus_per_node} GPUs/node, {c.memory_per_gpu / 2**30:.0f} GiB each")
    return (f"{c.name}: {where}; d2d {c.d2d_gbps:.1f}, intra {c.intra_gbps:.1f}, inter {c.inter_gbps:.1f}, "
            f"disk w/r {c.disk_write_gbps:.2f}/{c.disk_read_gbps:.2f} GB/s; call {c.call_s * 1e3:.2f} ms, "
            f"collective {c.collective_s * 1e6:.0f} us"
            + ("; " + (f"{c.cores} cores, " if c.device != "cpu" else "") + f"first touch "
               f"{c.touch_gbps:.1f}, map {c.map_gbps:.1f}, trainer collectives {c.collective_gbps:.2f} GB/s"
               if c.cores else "") + preset)
