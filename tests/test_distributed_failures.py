"""The distributed method's failure paths end within their bounds (audit of the distributed method).

Each test runs in-process on one trainer rank with the reference engine (tp 1 or 2) and its own
``dist_group_name`` (torch's group names are per process), with short timeouts so the code before
the fixes fails an assertion instead of hanging the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from _util import timed_sync

UNREACHABLE = "10.255.255.1"     # no host answers: the engine's join waits out its own timeout


def _engine(tp=1, **kw):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import load_config

    kw = {"update_recv_timeout_s": 20.0, "call_timeout_s": 60.0, **kw}
    return ReferenceEngine(model_config=load_config("tiny"), tp_size=tp, dtype=torch.float32,
                           kv_cache_tokens=64, **kw)


def _manager(module, engine, name, **kw):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager

    return FSDPShardingManager(module, engine, config=SyncConfig(
        method="distributed", dtype=torch.float32, dist_group_name=name, **kw))


def _shutdown(engine) -> None:
    """Shut the engine down without waiting for a worker still in a call the test abandoned."""
    for pid in engine.worker_pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    engine.shutdown()


def _module():
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    return build_model(load_config("tiny"), seed=0)


@pytest.mark.timeout(90)
def test_close_after_a_failed_opening_does_not_wait_for_the_engines_join():
    """close() shut its engine-call pool down with wait=True: after an opening that failed (the
    engine told an address it cannot reach), it waited for the engine's abandoned join (50 s with
    dist_timeout_s=5; SGLang's: up to 30 minutes)."""
    engine = _engine()
    try:
        manager = _manager(_module(), engine, "dist_fail_close", dist_timeout_s=3,
                           dist_master_address=UNREACHABLE)
        err, _ = timed_sync(manager)
        assert err is not None and "dist_fail_close" in err, err
        t0 = time.monotonic()
        manager.close()
        assert time.monotonic() - t0 < 3.0, f"close() took {time.monotonic() - t0:.1f} s"
    finally:
        _shutdown(engine)


@pytest.mark.timeout(90)
def test_a_failed_rendezvous_ends_within_dist_timeout_s():
    """After the rendezvous waited out dist_timeout_s, the call-off waited again for the engines'
    answers for min(15 s, dist_timeout_s): a failed opening took twice dist_timeout_s (10.03 s
    with 5). The call-off now counts inside the deadline (one second at least)."""
    engine = _engine()
    try:
        manager = _manager(_module(), engine, "dist_fail_bound", dist_timeout_s=6,
                           dist_master_address=UNREACHABLE)
        err, seconds = timed_sync(manager)
        manager.close()
        assert err is not None and "not every engine TP worker joined within dist_timeout_s=6" in err, err
        assert 5.5 < seconds < 9.5, f"the failed opening took {seconds:.1f} s (dist_timeout_s=6)"
    finally:
        _shutdown(engine)


@pytest.mark.timeout(120)
def test_a_hung_engine_worker_fails_the_sync_within_dist_timeout_s_naming_it(monkeypatch):
    """An engine TP worker stopped (SIGSTOP) mid-bucket: _finish gave up after dist_timeout_s, but
    the abort (end_weight_update) and the group's teardown (destroy_weights_update_group) then
    waited for the engine's lock, held by the stuck request, until call_timeout_s (45 s here
    with dist_timeout_s=10; 900 s by default), and the error named no engine."""
    from fsdp_sync.transport import distributed as dm

    engine = _engine(tp=2, call_timeout_s=30.0)
    stopped = []
    try:
        manager = _manager(_module(), engine, "dist_fail_hung", dist_timeout_s=3,
                           bucket_bytes=32 << 10, layout="full")
        assert timed_sync(manager)[0] is None
        launch = dm.DistributedTransport._launch

        def stop_on_bucket_2(self, engines, *a):
            pending = launch(self, engines, *a)
            if "bucket 2 " in a[-1] and not stopped:
                os.kill(engine.worker_pids[1], signal.SIGSTOP)
                stopped.append(engine.worker_pids[1])
            return pending

        monkeypatch.setattr(dm.DistributedTransport, "_launch", stop_on_bucket_2)
        err, seconds = timed_sync(manager)
        assert stopped, "the hook never ran"
        assert err is not None and "replica 0 never answered" in err, err
        assert "dist_timeout_s=3" in err, err
        assert seconds < 12, f"the sync failed after {seconds:.1f} s (dist_timeout_s=3)"
        # the request given up on still runs (its worker is stopped) on a thread that must not
        # keep the trainer's process from exiting: a ThreadPoolExecutor's thread is joined at
        # exit (a trainer over HTTP lingered 97 s after the error, until the stalled worker woke)
        running = [t for t in threading.enumerate() if t.name.startswith("fsdp_sync-engine")]
        assert running, "no engine call still running: the stopped worker answered?"
        assert all(t.daemon for t in running), [(t.name, t.daemon) for t in running]
        t0 = time.monotonic()
        manager.close()
        assert time.monotonic() - t0 < 3.0
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        _shutdown(engine)


@pytest.mark.timeout(90)
def test_a_manager_dropped_without_close_frees_its_group_name():
    """A manager dropped without close() left its update group in torch's registry (no finalizer):
    every later manager was refused the name ("close() the manager that made it") though that
    manager had been collected."""
    import gc
    import weakref

    from torch.distributed.distributed_c10d import _world

    engine = _engine(tp=1)
    try:
        module = _module()
        manager = _manager(module, engine, "dist_fail_orphan", dist_timeout_s=10)
        assert timed_sync(manager)[0] is None
        gone = weakref.ref(manager.transport)
        del manager
        gc.collect()
        assert gone() is None, "the transport was not collected"
        assert "dist_fail_orphan" not in _world.pg_names.values()
        again = _manager(module, engine, "dist_fail_orphan", dist_timeout_s=10)
        err, _ = timed_sync(again)
        again.close()
        assert err is None, err
    finally:
        _shutdown(engine)
