"""The manager's batch resharding with uneven batches, and `__exit__` agreeing across ranks
(issue 9 items 1 and 4). One 2-rank job (TP 2, a real reference engine) checks every case."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.weights import export

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    mesh = make_mesh(1, 2)
    topo = SyncTopology.from_mesh(mesh)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) if topo.is_tp_src else None
    out: dict = {}
    try:
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(dtype=torch.float32))
        with manager:
            # item 1: uneven batches round-trip exactly (rank 0: 2 samples, rank 1: 1)
            n = 2 if rank == 0 else 1
            mine = {"ids": torch.arange(n * 3).view(n, 3) + 100 * rank,
                    "tags": [f"r{rank}s{i}" for i in range(n)]}
            full = manager.preprocess_data(mine)
            out["gathered_tags"] = full["tags"]
            back = manager.postprocess_data(full)
            out["round_trip"] = torch.equal(back["ids"], mine["ids"]) and back["tags"] == mine["tags"]
            # ... and with two samples per prompt (repeat_interleave, as rollout.n > 1 does)
            rep = {"ids": full["ids"].repeat_interleave(2, 0),
                   "tags": [t for t in full["tags"] for _ in range(2)]}
            back2 = manager.postprocess_data(rep)
            out["repeat"] = back2["tags"] == [t for t in mine["tags"] for _ in range(2)]
            # keys that differ across ranks: the same error, naming the keys, on both ranks
            odd = {"ids": torch.zeros(1, 3), ("extra" if rank else "other"): [1]}
            try:
                manager.preprocess_data(odd)
                out["keys_error"] = None
            except ValueError as exc:
                out["keys_error"] = str(exc).split(" (rank")[0]
        # a new block: the last block's gathered sizes ([2, 1]) do not carry over to a batch
        # this block never gathered (6 samples split evenly, not [4, 2])
        with manager:
            out["fresh_split"] = manager.postprocess_data({"ids": torch.arange(6)})["ids"].tolist()
        # what the manager logs from here on (issue 36 item 6: a false "restoring ... failed too")
        records: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logging.getLogger("fsdp_sync").addHandler(handler)
        # item 4: an exception inside the block on rank 1 only: rank 1's wins there, rank 0 raises
        try:
            with FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(dtype=torch.float32)):
                if rank == 1:
                    raise KeyError("only on rank 1")
            out["one_rank_exc"] = None
        except (SyncError, KeyError) as exc:
            out["one_rank_exc"] = type(exc).__name__ + ": " + str(exc)
            out["one_rank_notes"] = getattr(exc, "__notes__", [])
        # issue 36 item 6: a user's exception on every rank, restoring fine everywhere: it comes
        # out unchanged (no note, nothing logged), training mode is back, and the next with syncs
        manager = FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(dtype=torch.float32))
        module.train()
        bug = RuntimeError("user bug in rollout")
        try:
            with manager:
                raise bug
        except RuntimeError as exc:
            out["user_exc"] = {"same": exc is bug, "notes": getattr(exc, "__notes__", []),
                               "training": module.training}
        train_step(module, torch.optim.SGD(module.parameters(), lr=0.1),
                   synthetic_batch(cfg.vocab_size, step=1, rank=rank))
        with manager:
            trainer = checksum_named_tensors(export.iter_params(module, dtype=torch.float32))
            out["next_sync"] = engine is None or engine.weights_checksum() == trainer
        # ... but a restoring that does fail (restore_rng on rank 0) is told with the user's exception
        os.environ["FSDP_SYNC_FAULT"] = "trainer:0:restore_rng:raise"
        try:
            with manager:
                raise ValueError("user bug 2")
        except ValueError as exc:
            out["restore_failed_notes"] = getattr(exc, "__notes__", [])
        finally:
            del os.environ["FSDP_SYNC_FAULT"]
        logging.getLogger("fsdp_sync").removeHandler(handler)
        out["logged"] = [r.getMessage() for r in records]
        # item 4: a worker dies during the rollout: the same SyncError on every rank at exit
        try:
            with FSDPShardingManager(module, engine, mesh=mesh, config=SyncConfig(dtype=torch.float32)):
                if engine is not None:
                    pid = engine.worker_pids[1]
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 30
                    while engine._w.procs[1].is_alive() and time.monotonic() < deadline:
                        time.sleep(0.05)
            out["worker_died"] = None
        except SyncError as exc:
            out["worker_died"] = str(exc)
        # both ranks are still in step: a collective after it completes
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        out["after"] = float(t.item())
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(180)
def test_uneven_batches_and_exit_agree_across_ranks():
    r0, r1 = run_ranks(_job, 2, timeout_s=170, env=spawn_env())
    assert r0["gathered_tags"] == r1["gathered_tags"] == ["r0s0", "r0s1", "r1s0"]
    assert r0["round_trip"] and r1["round_trip"]
    assert r0["repeat"] and r1["repeat"]
    assert (r0["fresh_split"], r1["fresh_split"]) == ([0, 1, 2], [3, 4, 5])
    assert r0["keys_error"] is not None and r0["keys_error"] == r1["keys_error"]
    assert "different keys" in r0["keys_error"] and "extra" in r0["keys_error"] \
        and "other" in r0["keys_error"]
    assert r1["one_rank_exc"] == "KeyError: 'only on rank 1'"
    assert r0["one_rank_exc"].startswith("SyncError: exit failed on rank 1")
    assert "only on rank 1" in r0["one_rank_exc"]
    assert r1["one_rank_notes"] == [], r1          # restoring went well: nothing to add
    for r in (r0, r1):
        assert r["user_exc"] == {"same": True, "notes": [], "training": True}, r["user_exc"]
        assert r["next_sync"] is True
        (note,) = r["restore_failed_notes"]
        assert note.startswith("while restoring after it: SyncError: exit failed on rank 0"), note
        assert "InjectedFault: injected fault: trainer 0 at restore_rng" in note, note
        assert [m.startswith("fsdp_sync: restoring after ValueError failed too: exit failed on rank 0")
                for m in r["logged"]] == [True], r["logged"]     # the user's bug logged nothing
    assert r0["worker_died"] is not None and r0["worker_died"] == r1["worker_died"]
    assert "WorkerDiedError" in r0["worker_died"] and "TP rank 1" in r0["worker_died"]
    assert r0["after"] == r1["after"] == 2.0
