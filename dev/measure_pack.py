"""What packing a sync's buckets costs on the host: wall time and copy ops, per packer.

Three packers, each over every bucket of a model (64 MiB buckets, trainer fp32, rollout bf16, one
process, no engine): ``flatten`` (`bucket.flatten` of tensors already in the rollout dtype),
``full`` (`export.iter_buckets` of a plain module: the cast copies of `gather.fill_bucket`) and
``engine`` (`reshard.iter_rank_buckets` at TP 1: the engine-layout blocks of `_write_local`). For
each: the median seconds of ``--repeats`` passes, and from one pass under ``torch.profiler``
(CPU) the ops that move bytes, counted two ways: top-level (what Python dispatches: on a GPU
each is a kernel launch, a fused ``_foreach_copy_`` one per chunk of tensors) and every
``aten::copy_`` (the per-pair copies a CPU ``_foreach_copy_`` still runs inside the op).

Models: recipe names, and ``small:N`` (N tensors of 1 KiB fp32, ``flatten`` only: the
per-tensor cost alone). Backs docs/gpu.md, "What would bring it down".

Usage: PYTHONPATH=. .venv/bin/python dev/measure_pack.py [--models tiny,qwen2-160m,small:2000]
           [--repeats 7] [--json PATH]
Run it once with PYTHONPATH pointing at an older tree to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import bucket, export, reshard
from fsdp_sync.weights.layout import layout_for

MOVES = ("aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::_foreach_zero_", "aten::fill_",
         "aten::cat", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")
BUCKET = 64 << 20


def alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def packers(name: str):
    if name.startswith("small:"):
        ts = [torch.randn(256) for _ in range(int(name.split(":")[1]))]
        plan = bucket.plan_buckets([bucket.TensorMeta.of(f"t{i}", t) for i, t in enumerate(ts)], BUCKET)
        outs = [alloc(b.nbytes) for b in plan]

        def flat() -> None:
            pos = 0
            for b, out in zip(plan, outs):
                bucket.flatten(b, ts[pos:pos + len(b.entries)], out=out)
                pos += len(b.entries)
        return {"flatten": flat}, len(ts)
    config = load_config(name)
    model = build_model(config, seed=0, dtype=torch.float32)
    named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items()]
    plan = bucket.plan_buckets([bucket.TensorMeta.of(n, t) for n, t in named], BUCKET)
    outs = [alloc(b.nbytes) for b in plan]
    layout = layout_for(config, 1)

    def flat() -> None:
        pos = 0
        for b, out in zip(plan, outs):
            bucket.flatten(b, [t for _, t in named[pos:pos + len(b.entries)]], out=out)
            pos += len(b.entries)

    def full() -> None:
        for _ in export.iter_buckets(model, BUCKET, dtype=torch.bfloat16, alloc=alloc):
            pass

    def engine() -> None:
        for _ in reshard.iter_rank_buckets(model, layout, BUCKET, dtype=torch.bfloat16, alloc=alloc):
            pass
    return {"flatten": flat, "full": full, "engine": engine}, len(named)


def measure(fn, repeats: int) -> dict:
    fn()                                                     # warm-up (plans cached, pages touched)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    top = [e for e in events if e.name in MOVES and (e.cpu_parent is None or e.cpu_parent.name not in MOVES)]
    return {"seconds": statistics.median(times), "top_level_moves": len(top),
            "all_copy_": sum(e.name == "aten::copy_" for e in events)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,qwen2-160m,small:2000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        fns, n = packers(name)
        for kind, fn in fns.items():
            r = dict(model=name, packer=kind, tensors=n, **measure(fn, a.repeats))
            rows.append(r)
            print(f"{name:12s} {kind:8s} tensors {n:5d}  {r['seconds'] * 1e3:8.2f} ms  "
                  f"top-level moves {r['top_level_moves']:5d}  aten::copy_ {r['all_copy_']:5d}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
