"""What a failed sync notes does not pile up over a long run in one process (H90: an RL run syncs
thousands of times; `fsdp-sync soak`, tests/test_soak.py, watches RSS, fds, threads and segments).

- `fleet.note_partial` / a failed commit (`fleet.end_all`) note the replicas that kept part of a
  failed update, per thread, for the manager to take (`fleet.take_noted`: it keeps generation
  paused there). A caller with no manager (verl's adapter: `TensorTransport.send`) takes none:
  each failed sync left one name behind for the thread's life (50 failed commits, 50 names).
  Now a sync starts by dropping what an earlier one noted and nobody took (`fleet.forget_noted`):
  at most the last sync's names, which its own error said already; the sync just failed is still
  the manager's to take (tests/test_h61_tensor_buckets.py, tests/test_h83_serve_fleet.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

from fsdp_sync import fleet
from fsdp_sync.config import SyncConfig
from fsdp_sync.topology import SyncError
from fsdp_sync.transport import SyncContext, SyncStats
from fsdp_sync.transport.tensor import TensorTransport
from test_h61_tensor_buckets import TOPO, Engine, _module

pytestmark = pytest.mark.timeout(60)


class CommitFails(Engine):
    """Takes every call, then fails its commit (SGLang's post-processing failing, say)."""

    def end_weight_update(self, weight_version=None, abort=False) -> bool:
        self.log.append("abort" if abort else "commit")
        if not abort:
            raise RuntimeError("post-processing failed (injected)")
        return True


class Bare:
    """No update bracket: each call applied as it came; refuses the third."""

    def __init__(self) -> None:
        self.inner = Engine(refuse_at=2)

    def update_weights_from_tensor(self, *a, **kw):
        return self.inner.update_weights_from_tensor(*a, **kw)


def _noted_now() -> int:
    """How many names this thread's notes hold, without taking them."""
    return len(fleet._noted.get(threading.current_thread(), []))


@pytest.mark.parametrize("make, said", [(CommitFails, "post-processing failed"),
                                        (Bare, "could not drop any calls it took")])
def test_notes_nobody_takes_do_not_pile_up_one_per_failed_sync(make, said):
    fleet.take_noted()
    cfg = SyncConfig(layout="full", bucket_bytes=16 << 10, dtype=torch.float32)
    module = _module()
    for step in range(6):
        with pytest.raises(SyncError) as info:
            TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [make()], step, SyncStats()))
        # what the user must be told is still in the error it belongs to
        assert said in str(info.value) + "".join(getattr(info.value, "__notes__", [])), info.value
        assert _noted_now() == 1, (step, fleet._noted.get(threading.current_thread()))  # before: step + 1
    # the last failed sync's note is still there for a manager to take, then gone
    assert fleet.take_noted() == ["replica 0"] and fleet.take_noted() == []


def test_a_passing_sync_drops_an_earlier_failed_syncs_untaken_note():
    fleet.take_noted()
    cfg = SyncConfig(layout="full", bucket_bytes=16 << 10, dtype=torch.float32)
    module = _module()
    with pytest.raises(SyncError):
        TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [CommitFails()], 0, SyncStats()))
    assert _noted_now() == 1
    TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [Engine()], 1, SyncStats()))
    assert fleet.take_noted() == []        # before: ['replica 0'], a sync later
