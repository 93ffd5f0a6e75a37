"""H53: fsdp_sync's SGLang adapter modules against values read from SGLang itself, in the default
tier (no sglang import): pinned outputs of SGLang 0.5.23's own hashes, and the refusals and
bookkeeping the adapter's mixins owe SGLang's scheduler."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import checksums

# SGLang 0.5.23's ``mm_utils.tensor_hash`` of each CPU tensor, and its Triton ``gpu_tensor_hash``
# of the same bytes (run by Triton's interpreter on CPU, as tests/sglang_tier/sglang_hash.py does),
# computed once in .venv-sglang and pinned here: a change to either algorithm's byte order, word
# padding, tile handling or position mixing changes these.
SGLANG_0523_HASHES = {
    "u8_7": ("d5912133689bcd41", "83d054b971b72fe3"),
    "bf16_3x5": ("95d7b8539737420b", "0c8f7b78d16d0eca"),
    "f32_9000": ("665d175e0e772860", "4ef9f56617495e5e"),
    "f32_T": ("b38aef6b8bf79335", "8a8f1e30a3c7bdcb"),
}


def _cases():
    return {
        "u8_7": torch.arange(7, dtype=torch.uint8) * 37,       # 7 bytes: padded to 2 words
        "bf16_3x5": (torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7 - 1).to(torch.bfloat16),
        "f32_9000": (torch.arange(9000) % 251).to(torch.float32) / 8 - 3,   # 2 tiles, the last partial
        "f32_T": (torch.arange(12, dtype=torch.float32) * 0.25 - 1).reshape(3, 4).t(),  # non-contiguous
    }


@pytest.mark.parametrize("case", sorted(SGLANG_0523_HASHES))
def test_the_hashes_equal_sglangs_own_for_the_same_bytes(case):
    t = _cases()[case]
    cpu, gpu = SGLANG_0523_HASHES[case]
    assert checksums.hex_hash(t, "cpu") == cpu
    assert checksums.hex_hash(t, "gpu") == gpu


def _fake():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_sglang

    return fake_sglang


@pytest.mark.timeout(60)
def test_a_release_older_than_supported_is_refused_before_anything_is_sent():
    """Before: an SGLang reporting 0.4.9 (older than the ``sglang>=0.5.12`` fsdp_sync supports,
    none of its calls read) was synced into as if it were 0.5.12. Now the manager's first-sync
    check (`config_check.check_engine`, asked before any pause or update) refuses it, naming the
    release and the oldest supported; 0.5.12 passes the same check."""
    from fsdp_sync import SyncConfig
    from fsdp_sync.config_check import check_engine

    fake = _fake()

    class Fake049Engine(fake.Fake0512Engine):
        VERSION = "0.4.9"

    module = torch.nn.Linear(2, 2)
    for cls, refused in ((Fake049Engine, True), (fake.Fake0512Engine, False)):
        eng = cls(tp_size=1)
        err = None
        try:
            check_engine(module, sg.SGLangEngine(eng), SyncConfig(method="disk", disk_dir="/nonexistent"),
                         None, where="engine 0")
        except ValueError as exc:
            err = str(exc)
        assert eng.names() == ["get_server_info"], eng.names()       # nothing but the version asked
        if not refused:
            assert err is None, err
            continue
        assert err and "SGLang 0.4.9 is older than the releases fsdp_sync supports (>=0.5.12" in err, err
        assert "upgrade SGLang to >=0.5.12" in err and "in process" in err, err
