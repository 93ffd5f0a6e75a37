"""The table ``fsdp-sync bench`` prints: one line per measured row, each figure beside its floor,
baseline and memory budget.

What every row of the sweep shares (the model, its size, ranks, TP, bucket size, multi-stage,
...) goes to the caption under the table, so the columns left are what tells the rows apart and
fit a terminal. Every row's strategy (``disk:checkpoint (engine, fp8)``) is printed whole at any
width. Sizes are in the unit that shows them (a tiny model's kilobytes are not ``0`` MiB). And the
progress bar rank 0 shows while a job's rows are measured (`BenchProgress`).

Not here: measuring the rows (`main`, `methods`), the targets (`targets`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..plan import size
from .targets import row_floor

__all__ = ["bench_table", "row_label", "COLUMNS", "BenchProgress", "targets_lines"]

MiB = 2**20


def row_label(r: dict) -> str:
    """``strategy (layout, fp8)``: what tells one row of a sweep from another of the same model."""
    tags = [t for t in (r.get("layout"), r.get("quantization")) if t]
    return r["strategy"] + (f" ({', '.join(tags)})" if tags else "")


def _budget(r: dict) -> str:
    return size(r["memory_budget_bytes"]) + (
        f" / {size(r['engine_memory_budget_bytes'])}" if "engine_memory_budget_bytes" in r else "")


# (header, cell, shared: printed in the caption when every row has the same value)
COLUMNS: list[tuple[str, Callable[[dict], str], bool]] = [
    ("strategy", row_label, False),
    ("model", lambda r: str(r["model"]), True),
    ("params", lambda r: f"{r['params'] / 1e6:.1f}M", True),
    ("tensors", lambda r: str(r["tensors"]), True),
    ("bytes", lambda r: size(r["bytes"]), True),
    ("bucket MiB", lambda r: f"{r['bucket_bytes'] / MiB:g}", True),
    ("ranks", lambda r: str(r["ranks"]), True),
    ("tp", lambda r: str(r["tp"]) + (f" ep{r['ep']}" if r.get("ep", 1) > 1 else ""), True),
    ("multi-stage", lambda r: "on" if r["multi_stage"] else "off", True),
    ("shared host memory", lambda r: "yes" if r.get("share_host_memory") else "no", True),
    # per-rank buckets: the next bucket's exchange beside this one's engine call (SyncConfig.pipelined)
    ("pipelined", lambda r: "yes" if r.get("pipelined") else "no", True),
    ("seconds", lambda r: f"{r['seconds']:.3f}", False),
    # each row's own floor (`targets.row_floor`): a host-shared row's has no all-gather
    ("floor s", lambda r: f"{row_floor(r)[0]:.3f}" + (" (shared)" if row_floor(r)[1] == "floor_shared_seconds"
                                                       else ""), False),
    ("× floor", lambda r: f"{r['seconds'] / row_floor(r)[0]:.2f}", False),
    ("× copy", lambda r: f"{r['ratio_to_copy']:.2f}" if r.get("ratio_to_copy") else "-", False),
    ("baseline s", lambda r: f"{r['baseline_seconds']:.3f}" if r["baseline_seconds"] else "-", False),
    ("speedup", lambda r: f"{r['speedup_vs_baseline']:.1f}×" if r["speedup_vs_baseline"] else "-", False),
    ("peak extra", lambda r: size(r["peak_extra_bytes"]) + (" [red]OVER[/]" if r.get("over_budget") else ""),
     False),
    ("budget (engine)", _budget, False),
]


def bench_table(rows: list[dict]) -> Any:
    """The rich table of the measured rows (``skipped`` rows are left out: the command names
    them); the columns every row agrees on move to its caption. Nothing is cut: a column too
    narrow for the terminal folds its text onto the next line."""
    from rich.table import Table

    rows = [r for r in rows if not r.get("skipped")]
    cells = [[cell(r) for _, cell, _ in COLUMNS] for r in rows]
    shared = {i for i, (_, _, movable) in enumerate(COLUMNS)
              if movable and rows and len({c[i] for c in cells}) == 1}
    caption = ", ".join(f"{COLUMNS[i][0]} {cells[0][i]}" for i in sorted(shared))
    table = Table(title="weight sync: median seconds beside floor and per_tensor baseline",
                  caption=f"every row: {caption}" if caption else None)
    for i, (header, _, _) in enumerate(COLUMNS):
        if i in shared:
            continue
        if header in ("strategy", "model"):
            table.add_column(header, no_wrap=True)        # never cut: they name the row
        else:
            table.add_column(header, justify="right", overflow="fold")
    for c in cells:
        table.add_row(*(v for i, v in enumerate(c) if i not in shared))
    return table


def targets_lines(t: dict) -> list[str]:
    """What ``--preset targets`` prints under the table: each target's figure and whether it is
    met (`targets.judge_targets`), or why the sweep's rows are not judged."""
    if not t.get("judged", True):
        return [f"targets: not judged: {t['why']}"]
    out = []
    if isinstance(t.get("met"), dict):
        out.append(f"targets: {_speedup(t['speedup_vs_per_tensor'], t['met']['speedup'], 'speedup {:.2f}×')}, "
                   f"{t['ratio_to_floor']:.2f}× its floor ({t['floor_judged_against']}; ≤1.3: {t['met']['floor']}), "
                   f"peak extra {t['peak_extra_over_budget']:.2f}× budget (≤1: {t['met']['memory']})")
    elif "why" in t:
        out.append(f"targets: not met: {t['why']}")
    for name, v in (t.get("layout") or {}).items():
        out.append(f"layout {name}: " + ", ".join(f"{k} {x:.2f}" if isinstance(x, float) else f"{k} {x}"
                                                   for k, x in v.items()))
    d = t.get("distributed")
    if d:
        speed = _speedup(d['speedup_vs_per_tensor'], d['met']['speedup'], '{:.2f}× its per-tensor format')
        out.append(f"distributed: {speed}"
                   f", {d['ratio_to_floor']:.2f}× its floor (≤1.3: "
                   f"{d['met']['floor']}), peak extra {d['peak_extra_over_budget']:.2f}× its budget "
                   f"({d['peak_extra_over_budget_of']}; ≤1: {d['met']['memory']})")
    return out


def _speedup(x: float | None, met: bool, known: str) -> str:
    """``known`` with the speedup ``x`` and its verdict (``speedup 4.10× (≥3: True)``); where no
    per_tensor baseline row ran (``x`` None) the speedup is not known: ``speedup n/a`` and why
    (it read ``0.00×``, a figure never measured)."""
    if x is None:
        return "speedup n/a (no per_tensor baseline row ran)"
    return f"{known.format(x)} (≥3: {met})"


class BenchProgress:
    """A rich progress bar on rank 0 (stderr); silent elsewhere."""

    def __init__(self, on: bool, total: int, job: Any) -> None:
        self.bar = None
        if not on:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        ep = f" ep{job.ep}" if job.ep > 1 else ""
        self.bar = Progress(TextColumn(f"[bold]bench[/] {job.model} r{job.ranks} tp{job.tp}{ep} "
                                       f"ms={'on' if job.multi_stage else 'off'}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            transient=True)
        self.bar.start()
        self.task = self.bar.add_task("", total=total)

    def update(self, text: str) -> None:
        if self.bar:
            self.bar.update(self.task, description=text)

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def stop(self) -> None:
        if self.bar:
            self.bar.stop()
