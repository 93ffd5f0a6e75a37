"""A/B of the FP8 quantizer's block amax on one device, interleaved in one process: the one-step
reduction over both dims of each 128 x 128 block (what `fp8.quantize_block` ran until the H200
measured the quantizer at about 0.3 TB/s) against the two-step one it runs now (over each row's
128 contiguous elements, then over the block's 128 rows), for qwen2-1500m's 7 quantized weights a
layer, 28 layers a round (``--layers``), bf16. Checks that both give the same scales bit for bit,
then prints the median of each over ``--rounds`` and the weights' bf16 bytes per second.

Usage: PYTHONPATH=. python dev/fp8_reductions_ab.py [cuda|cpu] [--rounds 9] [--layers 28]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]


def one_step(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    xv = w.view(1, n // 128, 128, k // 128, 128)
    amax = xv.amax(dim=(2, 4), keepdim=True)
    return torch.maximum(amax, xv.amin(dim=(2, 4), keepdim=True).neg_())


def two_step(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    rows = w.view(1, n, k // 128, 128)
    amax = rows.amax(dim=-1).view(1, n // 128, 128, k // 128).amax(dim=2)
    amin = rows.amin(dim=-1).view(1, n // 128, 128, k // 128).amin(dim=2)
    return torch.maximum(amax, amin.neg_()).view(1, n // 128, 1, k // 128, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--layers", type=int, default=28,
                    help="layers a timed round (tests/test_gpu_check_budget.py: 1, the check alone)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(s, device=dev, generator=gen).to(torch.bfloat16) for s in SHAPES]
    for w in ws:
        assert torch.equal(one_step(w), two_step(w)), f"scales differ for {tuple(w.shape)}"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(f) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(a.layers):
            for w in ws:
                f(w)
        sync()
        return time.perf_counter() - t0

    took: dict[str, list[float]] = {"one step (old)": [], "two steps (new)": []}
    timed(one_step), timed(two_step)          # warm-up
    for _ in range(a.rounds):
        took["one step (old)"].append(timed(one_step))
        took["two steps (new)"].append(timed(two_step))
    nbytes = a.layers * sum(w.numel() * 2 for w in ws)
    print(f"{dev}: the block amax of {a.layers} layers' 7 weights ({nbytes / 2**20:.0f} MiB bf16), scales equal")
    for name, v in took.items():
        med = statistics.median(v)
        print(f"  {name:16s} {med * 1e3:8.2f} ms  {nbytes / med / 1e9:7.1f} GB/s of bf16")


if __name__ == "__main__":
    main()
