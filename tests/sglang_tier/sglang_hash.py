"""SGLang's own GPU tensor hash (``sglang/kernels/ops/memory/gpu_tensor_hash.py``, its Triton
kernels) run by Triton's interpreter on CPU, beside `engines.sglang.checksums.gpu_hash`. Run in the
SGLang tier venv; prints JSON ``[[label, sglang's, ours], ...]``.

``TRITON_INTERPRET=1`` is set before triton is imported (it decides at ``@triton.jit`` time). The
kernel's driver asserts ``tensor.is_cuda``; a tensor subclass that answers True lets the same
driver (grid, seeds, tree reduction, splitmix64 finish) run unchanged on CPU memory.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import sglang.kernels.ops.memory.gpu_tensor_hash as g  # noqa: E402

from fsdp_sync.engines.sglang.checksums import gpu_hash  # noqa: E402


class _Cuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


def main() -> list:
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("f32 [1000, 37] (5 tiles)", torch.randn(1000, 37, generator=gen), {}),
        ("bf16 [129, 65] (odd element count)", torch.randn(129, 65, generator=gen).to(torch.bfloat16), {}),
        ("uint8 [7] (padded to 2 words)", torch.randint(0, 256, (7,), generator=gen, dtype=torch.uint8), {}),
        ("f32 non-contiguous [64, 48].T", torch.randn(64, 48, generator=gen).t(), {}),
        ("f32 [3000] 16-word tiles, 4 reduction rounds", torch.randn(3000, generator=gen),
         {"tile_words": 16, "reduce_chunk": 4}),
        ("f16 [1] (one word)", torch.tensor([1.5], dtype=torch.float16), {}),
        ("f32 [0]", torch.empty(0), {}),
    ]
    out = []
    for label, t, kw in cases:
        theirs = g.gpu_tensor_hash(t.as_subclass(_Cuda), block_words=16 if "tile_words" in kw else 256, **kw)
        ours = gpu_hash(t, tile_words=kw.get("tile_words", 8192))
        out.append([label, f"{theirs:016x}", f"{ours:016x}"])
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
    sys.stdout.flush()
