"""PNG plots of a bench result (matplotlib, headless): time and peak memory against bucket size per
strategy, and the memory curve across the stages of one sync, multi-stage wake-up on against off.

Not here: measuring anything; it reads the dict `bench.run_bench` returns.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .bench.targets import row_floor

__all__ = ["plot_bench", "plot_plan"]

MiB = 2**20
_FLOOR_LABEL = {"floor_seconds": "floor (all-gather + one copy)",
                "floor_shared_seconds": "floor, host-shared (each rank copies its shard once + one copy)"}


def _file_part(model: str) -> str:
    """A model's name as a file name's part: a recipe's name as it is; a path (``--models`` takes a
    YAML recipe, a config.json or its folder) by its file's stem, or its folder's name for a
    ``config.json`` (a path's slashes made the figure's path a missing folder: a traceback after
    the whole bench)."""
    p = Path(model)
    if len(p.parts) <= 1 and p.suffix not in (".json", ".yaml", ".yml"):
        return model
    stem = p.parent.name if p.stem == "config" and p.parent.name else p.stem
    return stem.replace("/", "_") or "model"


def _unique(path: Path, written: list[Path]) -> Path:
    """``path``, or ``path`` with ``_2``, ``_3``, ... before its suffix if this call wrote it
    already: two models whose names make the same file part each keep their figure."""
    k, out = 1, path
    while out in written:
        k += 1
        out = path.with_name(f"{path.stem}_{k}{path.suffix}")
    return out


def plot_bench(result: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    written: list[Path] = []

    for model in sorted({r["model"] for r in rows}):
        mrows = [r for r in rows if r["model"] == model and r["multi_stage"]] or \
            [r for r in rows if r["model"] == model]
        by: dict[str, list] = defaultdict(list)
        for r in mrows:
            label = r["strategy"]
            if r["strategy"] == "flattened":
                label += " (host-shared)" if r.get("share_host_memory") else " (all-gather)"
            by[label].append(r)
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        buckets = sorted({r["bucket_bytes"] for r in mrows})
        for strategy, rs in sorted(by.items()):
            rs = sorted(rs, key=lambda r: r["bucket_bytes"])
            if strategy == "per_tensor":  # independent of the bucket size: a horizontal line
                ax_t.axhline(rs[0]["seconds"], ls="--", color="gray", label="per_tensor (baseline)")
                ax_m.axhline(rs[0]["peak_extra_bytes"] / MiB, ls="--", color="gray",
                             label="per_tensor (baseline)")
                continue
            x = [r["bucket_bytes"] / MiB for r in rs]
            ax_t.plot(x, [r["seconds"] for r in rs], "o-", label=strategy)
            ax_m.plot(x, [r["peak_extra_bytes"] / MiB for r in rs], "o-", label=strategy)
        # each row's own floor (`targets.row_floor`, as the targets judge it): a host-shared row
        # gathers nothing, so the all-gather floor is not its floor; one line per kind of floor
        fl: dict[str, dict] = defaultdict(lambda: defaultdict(list))
        for r in mrows:
            seconds, key = row_floor(r)
            fl[key][r["bucket_bytes"]].append(seconds)
        for key, style in (("floor_seconds", "kx:"), ("floor_shared_seconds", "k+--")):
            if fl.get(key):
                xs = sorted(fl[key])
                ax_t.plot([b / MiB for b in xs], [min(fl[key][b]) for b in xs], style, label=_FLOOR_LABEL[key])
        # each size's budget as its rows carry it (`plan.memory_budget`: 2 x max(bucket, largest
        # tensor) + largest tensor for these rows), the largest where rows differ
        largest = mrows[0]["largest_tensor_bytes"]
        budget = [(b / MiB, max(r.get("memory_budget_bytes") or 2 * max(b, largest) + largest
                                for r in mrows if r["bucket_bytes"] == b) / MiB) for b in buckets]
        ax_m.plot([b for b, _ in budget], [v for _, v in budget], "kx:",
                  label="budget: 2×max(bucket, largest tensor) + largest tensor")
        for ax, title, ylabel in ((ax_t, "sync time", "seconds (median)"),
                                  (ax_m, "peak extra memory per device", "MiB")):
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("bucket size (MiB)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {model}, {mrows[0]['ranks']} ranks, TP {mrows[0]['tp']}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = _unique(out / f"sync_vs_bucket_{_file_part(model)}.png", written)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # memory timeline of one sync: multi-stage on vs off, same model/strategy/bucket
    pairs = defaultdict(dict)
    for r in rows:
        if r.get("memory_curve"):
            pairs[(r["model"], r["strategy"], r["bucket_bytes"])][r["multi_stage"]] = r
    for (model, strategy, bucket), d in sorted(pairs.items()):
        if len(d) < 2 or strategy == "per_tensor":
            continue
        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=False)
        for ax, ms in zip(axes, (True, False)):
            r = d[ms]
            ts = [p[0] for p in r["memory_curve"]]
            mem = [p[1] / MiB for p in r["memory_curve"]]
            ax.plot(ts, mem, lw=1.2, color="C0")
            lo, hi = min(mem), max(mem)
            stages = [st for st in r["stages"] if "t" in st]
            for k, st in enumerate(stages):
                if st["name"] == "sync_weights":
                    ax.axvspan(st["t"], st["t"] + st["seconds"], color="C1", alpha=0.15)
                ax.axvline(st["t"], color="gray", lw=0.4)
                # stagger the labels: stages that take no time sit on top of each other
                ax.text(st["t"], hi - (hi - lo) * (0.08 + 0.14 * (k % 5)), " " + st["name"],
                        fontsize=7, va="center")
            ax.set_ylabel("TP group memory (MiB)")
            ax.set_title(f"one sync, multi-stage wake-up {'on' if ms else 'off'}: {model}, {strategy}, "
                         f"bucket {bucket / MiB:g} MiB")
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("seconds since the with block began")
        fig.tight_layout()
        # a bucket's size as the rows give it (``0.25MiB``): int() made every sub-MiB bucket's
        # figure one file, each overwriting the last
        path = _unique(out / f"memory_timeline_{_file_part(model)}_{strategy}_{bucket / MiB:g}MiB.png", written)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_plan(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """`fsdp-sync plan` rows: estimated seconds and the peak-memory bound against bucket size, one
    line per (method, layout) and model, with the memory left on the GPU; refused plans marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for model in sorted({str(r["model"]) for r in rows}):
        mrows = [r for r in rows if str(r["model"]) == model]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        by: dict[str, list] = defaultdict(list)
        # a line per plan besides its bucket size: a sweep of --tp 1,2 drew both plans of a bucket
        # on one line, zigzagging between them
        swept = [k for k in ("ranks", "tp", "ep", "quantization") if len({str(r.get(k)) for r in mrows}) > 1]
        for r in mrows:
            by[f"{r['method']} ({r['layout']}" + "".join(f", {k} {r.get(k)}" for k in swept) + ")"].append(r)
        for label, rs in sorted(by.items()):
            rs = sorted(rs, key=lambda r: r["bucket_bytes"])
            ok = [r for r in rs if not r.get("refused")]
            line = ax_t.plot([r["bucket_bytes"] / MiB for r in ok], [r["seconds"] for r in ok], "o-", label=label)
            color = line[0].get_color() if line else None
            ax_m.plot([r["bucket_bytes"] / MiB for r in ok], [r["memory_budget_bytes"] / 2**30 for r in ok], "o-",
                      color=color, label=label)
            if any(r["method"] != "tensor" for r in ok):     # a disaggregated engine rank: its own rule
                ax_m.plot([r["bucket_bytes"] / MiB for r in ok],
                          [r["engine_memory_budget_bytes"] / 2**30 for r in ok], "^--", color=color)
            bad = [r for r in rs if r.get("refused")]
            ax_t.plot([r["bucket_bytes"] / MiB for r in bad], [max((x["seconds"] for x in ok), default=1)] * len(bad),
                      "x", color=line[0].get_color() if line else "k")
        free = {}
        for r in mrows:
            if "trainer_memory_free_bytes" not in r:
                continue
            if r["method"] == "tensor":
                free["a colocated GPU"] = r["trainer_memory_free_bytes"]
            else:
                free["a trainer GPU"] = r["trainer_memory_free_bytes"]
                free["an engine GPU"] = r["engine_memory_free_bytes"]
        for where, f in sorted(free.items(), key=lambda kv: kv[1]):
            ax_m.axhline(f / 2**30, ls=":", color="k")
            ax_m.annotate(f"free on {where}", (1, f / 2**30),
                          xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=8)
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bucket MiB")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("estimated seconds (x: refused)")
        ax_m.set_ylabel("memory bound GiB (o trainer, ^ engine)")
        ax_t.legend(fontsize=7)
        fig.suptitle(f"fsdp-sync plan: {Path(model).stem}")
        fig.tight_layout()
        path = _unique(out / f"plan_{_file_part(model)}.png", written)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
