"""What an engine worker does with one tagged bucket payload, in another process: open it, walk
its storages (as the worker keeps them mapped), acknowledge. Interleaved in one child: the
payload's tensors as its unpickling recorded them (``Received._tensors``), against walking the
value (its metadata) for each, as before. Prints median and minimum us per mode, for buckets of
56 and 198 entries (qwen2-1500m's per-rank buckets on the H200 rows, and its whole engine model).

Usage: PYTHONPATH=. .venv/bin/python dev/consumer_open_ab.py [--payloads 600]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _child(conn) -> None:
    from fsdp_sync.weights import handles

    took: dict = {"walk the value": [], "recorded": []}
    i = 0
    while True:
        p = conn.recv_bytes()
        if p == b"stop":
            break
        mode = "walk the value" if i % 2 else "recorded"
        i += 1
        t0 = time.perf_counter()
        rec = handles.open_payload(p, 0)
        if mode == "walk the value":
            rec._tensors = None
        rec.each_storage(lambda s: None, ("cpu", "cuda"))
        handles.ack_all([rec])
        del rec
        took[mode].append(time.perf_counter() - t0)
        conn.send_bytes(b"ok")
    conn.send({k: (statistics.median(v) * 1e6, min(v) * 1e6) for k, v in took.items()})


def main() -> None:
    import torch

    from fsdp_sync.weights import bucket, handles, state_words
    from fsdp_sync.wire import flattened_bucket

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payloads", type=int, default=600)
    a = ap.parse_args()
    mp.set_start_method("spawn")
    buf = handles.empty_shared(1 << 20)
    for n in (56, 198):
        (b,) = bucket.plan_buckets([(f"model.layers.{i}.w", torch.bfloat16, (16, 8)) for i in range(n)], 1 << 30)
        ours, theirs = mp.Pipe()
        proc = mp.Process(target=_child, args=(theirs,))
        proc.start()
        with state_words.pooled():
            for _ in range(a.payloads):
                with handles.make_payloads(flattened_bucket(buf[:b.nbytes], b), 1, ranks=[0]) as ps:
                    ours.send_bytes(ps.payloads[0])
                    ours.recv_bytes()
        ours.send_bytes(b"stop")
        out = ours.recv()
        proc.join()
        print(f"{n} entries, {a.payloads // 2} payloads a mode (us: median, min)")
        for k, (med, low) in out.items():
            print(f"  {k:15s} {med:7.1f} {low:7.1f}")


if __name__ == "__main__":
    main()
