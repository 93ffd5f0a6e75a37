"""Serialize/deserialize time of one handle per parameter against one flattened bucket, the consumer
in an independent process. Usage: PYTHONPATH=. .venv/bin/python dev/measure_handles.py small qwen2-160m"""
import sys, os, time, json, pickle, subprocess, tempfile
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_sync.weights import handles, bucket, export
from fsdp_sync.models import build_model, load_config

def run_consumer(payloads):
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(payloads, f); path = f.name
    out = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "_consumer_timed.py"), path], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    os.unlink(path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)

def measure(label, named):
    res = {"model": label, "tensors": len(named), "MiB": round(sum(t.numel() * t.element_size() for _, t in named) / 2**20, 1)}
    # one handle per parameter (tensors already in shared memory: no copy counted)
    shared = []
    for n, t in named:
        s = handles.empty_shared(t.numel() * t.element_size()).view(t.dtype).view(t.shape); s.copy_(t); shared.append((n, s))
    t0 = time.perf_counter()
    sets = [handles.make_payloads(s, 1) for _, s in shared]
    ser = time.perf_counter() - t0
    pbytes = sum(len(ps.payloads[0]) for ps in sets)
    r = run_consumer([ps.payloads[0] for ps in sets])
    for ps in sets: ps.release()
    res["per_param"] = {"serialize_ms": round(ser * 1000, 1), "deserialize_ms": round(r["open_ms"], 1),
                        "payload_bytes": pbytes,
                        "consumer_fds_held": r["fds_held"], "segments": len(sets) * 2}
    del sets, shared
    # one flattened bucket (all tensors)
    metas = [bucket.TensorMeta.of(n, t) for n, t in named]
    (b,) = bucket.plan_buckets(metas, 1 << 40)
    flat = handles.empty_shared(b.nbytes)
    t0 = time.perf_counter(); bucket.flatten(b, dict(named), out=flat); t_flat = time.perf_counter() - t0
    t0 = time.perf_counter()
    ps = handles.make_payloads({"flattened_tensor": flat, "metadata": bucket.sglang_metadata(b)}, 1)
    ser = time.perf_counter() - t0
    nbytes = len(ps.payloads[0])
    r = run_consumer(ps.payloads)
    ps.release()
    res["bucket"] = {"flatten_ms": round(t_flat * 1000, 1), "serialize_ms": round(ser * 1000, 2),
                     "deserialize_ms": round(r["open_ms"], 2), "unflatten_ms": round(r["unflatten_ms"], 2),
                     "consumer_fds_held": r["fds_held"], "payload_bytes": nbytes}
    return res

if __name__ == "__main__":
    torch.set_num_threads(1)
    for recipe in sys.argv[1:]:
        m = build_model(load_config(recipe), seed=0)
        named = list(export.iter_params(m, dtype=torch.bfloat16))
        for _ in range(2):
            r = measure(recipe, named)
        print(json.dumps(r))
        del m, named
