"""``fsdp-sync soak --syncs N``: N weight syncs per method, after ``--warmup`` more, with a training
step before each, and the resources of every process sampled throughout, to show that nothing grows.

One `run_ranks` job (2 trainer ranks on gloo, FSDP2, a 2-worker `ReferenceEngine` held by trainer
rank 0, the tiny model on CPU) runs the methods one after the other, one `FSDPShardingManager`
each. Trainer rank 0 samples with psutil, every ``--every`` syncs, the RSS, open fds and threads of
every process (both trainer ranks and both engine workers) and the ``/dev/shm`` segments those
processes own, and the ``pymp-*`` / ``torch-shm-dir-*`` directories left in the job's own temp
directory (its ``TMPDIR``, made for the run: another program's, in the machine's temp directory,
are not the job's). The report: per method and process, the value after the warm-up (``--warmup``
syncs, run before the N measured ones) and at the end, the growth over the N syncs and scaled to
1000 syncs, and the growth over each half of them alone; a PNG of the series; JSON.
The warm-up defaults to 300 syncs (fewer for small N): a fresh trainer process's RSS settles over
its first few hundred syncs (3000 tensor syncs: +0.41 MiB from sync 301 to 751, +0.11 to 1501,
+0.15 more to 3000): a curve that flattens, where a leak grows at the same rate for ever (what
settles was not isolated; see docs/reliability.md "Soak").
Target: RSS growth <= 1 MiB per process per 1000 syncs after the warm-up, no growth in fds,
threads or segments. A run of fewer than 1000 syncs cannot judge a rate per 1000; it fails a process
whose RSS grew past the 1 MiB budget within the run (unscaled) at a steady rate: over the second
half of the measured syncs at least 4/5 as fast as over the first (`STEADY`; under 40 syncs,
`SHORT_MIN_SYNCS`, not at all). A leak grows at the
same rate for ever; memory still settling after a short warm-up slows down (0.2-0.6 in leak-free
runs of 40-100 syncs), and a slower leak than 1 MiB within the run needs the 1000 syncs.

Not here: GPU memory (see the bench), SGLang servers.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["run_soak", "add_soak_parser", "cmd_soak", "summarise", "rss_failure"]

from ..memory import temp_dirs
from ..topology import cpu_group

METHODS = ("tensor", "distributed", "disk")
CONTROL = "train"
"""``--methods train``: the control, training steps with no sync at all (each followed by the
`memory.empty_cache` the manager runs on exit), to tell the trainer's own growth from the sync's."""


def _shm_of(pids) -> int:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return 0
    return sum(1 for n in names for p in pids if n.startswith(f"torch_{p}_"))


def _sample(procs: dict, tmp: str) -> dict:
    """Every process's RSS, fds and threads, their ``/dev/shm`` segments and the temp directories
    left in ``tmp``, the job's own ``TMPDIR`` (`run_soak`)."""
    import psutil

    out = {}
    for name, pid in procs.items():
        try:
            p = psutil.Process(pid)
            out[name] = {"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.Error:
            out[name] = None
    out["shm"] = _shm_of(procs.values())
    out["temp_dirs"] = len(temp_dirs(tmp))     # pymp-* and torch-shm-dir-* the job's processes left
    return out


def _tm_growth(before: Any, top: int) -> dict:
    """Python-level growth (tracemalloc) since ``before``: total and the biggest sites."""
    import gc
    import tracemalloc

    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(before, "traceback")
    return {"bytes": sum(s.size_diff for s in stats), "blocks": sum(s.count_diff for s in stats),
            "top": [{"bytes": s.size_diff, "blocks": s.count_diff,
                     "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-6:]}
                    for s in stats[:top] if s.size_diff > 0]}


class _Progress:
    """Trainer rank 0's progress on stderr, so a run of minutes is not silent: a line as each
    method starts and ends (what a log keeps) and, on a terminal, a bar of its steps in between
    (gone when it ends). stdout keeps the report alone; the --json file is written by the
    command. Silent on the other ranks."""

    def __init__(self, on: bool) -> None:
        self.bar = self.task = None
        if not on:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]soak[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self.bar.start()

    def start(self, method: str, warmup: int, syncs: int) -> None:
        if self.bar:
            what = "training steps" if method == CONTROL else "syncs"
            self.bar.console.print(f"soak: {method}: {warmup} warm-up + {syncs} {what} …")
            self.task = self.bar.add_task(method, total=warmup + syncs)

    def step(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def done(self, method: str, seconds: float) -> None:
        if self.bar:
            self.bar.remove_task(self.task)
            self.bar.console.print(f"soak: {method}: done in {seconds:.1f} s")

    def stop(self) -> None:
        if self.bar:
            self.bar.stop()


def _soak_rank(rank: int, world: int, methods: tuple, syncs: int, every: int, tmp: str,
               warmup: int = 0, trace: bool = False) -> Any:
    import gc
    import tracemalloc

    import torch
    import torch.distributed as dist

    from ..config import SyncConfig
    from ..engines import ReferenceEngine
    from ..manager import FSDPShardingManager
    from ..memory import empty_cache
    from ..models import build_model, load_config
    from ..topology import make_mesh
    from .trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32,
                             kv_cache_tokens=64) if rank == 0 else None
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=cpu_group())
    procs = {f"trainer{r}": p for r, p in enumerate(pids)}
    if engine is not None:
        procs.update({f"worker{r}": p for r, p in enumerate(engine.worker_pids)})
    mesh = make_mesh(world // 2, 2) if "tensor" in methods else None
    series: dict[str, list] = {}
    seconds: dict[str, float] = {}
    traced: dict[str, dict] = {}
    if trace:
        tracemalloc.start(12)
    progress = _Progress(rank == 0)
    try:
        for method in methods:
            progress.start(method, warmup, syncs)
            manager = None
            if method != CONTROL:
                conf = SyncConfig(method=method, dtype=torch.float32, bucket_bytes=48 << 10,
                                  memory_probe="off", disk_dir=os.path.join(tmp, "disk"), disk_keep=2)
                manager = FSDPShardingManager(module, engine, mesh=mesh if method == "tensor" else None,
                                              config=conf)
            rows = series.setdefault(method, [])
            t0 = time.monotonic()
            snap = None
            points = sample_points(warmup, syncs, every)
            if rank == 0 and 0 in points:       # no warm-up: the baseline is before the first sync
                rows.append({"sync": 0, **_sample(procs, tmp)})
            for i in range(warmup + syncs):
                train_step(module, opt, synthetic_batch(cfg.vocab_size, step=i, rank=rank, batch=2, seq_len=8))
                if manager is None:
                    dist.barrier(group=cpu_group())
                    empty_cache()
                else:
                    with manager:
                        pass
                if rank == 0 and i + 1 in points:
                    rows.append({"sync": i + 1, **_sample(procs, tmp)})
                progress.step()
                if trace and (snap is None and i + 1 >= warmup):
                    gc.collect()
                    snap = tracemalloc.take_snapshot()
            seconds[method] = time.monotonic() - t0
            progress.done(method, seconds[method])
            if trace:
                traced[method] = _tm_growth(snap, 8)
            if manager is not None:
                manager.close()
            if engine is not None and method == "tensor":   # colocated: released on exit; the
                engine.resume_memory_occupation()            # others push into a resident engine
            dist.barrier(group=cpu_group())
    finally:
        progress.stop()
        if engine is not None:
            engine.shutdown()
        if trace:
            tracemalloc.stop()
    everyone = [None] * world
    dist.all_gather_object(everyone, traced, group=cpu_group())
    if rank != 0:
        return None
    return {"series": series, "seconds": seconds, "procs": list(procs),
            "tracemalloc": {f"trainer{r}": t for r, t in enumerate(everyone)} if trace else None}


def sample_points(warmup: int, syncs: int, every: int) -> set[int]:
    """After which syncs (counted from 1; 0: before the first) the processes are sampled: every
    ``every`` syncs, and always at the end of the warm-up (the baseline every growth is counted
    from), halfway through the measured syncs (the second half's growth) and at the end. With
    ``--every`` larger than the run, the baseline and the end are still two samples ``syncs``
    apart: the report never compares a sample with itself."""
    end = warmup + syncs
    return ({s for s in range(1, end + 1) if (s - 1) % every == 0}
            | {warmup, warmup + syncs // 2, end})


def summarise(series: dict, procs: list, warmup: int) -> list[dict]:
    """One row per method × process (and the /dev/shm count): after warm-up, at the end, growth;
    and the growth over the second half of the measured syncs alone (a leak grows there as it did
    before; memory still settling after the warm-up does not), also scaled to 1000 syncs."""
    rows = []
    for method, samples in series.items():
        base = next((s for s in samples if s["sync"] >= warmup), samples[0])
        last = samples[-1]
        if last is base:         # nothing measured after the baseline: no growth can be told
            rows.append({"method": method, "process": "*", "error": f"one sample only (sync {base['sync']}): "
                                                                     f"nothing measured after the warm-up"})
            continue
        span = max(1, last["sync"] - base["sync"])
        mid = next((s for s in samples if s["sync"] >= (base["sync"] + last["sync"]) // 2), samples[0])
        half = max(1, last["sync"] - mid["sync"])
        first = mid["sync"] - base["sync"]       # 0: one measured sync, no first half to compare
        for name in procs:
            a, b, m = base.get(name), last.get(name), mid.get(name)
            if not a or not b or not m:
                rows.append({"method": method, "process": name, "error": "process gone"})
                continue
            grow = (b["rss"] - a["rss"]) / 2**20
            rows.append({"method": method, "process": name, "syncs": span,
                         "rss_mib_after_warmup": round(a["rss"] / 2**20, 2),
                         "rss_mib_end": round(b["rss"] / 2**20, 2),
                         "rss_growth_mib": round(grow, 3),
                         "rss_growth_mib_per_1000": round(grow * 1000 / span, 3),
                         "second_half_from_sync": mid["sync"],
                         "rss_growth_mib_first_half_per_1000":
                             round((m["rss"] - a["rss"]) / 2**20 * 1000 / first, 3) if first > 0 else None,
                         "rss_growth_mib_second_half_per_1000": round((b["rss"] - m["rss"]) / 2**20 * 1000 / half, 3),
                         "fds_growth": b["fds"] - a["fds"], "threads_growth": b["threads"] - a["threads"]})
        rows.append({"method": method, "process": "/dev/shm", "syncs": span,
                     "shm_segments_after_warmup": base["shm"], "shm_segments_end": last["shm"],
                     "shm_growth": last["shm"] - base["shm"],
                     "temp_dirs_growth": last.get("temp_dirs", 0) - base.get("temp_dirs", 0)})
    return rows


TARGET_SYNCS = 1000   # the RSS target is per 1000 syncs: fewer cannot judge it
BUDGET_MIB = 1.0      # RSS growth allowed per process per TARGET_SYNCS syncs
SHORT_MIN_SYNCS = 40
"""Fewer measured syncs than this: RSS is not judged at all. Two halves of a handful of samples
after a warm-up of a sync or two show the training loop's own first allocations as "steady" growth
past 1 MiB (a 12-sync `--methods train` run after 1 warm-up sync failed so); the leak-free and
leaking runs the rule was measured on were 40 syncs and more."""

STEADY = 0.8
"""A short run's RSS fails when it grew past `BUDGET_MIB` and its second half grew at least this
fraction as fast as its first: steady growth. Leak-free runs slow down to 0.2-0.6 (the tensor
trainers, the only rows past 1 MiB: ``--syncs 40 --warmup 5`` +2.5 MiB at 0.6, ``--syncs 40``
+1.9 at 0.29, ``--syncs 100`` +1.06 at 0.35); a leak of 1 MiB per sync runs at 0.96-0.99."""


def rss_failure(row: dict, syncs: int) -> str | None:
    """Why the row's RSS fails the soak, or None. Over at least `TARGET_SYNCS` syncs: growth past
    `BUDGET_MIB` per 1000 syncs. Over fewer: growth past `BUDGET_MIB` within the run (not scaled
    up) at a steady rate (`STEADY`); growth that slows down is memory settling, and a slower leak
    than the budget within the run needs the longer run to be seen. Under `SHORT_MIN_SYNCS`: not
    judged."""
    if syncs >= TARGET_SYNCS:
        if row["rss_growth_mib_per_1000"] > BUDGET_MIB:
            return (f"RSS grew {row['rss_growth_mib_per_1000']:+.2f} MiB per 1000 syncs, "
                    f"budget {BUDGET_MIB:g} MiB")
        return None
    if syncs < SHORT_MIN_SYNCS:
        return None
    grow, first = row["rss_growth_mib"], row.get("rss_growth_mib_first_half_per_1000")
    second = row["rss_growth_mib_second_half_per_1000"]
    if grow <= BUDGET_MIB:
        return None
    if first is None:
        return (f"RSS grew {grow:+.2f} MiB over {row['syncs']} sync, past the {BUDGET_MIB:g} MiB "
                f"budget for {TARGET_SYNCS} syncs")
    if second < STEADY * first:
        return None              # slowing down: settling (see STEADY)
    pace = f"{second / first:.2f}x as fast as the first" if first > 0 else "faster than the first"
    return (f"RSS grew {grow:+.2f} MiB over {row['syncs']} syncs, past the {BUDGET_MIB:g} MiB budget "
            f"for {TARGET_SYNCS} syncs, at a steady rate (second half {pace}): a leak")


def _meets(row: dict, syncs: int = TARGET_SYNCS) -> bool:
    """The row meets the target: no growth in fds, threads or segments, and no RSS failure
    (`rss_failure`, by the run's length ``syncs``)."""
    if "error" in row:
        return False
    if row["process"] == "/dev/shm":
        return row["shm_growth"] <= 0 and row.get("temp_dirs_growth", 0) <= 0
    return (rss_failure(row, syncs) is None
            and row["fds_growth"] <= 0 and row["threads_growth"] <= 0)


def plot(series: dict, procs: list, path: str, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(series), figsize=(5 * len(series), 7), squeeze=False)
    for col, (method, samples) in enumerate(series.items()):
        x = [s["sync"] for s in samples]
        ax = axes[0][col]
        for name in procs:
            ax.plot(x, [(s[name] or {}).get("rss", float("nan")) / 2**20 for s in samples], label=name)
        ax.axvline(warmup, color="grey", ls=":", lw=1)
        ax.set_title(f"{method}: RSS (MiB)")
        ax.set_xlabel("sync")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for name in procs:
            ax.plot(x, [(s[name] or {}).get("fds", float("nan")) for s in samples], label=f"{name} fds")
            ax.plot(x, [(s[name] or {}).get("threads", float("nan")) for s in samples], ls="--",
                    label=f"{name} threads")
        ax.plot(x, [s["shm"] for s in samples], color="k", label="/dev/shm segments")
        ax.set_title(f"{method}: fds, threads, shm")
        ax.set_xlabel("sync")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def default_warmup(syncs: int) -> int:
    """Syncs run before the N measured ones: 300, or N/3 (at least 5) when N is under 900."""
    return min(300, max(5, syncs // 3))


def run_soak(syncs: int, methods=METHODS, every: int | None = None, warmup: int | None = None,
             png: str | None = None, trace: bool = False) -> dict:
    import tempfile

    from .launch import run_ranks, spawn_env

    every = every or max(1, syncs // 200)
    warmup = warmup if warmup is not None else default_warmup(syncs)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp_sync_soak_") as tmp:
        # the job's TMPDIR: the ranks and their engine workers make their temp directories there,
        # and only there are leftovers counted (the machine's holds other programs' as well)
        out = run_ranks(_soak_rank, 2, tuple(methods), syncs, every, tmp, warmup, trace,
                        env=spawn_env({"TMPDIR": tmp}), timeout_s=24 * 3600, pg_timeout_s=120)[0]
    rows = summarise(out["series"], out["procs"], warmup)
    judged = syncs >= TARGET_SYNCS
    return {"syncs": syncs, "methods": list(methods), "every": every, "warmup": warmup,
            "seconds_per_method": {k: round(v, 1) for k, v in out["seconds"].items()},
            "wall_s": round(time.monotonic() - t0, 1), "rows": rows,
            "rss_target_judged": judged,
            "rss_rule": (f"growth <= {BUDGET_MIB:g} MiB per {TARGET_SYNCS} syncs" if judged else
                         f"fails growth > {BUDGET_MIB:g} MiB at a steady rate (second half >= "
                         f"{STEADY:g}x the first half's)" if syncs >= SHORT_MIN_SYNCS else
                         f"not judged: fewer than {SHORT_MIN_SYNCS} syncs"),
            "ok": all(_meets(r, syncs) for r in rows), "series": out["series"],
            "procs": out["procs"], "png": None,
            **({"tracemalloc": out["tracemalloc"]} if trace else {})}


def plot_report(rep: dict, png: str) -> str | None:
    """Plot ``rep`` to ``png`` when matplotlib is installed; returns why not otherwise."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed, so no plot was drawn (pip install matplotlib)"
    # its folder made, as --json's is (`args.check_output` passed a path whose folder is missing)
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    plot(rep["series"], rep["procs"], png, rep["warmup"])
    rep["png"] = png
    return None


def add_soak_parser(sub) -> None:
    from . import args as ca

    p = sub.add_parser(
        "soak", help="many syncs per method with training between them; resources must not grow",
        description="Run --warmup and then --syncs weight syncs per method (tensor, distributed, "
                    "disk), each after a training step, on 2 trainer ranks (FSDP2, gloo) into a 2-worker reference engine "
                    "(tiny model, CPU). Samples the RSS, fds and threads of every process (trainer "
                    "ranks, engine workers) and their /dev/shm segments, plots them (--png) and "
                    "prints the growth after the warm-up. Target: RSS growth <= 1 MiB per process "
                    "per 1000 syncs, no growth in fds, threads or segments; exit code 1 otherwise. "
                    "With --syncs under 1000 the RSS is not scaled up to 1000 syncs: a process fails "
                    "when it grew more than 1 MiB within the run at a steady rate (over the second "
                    "half of the measured syncs at least 0.8x as fast as over the first; memory "
                    "still settling after the warm-up slows down), so a short run catches only a "
                    "leak past 1 MiB within it; under 40 syncs RSS is not judged.",
        formatter_class=ca.DefaultsFormatter)
    p.add_argument("--syncs", type=ca.positive_int, default=1000,
                   help="measured syncs per method (run after the warm-up)")
    p.add_argument("--methods", type=ca.csv_of(ca.choice_of((*METHODS, CONTROL))), default="tensor,distributed,disk",
                   help="comma list of tensor,distributed,disk; 'train' adds the control: the same "
                        "training steps with no sync")
    p.add_argument("--every", type=ca.positive_int, default=None, help="sample every K syncs (default: N/200); the end of the warm-up, the middle "
                        "and the end are always sampled")
    p.add_argument("--warmup", type=ca.non_negative_int, default=None,
                   help="syncs per method before the baseline sample, not counted in --syncs "
                        "(default: 300, or N/3 (>= 5) when N < 900: a fresh process's RSS settles "
                        "over its first few hundred syncs)")
    p.add_argument("--png", default="soak.png", help="where to write the plot")
    p.add_argument("--json", metavar="PATH", help="write the report (with every sample) as JSON here")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the trainer ranks' Python allocations from the warm-up on and report "
                        "what grew (slower; tells Python-level growth from native)")
    p.set_defaults(run=cmd_soak)


def time_table(rep: dict) -> Any:
    """How long each method's loop took (its warm-up and measured steps, each a training step and
    a sync; the control: a training step alone), and the whole run's wall time."""
    from rich.table import Table

    steps = rep["warmup"] + rep["syncs"]
    table = Table(title=f"time per method: {steps} steps each (training step + sync)",
                  caption=f"wall {rep['wall_s']} s, process start and engine included")
    for col in ("method", "seconds", "ms per step"):
        table.add_column(col, justify="right")
    for method, secs in rep["seconds_per_method"].items():
        table.add_row(method, f"{secs:.1f}", f"{secs / steps * 1e3:.1f}" if steps else "-")
    return table


def cmd_soak(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    methods = tuple(dict.fromkeys(args.methods))   # each name checked by its type (exit 2); once each
    console = Console(width=200)
    warm = args.warmup if args.warmup is not None else default_warmup(args.syncs)
    console.print(f"[bold]fsdp-sync soak[/]: {warm} warm-up + {args.syncs} syncs × {', '.join(methods)} …")
    rep = run_soak(args.syncs, methods, args.every, args.warmup, None, args.tracemalloc)
    judged = rep["rss_target_judged"]
    table = Table(title=f"after the warm-up ({rep['warmup']} syncs) → end of {args.syncs} more syncs")
    for col in ("method", "process", "RSS MiB", "growth MiB", "per 1000 syncs",
                "2nd half, per 1000" if judged else "2nd half vs 1st", "fds Δ", "threads Δ", "shm Δ"):
        table.add_column(col, justify="right")
    for r in rep["rows"]:
        if "error" in r:
            table.add_row(r["method"], r["process"], "[red]" + r["error"], "", "", "", "", "", "")
        elif r["process"] == "/dev/shm":
            table.add_row(r["method"], r["process"], "", "", "", "", "", "",
                          f"{r['shm_growth']} (temp dirs {r.get('temp_dirs_growth', 0):+d})")
        else:
            # fewer syncs than the target's 1000 are not scaled up to it: the growth is what was
            # measured, and how fast the second half grew against the first (`rss_failure`)
            first = r.get("rss_growth_mib_first_half_per_1000")
            scaled = ((f"{r['rss_growth_mib_per_1000']:+.2f}",
                       f"{r['rss_growth_mib_second_half_per_1000']:+.2f}") if judged
                      else (f"– (<{TARGET_SYNCS})",
                            f"{r['rss_growth_mib_second_half_per_1000'] / first:.2f}x" if first and first > 0
                            else "–"))
            table.add_row(r["method"], r["process"], f"{r['rss_mib_after_warmup']:.1f} → {r['rss_mib_end']:.1f}",
                          f"{r['rss_growth_mib']:+.2f}", *scaled,
                          str(r["fds_growth"]), str(r["threads_growth"]), "")
    console.print(table)
    for proc, per_method in (rep.get("tracemalloc") or {}).items():
        for method, t in per_method.items():
            console.print(f"tracemalloc {method} {proc}: {t['bytes'] / 2**10:+.1f} KiB in {t['blocks']:+d} "
                          f"blocks since the warm-up")
            for site in t["top"][:3]:
                console.print(f"   {site['bytes'] / 2**10:+.1f} KiB {site['blocks']:+d} blocks  "
                              + " <- ".join(reversed(site["where"][-3:])))
    console.print(time_table(rep))
    # the measurement is kept before anything that can fail for want of a package (the plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1))
        console.print(f"wrote {args.json}")
    if args.png:
        why_not = plot_report(rep, args.png)
        console.print(f"plot: {args.png}" if why_not is None else f"no plot: {why_not}")
        if args.json and why_not is None:
            Path(args.json).write_text(json.dumps(rep, indent=1))
    for r in rep["rows"]:
        why = rss_failure(r, rep["syncs"]) if "rss_growth_mib" in r else None
        if why:
            console.print(f"[red]{r['method']} {r['process']}[/]: {why}")
    if not judged:
        rss = [r for r in rep["rows"] if "rss_growth_mib" in r]
        growth = max((r["rss_growth_mib"] for r in rss), default=0.0)
        leaks = sum(rss_failure(r, rep["syncs"]) is not None for r in rss)
        others = all(_meets({**r, "rss_growth_mib": 0.0}, rep["syncs"]) for r in rep["rows"])
        console.print(f"measured {args.syncs} syncs per method after the warm-up: largest RSS growth "
                      f"{growth:+.2f} MiB, {leaks or 'no'} process{'' if leaks == 1 else 'es'} past "
                      f"{BUDGET_MIB:g} MiB at a steady rate; "
                      f"fds, threads and segments {'did not grow' if others else 'GREW'}. A short run "
                      f"catches only a leak past {BUDGET_MIB:g} MiB within it; the RSS target is per "
                      f"{TARGET_SYNCS} syncs: run --syncs {TARGET_SYNCS} to judge it")
        if not rep["ok"]:
            console.print("[red]short-run check NOT passed[/]")
        return 0 if rep["ok"] else 1
    console.print("[green]target met[/]" if rep["ok"] else "[red]target NOT met[/]")
    return 0 if rep["ok"] else 1
