"""`SyncConfig(lora="adapter")` into a fleet of replicas, with generation paused, and into an engine
that names its base only through ``get_weight_version()``:

- every replica is checked before any is loaded; a replica whose load fails leaves no mixed
  fleet behind it: under ``on_replica_failure="abort"`` the replicas that took the new adapter are
  put back on the one they served (before: replica 0 served the new adapter, replica 1 the old,
  and the error named neither), under ``"quarantine"`` the failing replica is taken out of
  service and the others serve the new adapter; the error names the replica;
- a replica of another rank that failed (the tensor method: one engine per infer-TP group) puts
  this rank's engine back too;
- ``SyncConfig.pause_mode`` holds generation once, from before the base (or the adapter's load)
  until the adapter is in (before: adapter loads ran unpaused, and the first sync resumed
  generation between the base and its adapter); a refused sync pauses nothing;
- a base sync whose adapter then fails leaves no generation on the new base with the old adapter
  (H80: stalled, out of service in a fleet, continued by the next sync that gives it the adapter);
- an engine without a ``weight_version`` attribute (`SGLangEngine`: ``get_weight_version()``)
  whose base is no longer the one synced (a restarted server) is refused at the next
  adapter-only sync (before: the guard never fired for it).

One process, no process group, the disk method for the base, TP-1 reference engines of "tiny".
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig, lora_sync
from fsdp_sync.cli.lora_model import add_lora
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.base import WeightUpdateError
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two():
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8) as a, \
            ReferenceEngine("tiny", tp_size=1, max_lora_rank=8) as b:
        yield a, b


def _fresh(engines):
    for e in engines:
        for n in list(e.lora_adapters):
            e.unload_lora_adapter(n)


def _model():
    return add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=8, seed=1)


def _step(model, by=0.5):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.add_(by)


def _failing(engine, monkeypatch):
    """``engine``'s next adapter loads raise, as a replica whose workers refuse them."""
    def load(*a, **k):
        raise WeightUpdateError("load_lora_adapter_from_tensors('L'): worker 0 ran out of memory")
    monkeypatch.setattr(engine, "load_lora_adapter_from_tensors", load, raising=False)


def _manager(model, engines, tmp_path, mode="abort", **kw):
    return FSDPShardingManager(model, list(engines), config=SyncConfig(
        method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", verify="full",
        on_replica_failure=mode, **kw))


