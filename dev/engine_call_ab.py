"""A per-rank bucket's engine call on a one-worker reference engine, four ways interleaved in one
process: the payload's state word in a segment of its own or in a sync's shared page
(`weights.state_words`), and the worker's stage and commit as two round trips or one
(``stage_commit``). Each call: make the payload, the engine's `load_rank_bucket` (inside an
update, as a sync makes it), release. Prints median and minimum ms per mode.

Usage: PYTHONPATH=. .venv/bin/python dev/engine_call_ab.py [--model tiny] [--calls 150]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import handles, state_words
    from fsdp_sync.weights.bucket import TensorMeta, flatten, plan_buckets, sglang_metadata

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--calls", type=int, default=150, help="calls per mode")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.model)
    with ReferenceEngine(model_config=cfg, tp_size=1) as e:
        shard = e.shard_for_rank(build_model(cfg, seed=0).state_dict(), 0)
        (b,) = plan_buckets([TensorMeta.of(k, v) for k, v in shard.items()], 1 << 30)
        obj = {"flattened_tensor": flatten(b, shard, out=handles.empty_shared(b.nbytes)),
               "metadata": sglang_metadata(b)}
        fused = e._round

        def two_rounds(cmd, *args, **kw):      # the stage, then the commit, as before the fusion
            if cmd != "stage_commit":
                return fused(cmd, *args, **kw)
            staged = fused("stage", *args, **kw)
            if staged[0][0] == "ok":
                staged[0][1]["committed"] = fused("commit", what="commit")[0]
            return staged

        modes = [(p, r) for p in ("own segment", "pooled") for r in ("two rounds", "one round")]
        took: dict = {m: [] for m in modes}
        take = state_words.take
        e.begin_weight_update(transactional=False)
        with state_words.pooled():          # held over every call, as a sync holds it
            for i in range(a.calls * len(modes)):
                mode = modes[i % len(modes)]
                e._round = fused if mode[1] == "one round" else two_rounds
                state_words.take = take if mode[0] == "pooled" else (lambda alloc: None)
                t0 = time.perf_counter()
                ps = handles.make_payloads(obj, 1, ranks=[0])
                e.load_rank_bucket(None, ps.payloads, flush_cache=False)
                ps.release()
                took[mode].append(time.perf_counter() - t0)
        state_words.take, e._round = take, fused
        e.end_weight_update()
    print(f"{a.model}: {len(shard)} tensors a call, {a.calls} calls a mode, interleaved (ms: median, min)")
    for (p, r), v in took.items():
        print(f"  {p:12s} {r:11s} {statistics.median(v) * 1e3:7.3f} {min(v) * 1e3:7.3f}")


if __name__ == "__main__":
    main()
