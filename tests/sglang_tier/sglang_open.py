"""Open flattened-bucket payloads with SGLang's own code, the way an SGLang TP worker does.

``python sglang_open.py FILE...`` (``.b64`` files hold base64 text, others raw bytes), one file per
payload, each opened once, in a process of its own: a child forked from this one, which has
imported SGLang's modules and opened nothing (a TP worker opens only its own rank's payload).
For each: SGLang's payload normalization (what ``Engine`` and the
tokenizer manager apply), ``monkey_patch_torch_reductions()`` then
``MultiprocessingSerializer.deserialize`` (``TpModelWorker.deserialize_own_rank``), metadata
converted to ``FlattenedTensorMetadata`` by attribute access and the tensors rebuilt by
``FlattenedTensorBucket.reconstruct_tensors`` (the model runner's
``_update_weights_from_flattened_bucket``). Prints JSON: keys and digests per file.

``python sglang_open.py --serve``: the same for every line of stdin (a JSON list of files), one
JSON line each on stdout (``{"results": [...]}`` or ``{"error": ...}``), until stdin closes; the
tests pay SGLang's imports (seconds of CPU) once per module instead of once per TP rank.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import traceback

import torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

try:   # 0.5.23; older releases passed the payloads through as they came
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payload as normalize
except ImportError:  # pragma: no cover
    normalize = None


def digest(t: torch.Tensor) -> list:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def open_one(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    payload = data.decode("ascii") if path.endswith(".b64") else data
    if normalize is not None:
        payload = normalize(payload)
    monkey_patch_torch_reductions()
    obj = MultiprocessingSerializer.deserialize(payload)
    metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                        start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                for m in obj["metadata"]]
    bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metadata)
    named = bucket.reconstruct_tensors()
    return {"keys": sorted(obj), "digests": {n: digest(t) for n, t in named}}


def open_forked(path: str) -> dict:
    """`open_one` in a child forked from this process; its answer comes back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the TP worker: opens its payload, answers, exits
        os.close(r)
        code = 1
        try:
            data = json.dumps(open_one(path)).encode()
            gc.collect()                           # the rebuilt tensors are closed before the exit
            with os.fdopen(w, "wb") as f:
                f.write(data)
            code = 0
        except BaseException:                      # noqa: BLE001 - reported by the parent
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        raise RuntimeError(f"opening {path} failed in its process (exit {code}; its error above)")
    return json.loads(data)


def serve() -> None:
    gc.collect()
    gc.freeze()    # the imports' objects: not walked by the children's collections nor at exit
    for line in iter(sys.stdin.readline, ""):
        try:
            out = {"results": [open_forked(p) for p in json.loads(line)]}
        except Exception as exc:                   # noqa: BLE001 - the test reports it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print(json.dumps([open_forked(p) for p in sys.argv[1:]]))
