"""Audit H58 of the bench's floors, the plan recipe and the plots: in process, no ranks launched.

- the floors' bodies (mutants that survived every in-process test): the all-gather floor without
  its engine copy, the shared floor copying ``total / tp`` where each rank holds ``total / world``,
  the all-to-all floor receiving less than the bytes its row's trainer rank received, `copy_seconds`
  copying on no rank at all. Each is checked here at 3 ranks, TP 2 (the bench's own tests run at
  world == tp, where several of these read the same).
- `plan_recipe`: an empty list, a folder for ``cluster`` and ``fsdp: 3`` are refused naming the key.
- `plots.plot_bench`: a model given as a path (``--models path/config.json``) raised
  FileNotFoundError after the whole bench (the path's slashes in the figure's name); sub-MiB
  buckets (``--bucket-mb 0.25,0.5``) wrote every memory timeline to one ``..._0MiB.png``, each
  overwriting the last.
"""

from __future__ import annotations


import pytest
import torch

MiB = 2**20


@pytest.fixture
def three_ranks(monkeypatch):
    """`floors` as rank 0 of 3 sees it: every timed body run once, collectives recorded."""
    import torch.distributed as dist

    from fsdp_sync.cli.bench import floors
    from fsdp_sync.weights import gather

    calls: dict = {"all_gather": [], "all_to_all": [], "copies": [], "barriers": 0}

    class Copy(floors._Copy):
        def __call__(self) -> None:
            super().__call__()
            calls["copies"].append(self.nbytes)
            assert bool(self.dst[: min(self.nbytes, self.dst.numel())].eq(1).all())

    def all_gather(out, inp, group):
        calls["all_gather"].append((out.numel(), inp.numel()))

    def barrier(*a, **kw):
        calls["barriers"] += 1

    monkeypatch.setattr(floors, "_Copy", Copy)
    monkeypatch.setattr(floors, "cpu_group", lambda *a: None)
    monkeypatch.setattr(floors, "median_seconds", lambda body, dev, repeats, warmup=1: (body(), 0.5)[1])
    monkeypatch.setattr(gather, "all_gather", all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **kw: 3)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **kw: 0)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, o, i: calls["all_to_all"].append(sum(o)))
    return floors, calls


def test_each_floor_moves_its_rows_bytes_at_three_ranks_tp_two(three_ranks, monkeypatch):
    floors, calls = three_ranks
    # all-gather floor: 1000 bytes in 300-byte buckets over 3 ranks, then the engine rank's copy
    moved: dict = {}
    assert floors.floor_seconds(1000, 300, 2, "cpu", 3, moved=moved) == 0.5
    assert calls["all_gather"] == [(300, 100)] * 3 + [(102, 34)]
    assert moved == {"all_gather": 1002, "engine_copy": 500} and calls["copies"] == [500]
    # host-shared floor: each rank copies its own third, then the engine rank's half
    calls["copies"].clear()
    moved = {}
    assert floors.floor_shared_seconds(1200, 2, "cpu", 3, moved=moved) == 0.5
    assert moved == {"own_copy": 400, "engine_copy": 600} and calls["copies"] == [400, 600]
    assert calls["barriers"] == 1                       # the engine copies after every rank's own
    # all-to-all floor: rank 0 receives at least what its row's trainer rank received
    moved = {}
    assert floors.floor_all_to_all_seconds(1000, 300, 77, "cpu", 3, 1200, moved=moved) == 0.5
    assert sum(calls["all_to_all"]) == moved["all_to_all_in"] >= 1000, (calls["all_to_all"], moved)
    assert moved["own_copy"] == 400 and moved["engine_copy"] == 77
    # its copies are the other floors' (chunked on CUDA: full-size pairs of a 7B shard did not fit)
    assert calls["copies"] == [400, 600, 400, 77], calls["copies"]
    # copy_seconds: rank 0 copies the bytes once (the figure is rank 0's), as the floors' copies
    # (a full-size pair of a 7B model's bytes beside trainer and engine did not fit a GPU)
    calls["copies"].clear()
    floors.copy_seconds(4096, "cpu", 3)
    assert calls["copies"] == [4096]
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **kw: 1)
    floors.copy_seconds(4096, "cpu", 3)                 # the other ranks idle
    assert calls["copies"] == [4096]


@pytest.mark.parametrize("text, words", [
    ("plan:\n  tp: []\n", ["tp: an empty list"]),
    ("plan:\n  fsdp: 3\n", ["fsdp: 3", "expected one of"]),
    ("plan:\n  cluster: DIR\n", ["cluster: ", "cluster JSON file"]),
])
def test_a_plan_recipe_refuses_an_empty_list_a_folder_cluster_and_fsdp_3(text, words, tmp_path, recipe_refusal):
    recipe_refusal(text.replace("DIR", str(tmp_path)), *words)


def _row(model: str, bucket: int, multi_stage: bool) -> dict:
    return {"model": model, "strategy": "flattened", "bucket_bytes": bucket, "multi_stage": multi_stage,
            "seconds": 0.1, "peak_extra_bytes": 3 * MiB, "floor_seconds": 0.05, "largest_tensor_bytes": MiB,
            "ranks": 2, "tp": 2, "memory_curve": [(0.0, MiB), (0.1, 2 * MiB)],
            "stages": [{"name": "sync_weights", "t": 0.0, "seconds": 0.1}]}


