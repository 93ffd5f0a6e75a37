"""What fsdp_sync's verl adapter's flattened packing sends (`make test-verl`).

- The flattened packing (`stream.BucketBuffer`) with sizes that are not multiples of the 16-byte
  alignment: bucket_mb=0.1, an odd tensor larger than its bucket, an odd bf16 tensor over 1 MiB;
  each payload, opened as the engine opens it, holds the tensors bit for bit.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


# --------------------------------------------------------------------------- unaligned buckets

@pytest.mark.parametrize("bucket_bytes, tensors", [
    # 400 B + 104456 B = 104856 B fit a 104857 B bucket, but padded to 16 B they need 104864
    (int(0.1 * 2**20), [("a", torch.arange(100.0)), ("b", torch.arange(26114.0) - 7.5)]),
    # 20 B, larger than its 16 B bucket: a buffer of its own, padded to 32 B
    (16, [("w", torch.arange(5.0) + 0.25)]),
    # 2000002 B of bf16 over a 1 MiB bucket, then small odd tensors around it
    (1 << 20, [("s", torch.arange(3.0)),
               ("w", torch.linspace(-3, 3, 1000001, dtype=torch.bfloat16)),
               ("t", torch.arange(7, dtype=torch.int32))]),
], ids=["bucket_mb_0.1", "odd_tensor_over_bucket", "odd_bf16_over_1mib"])
def test_unaligned_sizes_are_packed_and_sent_bit_for_bit(bucket_bytes, tensors):
    """Before: the first case raised 'too many values to unpack' (the buffer accepted what the
    bucket plan split in two), the others 'a flattened bucket of 32 bytes cannot be read from a
    buffer of 20 bytes' (the buffer was sized to the unpadded end)."""
    import types

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.integrations import verl as plugin
    from fsdp_sync.transport import SyncStats
    from fsdp_sync.weights import handles
    from fsdp_sync.wire import open_flattened_bucket

    a = object.__new__(plugin.SGLangAdapter)     # its __new__ reads a verl config
    a.sync, a._buffer_hint, a._pack_s, a._digest_s = SyncConfig(bucket_bytes=bucket_bytes), 0, 0.0, 0.0
    a._ipc_device, a._sent = None, None
    topo = types.SimpleNamespace(tp_size=1, tp_rank=0)
    got = {}
    for call in a._flattened_calls(iter(tensors), topo, SyncStats()):
        received = handles.open_payload(call.wire, 0)
        for name, t in open_flattened_bucket(received.value):
            got[name] = t.clone()
        del received
        for ps in call.sets:
            ps.release(require_ack=False)
        call.on_release()
    assert list(got) == [n for n, _ in tensors]
    for name, t in tensors:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
