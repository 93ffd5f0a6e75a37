"""The tensor method's failure paths on two infer-TP ranks (dp 1 x tp 2), one launch: every rank
raises the same `SyncError`, the engine keeps the weights it served, and no rank is left holding
a shared-memory segment of the sync nor a payload set only the garbage collector released
(`handles.UnreleasedPayloadWarning`).

- an engine that refuses a call before opening it (SGLang's untagged payloads, its error's
  ``opened`` False), pipelined per-rank buckets and plain flattened buckets: the payloads'
  pickling references are given back on every rank. Pipelined, the refused bucket and the next
  one (gathered, never handed over) kept theirs: both buffers' segments stayed in /dev/shm until
  the rank exited, on every failed sync;
- a commit (``end_weight_update``) refused after every call went through: every rank fails,
  naming it (not a sync that counted as done on every rank);
- the export failing on every rank while the engine loads the bucket before (pipelined): that
  bucket is waited for and released, the update aborted;
- and, with nothing failing, an engine that takes per-rank payloads untagged and as the bare flat
  tensor (SGLang with fsdp_sync's loader) gets them so from every infer-TP rank, not only from the
  rank that holds it (which alone can ask the engine).
"""

from __future__ import annotations

import pytest

from fsdp_sync.cli.launch import run_ranks, spawn_env


def _job(rank: int, world: int) -> dict:
    import gc
    import os
    import warnings

    import torch

    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError
    from fsdp_sync.weights import handles, reshard

    torch.set_num_threads(1)

    class Refused(Exception):
        opened = False                       # as SGLangUpdateError says of a call it never opened

    class Unopening:
        """An SGLang-like engine (untagged payloads, per-rank buckets) refusing its first call."""
        accepts_tagged_payloads = False
        accepts_rank_buckets = True
        rank_bucket_payload = "tensor"
        tp_size = world

        def load_rank_bucket(self, bucket, payloads, flush_cache=True):
            raise Refused("no weight update session (injected)")

        def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
            raise Refused("no weight update session (injected)")

    class TensorForm:
        """An engine taking per-rank payloads untagged and as the bare flat tensor (SGLang with
        its loader: ``accepts_tagged_payloads``, ``rank_bucket_payload``)."""
        accepts_tagged_payloads = False
        accepts_rank_buckets = True
        rank_bucket_payload = "tensor"
        tp_size = world
        forms: list = []

        def load_rank_bucket(self, bucket, payloads, flush_cache=True):
            for r, p in enumerate(payloads):
                got = handles.open_payload(p, r)
                value = got.value
                form = "tensor" if isinstance(value, torch.Tensor) else str(sorted(value))
                self.forms.append((r, "tagged" if b"fsdp_sync" in p else "untagged", form))
                del value
                got.ack()

    class CommitRefused:
        """A reference engine whose commit is refused (it drops the update first)."""

        def __init__(self, engine):
            object.__setattr__(self, "_e", engine)

        def __getattr__(self, name):
            return getattr(self._e, name)

        def end_weight_update(self, weight_version=None, abort=False):
            if abort:
                return self._e.end_weight_update(abort=True)
            self._e.end_weight_update(abort=True)
            raise RuntimeError("commit refused (injected)")

    def segments() -> set[str]:
        return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    mesh = make_mesh(1, world)
    holder = rank == 0
    engine = ReferenceEngine(model_config=cfg, tp_size=world, dtype=torch.float32) if holder else None

    def sync(eng, **kw) -> dict:
        before = engine.weights_checksum() if holder else None
        gc.collect()
        seen = segments()
        m = FSDPShardingManager(module, eng, mesh=mesh, config=SyncConfig(
            dtype=torch.float32, bucket_bytes=16 << 10, free_cache_engine=False, dist_timeout_s=60, **kw))
        rec: dict = {"error": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", handles.UnreleasedPayloadWarning)
            try:
                with m:
                    pass
            except SyncError as exc:
                rec["error"] = str(exc)
            m.close()
            del m
            gc.collect()
        rec["unreleased"] = [str(w.message)[:80] for w in caught
                             if issubclass(w.category, handles.UnreleasedPayloadWarning)]
        rec["left"] = sorted(segments() - seen)
        if holder:
            rec["kept"] = engine.weights_checksum() == before
        return rec

    out: dict = {}
    try:
        out["first"] = sync(engine, layout="engine")
        for key, kw in (("unopened_pipelined", {"layout": "engine", "pipelined": True}),
                        ("unopened_flattened", {"layout": "full"})):
            out[key] = sync(Unopening() if holder else None, **kw)
        out["commit"] = sync(CommitRefused(engine) if holder else None, layout="full")
        # every infer-TP rank packs its payload in the form infer-TP rank 0's engine takes
        out["form"] = sync(TensorForm() if holder else None, layout="engine")
        out["form"]["forms"] = sorted(set(TensorForm.forms))
        orig = reshard.iter_rank_buckets

        def third_fails(*a, **kw):
            inner = orig(*a, **kw)
            try:
                for i, rb in enumerate(inner):
                    if i == 2:
                        raise RuntimeError("export failed (injected)")
                    yield rb
            finally:
                inner.close()

        reshard.iter_rank_buckets = third_fails
        try:
            out["export"] = sync(engine, layout="engine", pipelined=True)
        finally:
            reshard.iter_rank_buckets = orig
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(240)
def test_tensor_failures_agree_keep_the_weights_and_leave_nothing():
    results = run_ranks(_job, 2, timeout_s=210, pg_timeout_s=60, env=spawn_env())
    for rank, out in enumerate(results):
        for key, rec in out.items():
            assert rec["left"] == [] and rec["unreleased"] == [], (rank, key, rec)
            if rank == 0 and key not in ("first", "form"):
                assert rec["kept"], (key, rec)          # the update was dropped
        assert out["first"]["error"] is None, (rank, out)
        for key, what in (("unopened_pipelined", "per-rank bucket 0 (model.embed_tokens.weight"),
                          ("unopened_flattened", "bucket 0 (model.embed_tokens.weight")):
            err = out[key]["error"]
            assert err and "failed on rank 0" in err and what in err and "infer_tp 0/2" in err, (rank, key, err)
            assert "no weight update session (injected)" in err, err
        assert out["form"]["error"] is None, (rank, out["form"])
        if rank == 0:
            forms = [tuple(f) for f in out["form"]["forms"]]
            assert forms == [(0, "untagged", "tensor"), (1, "untagged", "tensor")], out["form"]
        err = out["commit"]["error"]
        assert err and "end_weight_update" in err and "commit refused (injected)" in err, (rank, err)
        assert out["export"]["error"] and "export failed (injected)" in out["export"]["error"], (rank, out)
    for key in results[0]:
        assert results[0][key]["error"] == results[1][key]["error"], key    # the same error on each