def _same(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_failed_load_under_abort_puts_every_replica_back(two, tmp_path, monkeypatch):
    a, b = two
    _fresh(two)
    model = _model()
    m = _manager(model, two, tmp_path)
    try:
        with m:
            pass
        before = a.lora_tensors("L")
        _step(model)
        with monkeypatch.context() as mp:
            _failing(b, mp)
            with pytest.raises(SyncError, match=r"replica 1 failed to load adapter 'L': WeightUpdateError: "
                                                r".*out of memory; every replica is back on the adapter it "
                                                r"served before"):
                with m:
                    pass
        assert _same(a.lora_tensors("L"), before)          # replica 0 took it, and was put back
        assert _same(b.lora_tensors("L"), before)
        assert all(r["serving"] for r in m.fleet_status()["replicas"])
        with m:                                            # the next sync serves the trainer's
            assert m.stats.extra["verify_tensors"] == 28
        assert not _same(a.lora_tensors("L"), before) and _same(a.lora_tensors("L"), b.lora_tensors("L"))
    finally:
        m.close()


def test_a_failed_first_load_under_abort_leaves_no_replica_with_it(two, tmp_path, monkeypatch):
    a, b = two
    _fresh(two)
    m = _manager(_model(), two, tmp_path)
    try:
        with monkeypatch.context() as mp:
            _failing(b, mp)
            with pytest.raises(SyncError, match=r"replica 1 failed to load adapter 'L'.*every replica is "
                                                r"back on the adapter it served before"):
                with m:
                    pass
        assert "L" not in a.lora_adapters and "L" not in b.lora_adapters   # none held one before
    finally:
        m.close()


def test_a_failed_load_under_quarantine_takes_the_replica_out(two, tmp_path, monkeypatch):
    a, b = two
    _fresh(two)
    model = _model()
    m = _manager(model, two, tmp_path, mode="quarantine")
    try:
        with m:
            pass
        before = a.lora_tensors("L")
        _step(model)
        with monkeypatch.context() as mp:
            _failing(b, mp)
            with m:                  # replica 0 takes it and is verified; replica 1 is out
                assert m.stats.extra["replicas_out"] == [
                    "replica 1: WeightUpdateError: load_lora_adapter_from_tensors('L'): worker 0 ran out of memory"]
        assert not _same(a.lora_tensors("L"), before) and _same(b.lora_tensors("L"), before)
        reps = m.fleet_status()["replicas"]
        assert reps[0]["serving"] and not reps[1]["serving"]
        assert reps[1]["reason"].startswith("failed to load adapter 'L': WeightUpdateError")
        assert b.serving_state is not None                # told: it answers 503 / refuses generate
    finally:
        m.close()
        b.set_serving(True)


def test_a_replica_refusing_is_found_before_any_is_loaded(two, tmp_path):
    """Replica 1 holds adapter "L" at r=8 (loaded behind the manager's back): the sync fails naming
    it, and replica 0 still serves the adapter it had (before: it served the new one)."""
    a, b = two
    _fresh(two)
    model = _model()
    m = _manager(model, two, tmp_path, mode="quarantine")
    try:
        with m:
            pass
        before = a.lora_tensors("L")
        t8 = {"base_model.model." + k: torch.zeros(8 if ".lora_A." in k else v.shape[0],
                                                   v.shape[1] if ".lora_A." in k else 8)
              for k, v in b.lora_tensors("L").items()}
        b.load_lora_adapter_from_tensors("L", t8, {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
                                         replace=True)
        _step(model)
        with pytest.raises(SyncError, match=r"replica 1: adapter 'L': r=4 but the engine serves it with "
                                            r"r=8.*nothing was loaded"):
            with m:
                pass
        assert _same(a.lora_tensors("L"), before)
    finally:
        m.close()


def test_another_ranks_failure_puts_this_ranks_engine_back(two):
    """The tensor method's engines are one per infer-TP group, on several ranks: a load that failed
    on another rank (its `agree` raises here) puts this rank's engine back on its adapter."""
    from fsdp_sync.weights.adapter_export import AdapterCopy as Previous

    a, _ = two
    _fresh(two)
    model, config = _model(), SyncConfig(lora="adapter", lora_name="L", verify="off")
    prev = Previous()
    lora_sync.sync_adapter(model, config, [a], None, {}, lora_sync_agree(), previous=prev)
    before = a.lora_tensors("L")
    _step(model)
    with pytest.raises(SyncError, match="failed on rank 1: the engine there refused it") as info:
        lora_sync.sync_adapter(model, config, [a], None, {}, lora_sync_agree(fail_load=True), previous=prev)
    assert "putting" not in str(info.value) and not getattr(info.value, "__notes__", None)
    assert _same(a.lora_tensors("L"), before)


def lora_sync_agree(fail_load=False):
    """`topology.agree` of a one-process trainer, but another rank's engine fails the load."""
    calls = []

    def agree(err, *, what):
        calls.append(what)
        if err is not None:
            raise SyncError(f"{what} failed: {err}")
        if fail_load and len(calls) == 3:          # 1: the export, 2: the checks, 3: the load
            raise SyncError(f"{what} failed on rank 1: the engine there refused it")
    return agree


def _recording(engine, monkeypatch, calls):
    for name in ("pause_generation", "continue_generation", "load_lora_adapter_from_tensors",
                 "update_weights_from_disk"):
        orig = getattr(engine, name)

        def wrap(*a, _o=orig, _n=name, **k):
            calls.append(_n)
            return _o(*a, **k)
        monkeypatch.setattr(engine, name, wrap, raising=False)


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_pause_mode_holds_generation_around_the_base_and_the_adapter(two, tmp_path, monkeypatch, mode):
    a, _ = two
    _fresh(two)
    calls: list[str] = []
    _recording(a, monkeypatch, calls)
    model = _model()
    m = _manager(model, [a], tmp_path, pause_mode=mode)
    try:
        with m:
            assert a.generation_paused is None
        assert calls == ["pause_generation", "update_weights_from_disk", "load_lora_adapter_from_tensors",
                         "continue_generation"]
        calls.clear()
        _step(model)
        with m:
            pass
        assert calls == ["pause_generation", "load_lora_adapter_from_tensors", "continue_generation"]
        calls.clear()
        model.peft_config["default"]["use_rslora"] = True     # refused: nothing paused
        with pytest.raises(SyncError, match="use_rslora=True cannot be served exactly"):
            with m:
                pass
        assert calls == [] and a.generation_paused is None
    finally:
        m.close()


class _VersionByCall:
    """A reference engine seen as `SGLangEngine` sees a server: no ``weight_version`` attribute,
    the version through ``get_weight_version()``."""

    def __init__(self, engine):
        object.__setattr__(self, "_e", engine)

    def __getattr__(self, name):
        if name == "weight_version":
            raise AttributeError(name)
        return getattr(self._e, name)

    def get_weight_version(self, **_):
        return self._e.weight_version


def test_a_base_version_read_by_get_weight_version_is_guarded(two, tmp_path):
    a, _ = two
    _fresh(two)
    model = _model()
    m = _manager(model, [_VersionByCall(a)], tmp_path)
    try:
        with m:
            pass
        a.weight_version = "default"        # restarted: its launch weights, not the base synced
        with pytest.raises(SyncError, match=r"the engine's base weights are version 'default', not the "
                                            r"base version '0' this manager synced"):
            with m:
                pass
    finally:
        m.close()


@pytest.mark.parametrize("method", ["disk", "tensor", "quarantine"])
def test_h80_a_base_sync_whose_adapter_fails_leaves_no_generation_on_base_and_old_adapter(
        two, tmp_path, monkeypatch, request, method):
    """H80: a base sync again (``base_sync_done=False``: the base changed) whose adapter then fails
    to load leaves the replica on the new base with the adapter it served before, a pair no sync
    produced (logits 0.19 from the trainer's, 0.07 from what it served). Under a ``pause_mode``
    its requests are aborted and generation stays paused there, and in a fleet it is out of
    service (as a replica rejoining at an adapter-only sync is: `lora_stage.rejoin`); the tensor
    method's next adapter sync continues it, serving the trainer's model (a fleet's brings it
    back by `rejoin`, tested above). Before: generation resumed on that pair, the replica in
    service at the base's version."""
    from fsdp_sync.cli.trainer import last_logits
    from fsdp_sync.topology import make_mesh

    a, b = two
    _fresh(two)
    model = _model()
    if method == "quarantine":      # two replicas: the other takes the adapter, the sync succeeds
        m = FSDPShardingManager(model, [b, a], config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", pause_mode="abort",
            on_replica_failure="quarantine"))
    elif method == "tensor":
        request.getfixturevalue("one_rank")
        m = FSDPShardingManager(model, a, mesh=make_mesh(1, 1), config=SyncConfig(
            method="tensor", lora="adapter", lora_name="L", pause_mode="abort"))
    else:
        m = FSDPShardingManager(model, [a], config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", pause_mode="abort"))
    try:
        with m:
            pass
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.mul_(1.25)
        _step(model)
        m.base_sync_done = False
        with monkeypatch.context() as mp:
            _failing(a, mp)
            if method == "quarantine":
                with m:
                    pass
                assert b.generation_paused is None and a.generation_paused == "abort"
                assert [(r["serving"], r["generation_paused"]) for r in m.fleet_status()["replicas"]] \
                    == [(True, False), (False, True)]
                return
            with pytest.raises(SyncError, match=r"failed to load adapter 'L'") as info:
                with m:
                    pass
        assert any("its requests were aborted and generation stays paused" in n
                   for n in getattr(info.value, "__notes__", [])), info.value
        assert a.generation_paused == "abort"
        (rep,) = m.fleet_status()["replicas"]
        assert rep["generation_paused"] and rep["serving"] == (method == "tensor"), rep
        if method == "disk":
            return
        with m:                       # the adapter alone: it serves the pair the trainer has
            pass
        assert a.generation_paused is None and not m.fleet_status()["replicas"][0]["generation_paused"]
        prompts = [[11, 27, 93, 5]]
        with torch.no_grad():
            want = last_logits(model, prompts).float()
        assert float((a.forward_logits(prompts, lora_path="L").float() - want).abs().max()) < 1e-5
    finally:
        m.close()
