"""Open flattened-bucket payloads with SGLang's own code, the way an SGLang TP worker does.

``python sglang_open.py FILE...`` (``.b64`` files hold base64 text, others raw bytes), one file per
payload, each opened once. For each: SGLang's payload normalization (what ``Engine`` and the
tokenizer manager apply), ``monkey_patch_torch_reductions()`` then
``MultiprocessingSerializer.deserialize`` (``TpModelWorker.deserialize_own_rank``), metadata
converted to ``FlattenedTensorMetadata`` by attribute access and the tensors rebuilt by
``FlattenedTensorBucket.reconstruct_tensors`` (the model runner's
``_update_weights_from_flattened_bucket``). Prints JSON: keys and digests per file.
"""

from __future__ import annotations

import hashlib
import json
import sys

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


if __name__ == "__main__":
    print(json.dumps([open_one(p) for p in sys.argv[1:]]))
