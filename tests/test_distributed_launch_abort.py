"""A failure while trainer rank 0 posts a bucket's sends (after the engines were told to receive it)
tears the update group down at once, and the next sync remakes it (soak audit, defect 1).

Before: on the per-rank path (`_launch_ranks`, the default into the reference engine) an error or a
Ctrl-C there left the engines in their receive; the abort waited for their lock until the receive
timed out (``update_recv_timeout_s``, 60 s by default), the group was never marked broken, and
every later sync failed at once with gloo's "Connection closed by peer" until a new manager was
made. A Ctrl-C in the full path's `_launch` (between the requests and the broadcast) did the same.

In-process, one trainer rank, the reference engine at tp 2, ``update_recv_timeout_s=20`` and
``dist_timeout_s=3``: the code before fails the timing assertion instead of hanging the run.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from test_distributed_failures import _engine, _manager, _module, _shutdown

RECV_TIMEOUT_S = 20.0     # the engine's receive timeout: what the failed sync waited before


def _step(module, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    module(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad
                p.grad = None


def _sync(manager) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    try:
        with manager:
            pass
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included: the test reads it
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, call, raised", [
    ("engine", "isend", RuntimeError),           # per-rank buckets: a gloo send error
    ("engine", "isend", KeyboardInterrupt),      # per-rank buckets: Ctrl-C among the sends
    ("full", "broadcast", KeyboardInterrupt),    # full tensors: Ctrl-C before the broadcast
])
def test_a_failure_while_posting_the_sends_drops_the_group_and_the_next_sync_works(
        monkeypatch, layout, call, raised):
    engine, manager = _engine(tp=2, update_recv_timeout_s=RECV_TIMEOUT_S), None
    try:
        module = _module()
        manager = _manager(module, engine, f"dist_launch_abort_{layout}_{raised.__name__}",
                           dist_timeout_s=3, bucket_bytes=8 << 10, layout=layout)
        err, _ = _sync(manager)
        assert err is None, err
        assert manager.stats.extra["layout"] == layout
        _step(module, 0)

        real, calls = getattr(dist, call), [0]

        def failing(*a, **kw):     # the 2nd send: the engines are already in their receive
            calls[0] += 1
            if calls[0] == 2:
                raise raised(f"simulated failure in dist.{call}")
            return real(*a, **kw)

        monkeypatch.setattr(dist, call, failing)
        err, seconds = _sync(manager)
        monkeypatch.setattr(dist, call, real)
        assert calls[0] >= 2, "the hook never ran"
        assert isinstance(err, raised) or raised is RuntimeError and "simulated failure" in str(err), \
            repr(err)
        # it ends at once (0.1 s): not at the engine's receive timeout, nor at dist_timeout_s
        # waiting for answers an engine still in its receive cannot give
        assert seconds < 2.5, (f"the failed sync took {seconds:.1f} s (dist_timeout_s=3; the engine's "
                               f"receive times out after {RECV_TIMEOUT_S} s)")
        transport = manager.transport
        assert transport.broken or transport.pg is None, "the group was left as if usable"

        _step(module, 1)     # the next sync remakes the group and delivers the new weights exactly
        err, _ = _sync(manager)
        assert err is None, f"the sync after the failure: {err!r}"
        full = dict(module.state_dict())
        got = dict(engine.named_full_tensors())
        assert got and all(torch.equal(t, full[k]) for k, t in got.items()), \
            [k for k, t in got.items() if not torch.equal(t, full[k])]
    finally:
        if manager is not None:
            manager.close()
        _shutdown(engine)
