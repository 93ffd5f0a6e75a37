"""A stand-in for an engine's infer-TP worker, run as an independent process (not a child made by
multiprocessing: it shares no authkey and no resource-sharer with the producer).

Reads JSON requests, one a line, on stdin and answers one JSON line each on stdout:

- ``{"op": "open", "items": [{"payload", "str", "rank", "name"}], "ack": bool, "twice": bool}``:
  opens each payload with `handles.open_payload(payload, rank)`, rebuilds its tensors (a flattened
  bucket is unflattened with its metadata; a dict gives its tensors; a bare tensor is named
  ``name``), answers ``{"results": [{"tensors": {name: [dtype, shape, sha256]}} | {"error": str}]}``
  and acknowledges (unless ``ack`` is false). With ``twice`` it opens the payload again after the
  first open and reports that second attempt's error as ``"again"``. With ``keep`` each opened
  value is held (as an engine worker keeps a reused bucket buffer mapped) until ``{"op": "drop"}``,
  and each result also says ``"ptr"``, the data pointer of its first tensor's storage here.
- ``{"op": "stats"}``: ``{"fds": open file descriptors, "pid": ...}``.
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import base64
import json
import os
import sys

import torch

from fsdp_sync.weights import bucket, handles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import digest, num_fds  # noqa: E402


def _tensors(value, name):
    if isinstance(value, torch.Tensor):
        return [(name or "tensor", value)]
    if isinstance(value, dict) and "flattened_tensor" in value and "metadata" in value:
        entries = bucket.entries_from_metadata(value["metadata"])
        return bucket.unflatten(value["flattened_tensor"], entries)
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    raise TypeError(f"payload holds {type(value).__name__}, not tensors")


_KEPT: list = []     # values held by ``keep`` until ``drop``


def _open(item: dict, ack: bool, twice: bool, keep: bool = False) -> dict:
    payload = item["payload"] if item["str"] else base64.b64decode(item["payload"])
    try:
        received = handles.open_payload(payload, item["rank"])
    except Exception as exc:  # noqa: BLE001 - reported to the producer
        return {"error": f"{type(exc).__name__}: {exc}"}
    named = _tensors(received.value, item["name"])
    out = {"tensors": {n: digest(t) for n, t in named}}
    if keep:
        _KEPT.append(received.value)
        out["ptr"] = named[0][1].untyped_storage().data_ptr() if named else None
    if twice:
        try:
            handles.open_payload(payload, item["rank"])
            out["again"] = None
        except Exception as exc:  # noqa: BLE001
            out["again"] = f"{type(exc).__name__}: {exc}"
    if ack:
        received.ack()
    del received
    return out


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            break
        if op == "open":
            reply = {"results": [_open(it, req.get("ack", True), req.get("twice", False),
                                       req.get("keep", False)) for it in req["items"]]}
        elif op == "drop":
            _KEPT.clear()
            reply = {"dropped": True}
        elif op == "stats":
            reply = {"fds": num_fds(), "pid": os.getpid()}
        else:
            reply = {"error": f"unknown op {op!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
