"""A/B of the FP8 block quantizer on this device, one process, interleaved: the old quantize_block
(+ the scale's copy into the bucket) against the new one (scale written in place). qwen2-1500m's
7 quantized weights a layer, bf16, 28 layers' worth per round."""
import math, statistics, sys, time, torch
from fsdp_sync.weights import fp8

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"

def old_qb(name, w, block=fp8.BLOCK, *, out=None, check=True):
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    x = w.reshape(-1, n, k)
    xv = x.view(-1, nb, bn, kb, bk)
    amax = torch.maximum(xv.amax(dim=(2, 4), keepdim=True), xv.amin(dim=(2, 4), keepdim=True).neg())
    sf = amax.to(torch.float32).clamp(min=fp8.AMAX_FLOOR) / fp8.FP8_MAX
    scale = sf.reshape(*lead, nb, kb).contiguous()
    torch.div(xv, sf, out=out.view(-1, nb, bn, kb, bk))
    return out, scale

shapes = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]
ws = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
outs = [torch.empty(s, dtype=torch.float8_e4m3fn, device=dev) for s in shapes]
souts = [torch.empty(fp8.scale_shape(s), dtype=torch.float32, device=dev) for s in shapes]
fp8.cast_on_store(torch.device(dev))

def run_old():
    for w, o, so in zip(ws, outs, souts):
        _, s = old_qb("w", w, out=o, check=False)
        so.copy_(s)

def run_new():
    for w, o, so in zip(ws, outs, souts):
        fp8.quantize_block("w", w, out=o, scale_out=so, check=False)

def timed(f, layers=28):
    torch.cuda.synchronize() if dev == "cuda" else None
    t0 = time.perf_counter()
    for _ in range(layers):
        f()
    torch.cuda.synchronize() if dev == "cuda" else None
    return time.perf_counter() - t0

for f in (run_old, run_new):
    f()
# same bits
run_old(); a = [o.clone() for o in outs] + [s.clone() for s in souts]
run_new(); b = [o.clone() for o in outs] + [s.clone() for s in souts]
assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)), "bits differ"
old, new = [], []
for _ in range(7):
    old.append(timed(run_old)); new.append(timed(run_new))
nbytes = 28 * sum(math.prod(s) * 2 for s in shapes)
mo, mn = statistics.median(old), statistics.median(new)
print(f"A/B quantizer on {dev}: 196 tensors, {nbytes / 2**20:.0f} MiB bf16: old {mo * 1e3:.2f} ms "
      f"({nbytes / mo / 1e9:.0f} GB/s), new {mn * 1e3:.2f} ms ({nbytes / mn / 1e9:.0f} GB/s); bits identical")
