"""Our payloads in a process where SGLang's own ``monkey_patch_torch_reductions`` ran.

The patch (``sglang.srt.utils.patch_torch``; verl's weight-sync utilities and SGLang's
``MultiprocessingSerializer`` callers apply it) replaces torch's ``reduce_tensor`` process-wide with
a wrapper that fails on every CPU tensor, and binds torch's module name ``rebuild_cuda_tensor`` to
SGLang's wrapper. In a subprocess (the patch cannot be undone) that applied it:

- CPU payloads (tagged dict, tagged flattened bucket) still round-trip bit for bit through
  `open_payload`, and through SGLang's own ``MultiprocessingSerializer.deserialize``;
- a CUDA payload (torch's original reducer made to answer for one tensor as it does for a CUDA
  tensor: it returns whatever the module name holds, here SGLang's wrapper) names torch's
  ``rebuild_cuda_tensor``, never ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``;
  it is byte for byte the payload made before the patch; our `open_payload` and SGLang's
  deserializer both get past their allow-lists and stop only at the device (no GPU here:
  ours names the UUID it cannot see, SGLang's wrapper says ``Invalid device_uuid``).

Not checked here (needs a GPU): opening a real CUDA IPC handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parent.parent.parent

_SCRIPT = r"""
import json, traceback
import torch
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from fsdp_sync.weights import bucket, handles

UUID = "GPU-6f1d2a3b-0000-4c5d-8e9f-0123456789ab"
handles.device_uuid = lambda index: UUID          # (no CUDA here)
marked = handles.empty_shared(4000).view(torch.float32)
torch_reduce = reductions.reduce_tensor

def cuda_shaped_reduce(t):
    # torch's reduce_tensor for a CUDA tensor: the module's rebuild_cuda_tensor, read at call time
    if t.data_ptr() != marked.data_ptr():
        return torch_reduce(t)
    return (reductions.rebuild_cuda_tensor,
            (torch.Tensor, t.size(), t.stride(), 0, torch.storage.TypedStorage, t.dtype, 0,
             bytes(range(64)), 4000, 0, False, b"/torch_4242_1234567890", 3, bytes(64), True))

reductions.reduce_tensor = cuda_shaped_reduce
before = handles.make_payloads(marked, 1, tagged=False)
monkey_patch_torch_reductions()          # keeps cuda_shaped_reduce as _reduce_tensor_original
out = {"patched": reductions.reduce_tensor.__module__ == "sglang.srt.utils.patch_torch"
                  and reductions.rebuild_cuda_tensor.__module__ == "sglang.srt.utils.patch_torch"}
try:
    ForkingPickler.dumps(torch.ones(2))
    out["torch_cpu_pickle"] = "ok"
except IndexError:
    out["torch_cpu_pickle"] = "IndexError"

def same_bits(got, want):
    return (got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got.view(torch.uint8), want.view(torch.uint8)))

def cpu_round_trip():
    g = torch.Generator().manual_seed(5)
    raw = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    tensors = {"norm": raw(6).view(torch.bfloat16), "step": raw(16).view(torch.int64),
               "w8": raw(21).view(torch.float8_e4m3fn).view(7, 3), "f": torch.randn(4, 3, generator=g)}
    (b,) = bucket.plan_buckets([bucket.TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    flat = bucket.flatten(b, tensors, out=handles.empty_shared(b.nbytes))
    bucket_obj = {"flattened_tensor": flat, "metadata": bucket.sglang_metadata(b)}
    for obj in (tensors, bucket_obj):
        with handles.make_payloads(obj, 2) as ps:
            for rank in (0, 1):
                rec = handles.open_payload(ps.payloads[rank], rank)
                for name, t in obj.items():
                    if isinstance(t, torch.Tensor):
                        assert same_bits(rec.value[name], t), name
                rec.ack()
    ps = handles.make_payloads(bucket_obj, 1, output_str=True, tagged=False)   # as SGLang gets them
    got = MultiprocessingSerializer.deserialize(ps.payloads[0])
    assert same_bits(got["flattened_tensor"], flat)
    del got
    ps.release(require_ack=False)

def cuda_payload():
    after = handles.make_payloads(marked, 1, tagged=False)
    data = after.payloads[0]
    assert b"patch_torch" not in data and b"_modified" not in data, f"names the wrapper: {data[:90]!r}"
    assert b"torch.multiprocessing.reductions" in data and b"rebuild_cuda_tensor" in data
    assert data == before.payloads[0], "the CUDA payload changed with the patch"
    try:
        handles.open_payload(data)
        raise AssertionError("a CUDA payload opened without CUDA")
    except handles.HandleError as exc:
        assert f"names CUDA device '{UUID}', which this process cannot see" in str(exc), exc
    try:
        MultiprocessingSerializer.deserialize(data)
        raise AssertionError("SGLang opened a CUDA payload without CUDA")
    except Exception as exc:   # SGLang's wrapper, called by torch's name: past its allow-list
        assert f"Invalid device_uuid={UUID}" in str(exc), repr(exc)
    after.release(require_ack=False)

for check in (cpu_round_trip, cuda_payload):
    try:
        check()
        out[check.__name__] = "ok"
    except Exception:
        out[check.__name__] = traceback.format_exc(limit=-3)
before.release(require_ack=False)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(200)
def test_payloads_in_a_process_sglang_patched():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCRIPT], capture_output=True,
                          text=True, timeout=180, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"the patched process failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    got = json.loads(line[len("RESULT "):])
    # the patch ran and bites torch's own pickling of a CPU tensor, as it does in verl's processes
    assert got.pop("patched") is True and got.pop("torch_cpu_pickle") == "IndexError", got
    assert got == {"cpu_round_trip": "ok", "cuda_payload": "ok"}, "\n".join(got.values())
