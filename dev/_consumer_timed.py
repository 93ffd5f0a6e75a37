"""Consumer side of dev/measure_handles.py: opens payloads, unflattens, reports times and fds."""
import sys, os, time, json, pickle
from fsdp_sync.weights import handles, bucket
def fds(): return len(os.listdir("/proc/self/fd"))
payloads = pickle.load(open(sys.argv[1], "rb"))
f0 = fds()
t = time.perf_counter()
recv = [handles.open_payload(p, 0) for p in payloads]
t_open = time.perf_counter() - t
f_held = fds() - f0
t = time.perf_counter()
n = 0
for r in recv:
    v = r.value
    if isinstance(v, dict):
        n += len(bucket.unflatten(v["flattened_tensor"], bucket.entries_from_metadata(v["metadata"])))
    else:
        n += 1
t_unflat = time.perf_counter() - t
for r in recv: r.ack()
del recv
print(json.dumps({"open_ms": t_open * 1000, "unflatten_ms": t_unflat * 1000, "fds_held": f_held, "tensors": n}))
