"""Opening the distributed method's update group leaves no engine blocked when it fails.

An engine told ``init_weights_update_group`` blocks in the join (its generation waiting) and drops
a group of that name it had. Before the fix the engines were told first and the trainer side
checked after: a second manager on a name a first one (not closed) holds was refused, but the
engine had already replaced the first manager's group and waited out its own timeout in the join
(generation 60 s late, the first manager's next sync "Connection closed by peer"); a
``dist_master_port`` held by another program failed at once on the trainer while the engine's
workers hung on that program's socket (generation still blocked after 210 s, the engine's
``call_timeout_s`` 900 s); one engine refusing left the others waiting in the rendezvous until
their timeout; and an engine told a port where some program other than a store listens waited
for that program's answer forever. Each case runs on one trainer rank in a fresh process (torch's
group names are per process) with engine timeouts short enough (3-30 s) that the unfixed code
fails the test instead of hanging it; the fixed code answers in about a second.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

from _util import timed_sync

FAST_S = 5.0     # what "at once" means here: the unfixed code took 20-900 s


def _engine(tp, **kw):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import load_config

    kw = {"update_recv_timeout_s": 20.0, "call_timeout_s": 30.0, **kw}
    return ReferenceEngine(model_config=load_config("tiny"), tp_size=tp, dtype=torch.float32,
                           kv_cache_tokens=64, **kw)


def _manager(module, engines, **kw):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.manager import FSDPShardingManager

    return FSDPShardingManager(module, engines, config=SyncConfig(
        method="distributed", dtype=torch.float32, dist_timeout_s=60, **kw))


def _generate_seconds(engine) -> float:
    t0 = time.monotonic()
    out = engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert len(out[0]) == 2, out
    return time.monotonic() - t0


def _synced(engine, module) -> bool:
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.weights import export

    return engine.weights_checksum() == checksum_named_tensors(export.iter_params(module, dtype=torch.float32))


def _second_manager_same_name(rank, world):
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=0)
    engine = _engine(2)
    first = second = None
    try:
        first = _manager(module, engine)
        assert timed_sync(first)[0] is None
        second = _manager(module, engine)       # the first was not closed: its group holds the name
        err, seconds = timed_sync(second)
        gen_s = _generate_seconds(engine)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.25)
        again = timed_sync(first)
        return {"err": err, "seconds": seconds, "generate_s": gen_s, "first_again": again[0],
                "first_synced": _synced(engine, module)}
    finally:
        for m in (second, first):
            if m is not None:
                m.close()
        engine.shutdown()


@pytest.mark.timeout(120)
def test_a_second_manager_on_a_taken_group_name_is_refused_before_the_engine_is_told():
    (res,) = run_ranks(_second_manager_same_name, 1, timeout_s=100, env=spawn_env())
    err = res["err"]
    assert err is not None and "making the weight-update group 'weight_update_group' failed" in err, res
    assert "exists in this process already" in err and "no engine was told to join" in err, res
    assert res["seconds"] < FAST_S and res["generate_s"] < FAST_S, res
    # the first manager's group is as it was: its next sync goes through, bit exact
    assert res["first_again"] is None and res["first_synced"], res


def _port_held_by_another_program(rank, world):
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    with socket.socket() as other:          # accepts connections, speaks no store protocol
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        module = build_model(load_config("tiny"), seed=0)
        engine = _engine(2)
        manager = _manager(module, engine, dist_master_port=port)
        try:
            err, seconds = timed_sync(manager)
            gen_s = _generate_seconds(engine)
            manager.close()
            manager = _manager(module, engine)     # a port the OS picks: the engine syncs
            ok = timed_sync(manager)[0]
            return {"err": err, "seconds": seconds, "generate_s": gen_s, "port": port,
                    "then": ok, "synced": _synced(engine, module)}
        finally:
            manager.close()
            engine.shutdown()


@pytest.mark.timeout(120)
def test_a_dist_master_port_another_program_holds_fails_before_the_engine_is_told():
    (res,) = run_ranks(_port_held_by_another_program, 1, timeout_s=100, env=spawn_env())
    err = res["err"]
    assert err is not None and f"dist_master_port={res['port']}" in err and "EADDRINUSE" in err, res
    assert "No engine was told to join" in err, res
    assert res["seconds"] < FAST_S and res["generate_s"] < FAST_S, res
    assert res["then"] is None and res["synced"], res


def _one_engine_refuses(rank, world, stall):
    import os

    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=0)
    if stall:     # worker 0 reaches the join after the trainer gave the group up
        os.environ.update(FSDP_SYNC_FAULT="worker:0:join_group:stall", FSDP_SYNC_FAULT_STALL_S="2")
    live = _engine(2)
    os.environ.pop("FSDP_SYNC_FAULT", None)
    dead = _engine(1)
    dead.shutdown()     # answers init_weights_update_group at once: "the engine was shut down"
    manager = _manager(module, [live, dead])
    try:
        err, seconds = timed_sync(manager)
        gen_s = _generate_seconds(live)
        manager.close()
        manager = _manager(module, live)
        ok = timed_sync(manager)[0]
        return {"err": err, "seconds": seconds, "generate_s": gen_s, "then": ok,
                "synced": _synced(live, module)}
    finally:
        manager.close()
        live.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stall", [False, True], ids=["in-the-rendezvous", "joins-late"])
def test_an_engine_refusing_the_group_does_not_leave_the_others_in_its_join(stall):
    """Engine 1 refuses; engine 0's workers were told to join. The trainer closes the group's store
    (those in the rendezvous fail at once) and hosts the port again marked called off (one that
    connects later, here worker 0 after a 2 s stall, fails at once too), and waits for them."""
    (res,) = run_ranks(_one_engine_refuses, 1, stall, timeout_s=100, env=spawn_env())
    assert res["err"] is not None and "engine 1 init_weights_update_group" in res["err"], res
    assert "the engine was shut down" in res["err"], res
    assert res["seconds"] < FAST_S + (2 if stall else 0), res
    assert res["generate_s"] < FAST_S, res
    assert res["then"] is None and res["synced"], res


def _told_a_port_another_program_holds(rank, world):
    from fsdp_sync.engines.base import WeightUpdateError

    torch.set_num_threads(1)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        engine = _engine(2, update_recv_timeout_s=3.0)
        try:
            t0 = time.monotonic()
            try:
                engine.init_weights_update_group("127.0.0.1", port, 1, 3, backend="gloo")
                err = None
            except WeightUpdateError as exc:
                err = str(exc)
            return {"err": err, "seconds": time.monotonic() - t0, "port": port,
                    "generate_s": _generate_seconds(engine)}
        finally:
            engine.shutdown()


@pytest.mark.timeout(120)
def test_an_engine_told_a_port_that_is_no_store_gives_up_within_its_timeout():
    """Another trainer tells the engine a port where some other program listens: torch's store
    client waits for that program's answer to its handshake without any timeout (the engine's
    workers held until its call_timeout_s, then the engine unusable); the join now gives up
    within update_recv_timeout_s (3 s here) and says what answered."""
    (res,) = run_ranks(_told_a_port_another_program_holds, 1, timeout_s=100, env=spawn_env())
    assert res["err"] is not None and f"127.0.0.1:{res['port']}" in res["err"], res
    assert "did not answer as a torch.distributed store" in res["err"], res
    assert res["seconds"] < 3.0 + FAST_S and res["generate_s"] < FAST_S, res