def test_bench_plots_of_a_model_path_and_sub_mib_buckets_are_each_written(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from fsdp_sync.cli.plots import plot_bench

    # the figures' names are under test, not their drawing (test_bench checks real PNGs): a
    # savefig that writes the name only keeps this test under a second
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: open(path, "ab").close())
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **kw: None)

    model = tmp_path / "my-model" / "config.json"
    model.parent.mkdir()
    model.write_text("{}")
    from matplotlib.axes import Axes

    lines: list = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: (lines.append((kw.get("label"), list(a[1])))
                                                              if a[-1] == "o-" else None, real(self, *a, **kw))[1])
    rows = [_row(str(model), b, ms) for b in (MiB // 4, MiB // 2) for ms in (True, False)]
    for r in rows:
        r["seconds"] = 0.1 if r["multi_stage"] else 0.2
    rows.append({**_row(str(model), MiB, True), "strategy": "per_tensor", "memory_curve": None})  # a baseline
    written = plot_bench({"rows": rows}, tmp_path / "plots")
    # the time and memory lines: the multi-stage rows only (not both wake-ups zigzagging)
    assert lines == [("flattened (all-gather)", [0.1, 0.1]), ("flattened (all-gather)", [3.0, 3.0])], lines
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert sorted(p.name for p in written) == names, (written, names)
    assert names == ["memory_timeline_my-model_flattened_0.25MiB.png",
                     "memory_timeline_my-model_flattened_0.5MiB.png", "sync_vs_bucket_my-model.png"], names
    assert plot_bench({"rows": []}, tmp_path / "none") == []


def _drawn_lines(monkeypatch, keep) -> list:
    """The (label, y values) of each line a figure draws where ``keep(label, style)``; figures
    are not written (their names are under test, not their drawing: test_bench checks PNGs)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: open(path, "ab").close())
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **kw: None)
    lines: list = []
    real = Axes.plot

    def plot(self, *a, **kw):
        if keep(kw.get("label"), a[-1]):
            lines.append((kw["label"], list(a[1])))
        return real(self, *a, **kw)

    monkeypatch.setattr(Axes, "plot", plot)
    return lines


def test_a_plan_plot_draws_a_line_per_swept_plan(tmp_path, monkeypatch):
    """Before: lines were keyed by (method, layout) only, so ``plan --tp 1,2 --plot`` drew both
    plans of each bucket on one line, zigzagging between their seconds."""
    from fsdp_sync.cli.plots import plot_plan

    lines = _drawn_lines(monkeypatch, lambda label, style: label and style == "o-")
    rows = [{"model": "tiny", "method": "tensor", "layout": "full", "tp": tp, "ranks": 2, "bucket_bytes": b * MiB,
             "seconds": tp + b / 100, "memory_budget_bytes": b * MiB, "replicas": 1} for tp in (1, 2) for b in (1, 4)]
    # a refused plan's row (`plan.plan_rows`) has no replicas: it stays on its TP's line
    rows.append({"model": "tiny", "method": "tensor", "layout": "full", "tp": 2, "ranks": 2, "ep": 1,
                 "bucket_bytes": 16 * MiB, "quantization": None, "refused": "too big"})
    for r in rows[:-1]:
        r.update(ep=1, quantization=None)
    written = plot_plan(rows, tmp_path)
    assert [p.name for p in written] == ["plan_tiny.png"]
    # two models whose names make one file part each keep their figure
    twins = [{**rows[0], "model": str(tmp_path / d / "qwen" / "config.json")} for d in ("a", "b")]
    assert [p.name for p in plot_plan(twins, tmp_path / "twins")] == ["plan_qwen.png", "plan_qwen_2.png"]
    lines.clear()
    written = plot_plan(rows, tmp_path)
    # the time axis's lines (the first of each pair): one per TP, each its own plan's seconds
    assert lines[0::2] == [("tensor (full, tp 1)", [1.01, 1.04]), ("tensor (full, tp 2)", [2.01, 2.04])], lines


def test_a_host_shared_rows_floor_is_drawn_as_its_own_line(tmp_path, monkeypatch):
    """Before: the one floor line took every row's ``floor_seconds`` (the all-gather's) and was
    labelled "all-gather + one copy", where a host-shared row is judged against its own,
    lower, ``floor_shared_seconds`` (`targets.row_floor`): the figure showed it against a floor
    it does not have."""
    from fsdp_sync.cli.plots import plot_bench

    floors = _drawn_lines(monkeypatch, lambda label, style: str(label or "").startswith("floor"))
    rows = [{**_row("tiny", b, True), "memory_curve": None, "floor_seconds": 0.05 * b / MiB}
            for b in (MiB, 2 * MiB)]
    shared = [{**r, "share_host_memory": True, "floor_shared_seconds": r["floor_seconds"] / 10} for r in rows]
    plot_bench({"rows": rows + shared}, tmp_path)
    assert floors == [("floor (all-gather + one copy)", [0.05, 0.1]),
                      ("floor, host-shared (each rank copies its shard once + one copy)", [0.005, 0.01])], floors
    floors.clear()
    plot_bench({"rows": rows}, tmp_path / "gathered")   # no host-shared row: one floor line, as before
    assert floors == [("floor (all-gather + one copy)", [0.05, 0.1])], floors
