"""`tp_batch.gather` of verl ``DataProto`` batches on CUDA at infer-TP 2, emulated on a CPU with
the real ``DataProto`` (its pickle is ``torch.save`` of its TensorDict, loaded with
``map_location=None`` where CUDA is present: on the device index it was saved from).

Before: rank 0 got rank 1's TensorDict on ``cuda:1`` and ``DataProto.concat`` failed in
``torch.cat`` (two devices), on both ranks. The emulation (`test_tp_batch_devices`) gives the
received leaves back the sender's ``cuda:<rank>`` where they were sent from a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_tp_batch_devices import ON, _OnCuda, fake_cuda_to, run_two_ranks  # noqa: E402


def _unpickle_on_sender_device(data: bytes, sent):
    """``pickle.loads`` as on a GPU host: the leaves land where the sender had them."""
    import pickle

    got = pickle.loads(data)
    devices = {k: v.device for k, v in sent.batch.items()}
    for key, device in devices.items():
        if device.type == "cuda":
            got.batch[key] = got.batch[key].as_subclass(ON[device.index])
    return got


def test_data_proto_batches_on_cuda_are_gathered_onto_each_ranks_own_device(monkeypatch):
    from verl import DataProto

    fake_cuda_to(monkeypatch)
    batches = [DataProto.from_dict(
        tensors={"input_ids": (torch.arange(4 * (1 + r)).view(1 + r, 4) + 100 * r).as_subclass(ON[r])},
        non_tensors={"uid": np.array([f"r{r}"] * (1 + r), dtype=object)}) for r in (0, 1)]
    out = run_two_ranks(monkeypatch, batches, unpickle=_unpickle_on_sender_device)
    for r in (0, 1):
        assert not isinstance(out[r], Exception), out[r]
        full, sizes = out[r]
        assert sizes == [1, 2]
        ids = full.batch["input_ids"]
        assert isinstance(ids, _OnCuda) and ids.device == torch.device("cuda", r), (r, type(ids))
        assert ids.tolist() == [[0, 1, 2, 3], [100, 101, 102, 103], [104, 105, 106, 107]]
        assert list(full.non_tensor_batch["uid"]) == ["r0", "r1", "r1"]
        assert batches[r].batch["input_ids"].device == torch.device("cuda", r)   # the caller's kept
