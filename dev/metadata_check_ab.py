"""A receiver's check of bucket metadata: `entries_from_metadata` on every payload against
`bucket.KnownMetadata` (checked in full once, then taken while it is the same), on freshly
unpickled metadata of qwen2-1500m's engine-layout tensors (`dev/qwen2-1500m-tensors.yaml`) cut into
400 KiB buckets by `plan_buckets` (six, as the H200 rows' 512 MiB buckets cut the real model),
interleaved; the unpickling alone beside them.

Usage: PYTHONPATH=. .venv/bin/python dev/metadata_check_ab.py
"""

from __future__ import annotations

import pickle
import statistics
import timeit

import torch

from fsdp_sync.models import load_config
from fsdp_sync.weights import bucket
from fsdp_sync.weights.layout import layout_for


def main() -> None:
    torch.set_num_threads(1)
    layout = layout_for(load_config("dev/qwen2-1500m-tensors.yaml"), 1)
    metas = [bucket.TensorMeta(n, torch.bfloat16, s) for n, s in layout.engine_shapes().items()]
    plan = bucket.plan_buckets(metas, 400 * 1024)
    blobs = [pickle.dumps(bucket.sglang_metadata(b), protocol=5) for b in plan]
    known = bucket.KnownMetadata()
    took: dict[str, list[float]] = {"checked every time": [], "KnownMetadata": []}
    for _ in range(15):
        for name, fn in (("checked every time", bucket.entries_from_metadata), ("KnownMetadata", known.entries)):
            took[name].append(timeit.timeit(lambda: [fn(pickle.loads(b)) for b in blobs], number=20) / 20)
    alone = timeit.timeit(lambda: [pickle.loads(b) for b in blobs], number=20) / 20
    print(f"{len(plan)} buckets of {[len(b.entries) for b in plan]} entries; ms for all of them "
          f"(median, min of 15), unpickling alone {alone * 1e3:.3f}:")
    for name, v in took.items():
        print(f"  {name:20s} {statistics.median(v) * 1e3:.3f}  {min(v) * 1e3:.3f}")


if __name__ == "__main__":
    main()
