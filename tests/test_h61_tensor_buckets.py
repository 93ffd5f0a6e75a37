"""The tensor method's `TensorTransport.sync` in one process (TP 1, no process group), bucket by
bucket, for each strategy (``flattened``: one handle per bucket; ``bucketed``: one handle per
tensor, one call per bucket; ``per_tensor``: verl's loop, one call per tensor):

- what travels is handle tuples, not data: each payload is a small fraction of the bytes it
  stands for, and an engine that opens them and rebuilds its named tensors from them
  (`wire.open_flattened_bucket`, `SerializedPerRank`) holds the trainer's tensors bit for bit, in
  the rollout dtype; nothing of the sync is left in /dev/shm after it;
- an engine that refuses the third call (bucket 2, of six) fails the sync with a `SyncError`
  naming that call (bucket and its first parameter, or the tensor) and the engine's own words
  (the parameter it refused), the update aborted, never committed, no call after it, and no
  shared-memory segment left, whether the engine refused after opening the payloads, before
  opening tagged ones (their state word tells), or before opening untagged ones (SGLang's, whose
  error says ``opened=False``: the pickling's references are given back; mutant T1, caught before
  only by a two-rank launch).
"""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

from fsdp_sync.config import SyncConfig
from fsdp_sync.engines.base import SerializedPerRank, WeightUpdateError
from fsdp_sync.topology import SyncError
from fsdp_sync.transport import SyncContext, SyncStats
from fsdp_sync.transport.tensor import TensorTransport
from fsdp_sync.weights import handles
from fsdp_sync.wire import open_flattened_bucket



def shm_segments() -> set[str]:
    """This process's torch segments (the sync runs here: an engine's own would be another's)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}

pytestmark = pytest.mark.timeout(120)

TOPO = types.SimpleNamespace(is_tp_src=True, tp_size=1, tp_rank=0, tp_src=0,
                             describe=lambda: "rank 0/1 (dp 0/1, infer_tp 0/1)")
STRATEGIES = ("flattened", "bucketed", "per_tensor")


class Engine:
    """Opens each call's payloads, rebuilds the named tensors (copies) and acknowledges; refuses
    call ``refuse_at`` (0-based) after or before opening (``when``), saying ``opened=False`` where
    told; records the update bracket and what it was sent."""

    def __init__(self, tagged: bool = True, refuse_at: int | None = None, when: str = "after",
                 says_unopened: bool = False) -> None:
        self.accepts_tagged_payloads = tagged
        self.refuse_at, self.when, self.says_unopened = refuse_at, when, says_unopened
        self.log: list = []
        self.held: dict[str, torch.Tensor] = {}
        self.payload_bytes: list[int] = []

    def begin_weight_update(self) -> None:
        self.log.append("begin")

    def end_weight_update(self, weight_version=None, abort=False) -> bool:
        self.log.append("abort" if abort else "commit")
        return True

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True) -> None:
        n = sum(1 for x in self.log if x.startswith("call"))
        self.log.append(f"call {n}")
        refused = n == self.refuse_at
        if refused and self.when == "before":
            exc = RuntimeError("no weight update session (injected)")
            if self.says_unopened:
                exc.opened = False          # as SGLangUpdateError says of a call it never opened
            raise exc
        got = []
        if load_format == "flattened_bucket":
            for rank, p in enumerate(named):
                self.payload_bytes.append(len(p))
                rec = handles.open_payload(p, rank)
                got += [(k, t.clone()) for k, t in open_flattened_bucket(rec.value)]
                rec.ack()
        else:
            assert load_format is None, load_format
            for name, value in named:
                assert isinstance(value, SerializedPerRank) and len(value.values) == 1, value
                self.payload_bytes.append(len(value.values[0]))
                rec = handles.open_payload(value.values[0], 0)
                got.append((name, rec.value.clone()))
                rec.ack()
        if refused:
            raise WeightUpdateError(f"{got[-1][0]}: shape mismatch (injected)", rank=0, name=got[-1][0])
        self.held.update(got)


def _module() -> torch.nn.Module:
    """Six layers of 9.2 KiB: six 16 KiB buckets, twelve tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(6)])


def _sync(module, eng, strategy, dtype=torch.float32, stats: SyncStats | None = None) -> str | None:
    cfg = SyncConfig(strategy=strategy, layout="full", bucket_bytes=16 << 10, dtype=dtype)
    ctx = SyncContext(module, cfg, TOPO, None, [eng], 0, SyncStats())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", handles.UnreleasedPayloadWarning)
        try:
            TensorTransport(cfg).sync(ctx)
            err = None
        except (SyncError, handles.HandleError) as exc:
            err = f"{type(exc).__name__}: {exc}"
    if stats is not None:
        stats.__dict__.update(ctx.stats.__dict__)
    # every payload set was released by the sync, none by its finalizer
    assert not [w for w in caught if issubclass(w.category, handles.UnreleasedPayloadWarning)], caught
    return err


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_engine_rebuilds_the_trainers_tensors_from_handles_and_nothing_is_left(strategy):
    module = _module()
    before = shm_segments()
    eng, stats = Engine(), SyncStats()
    assert _sync(module, eng, strategy, dtype=torch.bfloat16, stats=stats) is None
    assert shm_segments() - before == set()
    want = {n: p.detach().to(torch.bfloat16) for n, p in module.named_parameters()}
    assert sorted(eng.held) == sorted(want)
    for n, t in want.items():
        got = eng.held[n]
        assert got.dtype is torch.bfloat16 and got.shape == t.shape, (n, got.dtype, got.shape)
        assert torch.equal(got.view(torch.int16), t.view(torch.int16)), n
    calls = 12 if strategy == "per_tensor" else 2       # bfloat16: three layers a bucket
    assert eng.log == ["begin"] + [f"call {i}" for i in range(calls)] + ["commit"], eng.log
    assert (stats.engine_calls, stats.buckets, stats.tensors, stats.bytes) == (calls, calls, 12, 6 * 49 * 48 * 2)
    # a payload is a handle: a 9 KiB weight (its bucket: 9.3 KiB) travels in well under its bytes
    assert max(eng.payload_bytes) < 48 * 48 * 2 // 2, eng.payload_bytes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_refused_third_call_names_it_aborts_and_leaves_no_segment(strategy):
    """Refused after opening (tagged), before opening tagged payloads (their state word tells),
    before opening untagged ones (SGLang's: its error says ``opened=False``). The segment is
    looked for without a garbage collection: the error's traceback holds the sync's frames in a
    reference cycle, which once kept the bucket's buffer until the collector ran."""
    module = _module()
    what = "'1.weight'" if strategy == "per_tensor" else "bucket 2 (2.weight…)"
    refused = "1.weight" if strategy == "per_tensor" else "2.bias"      # the call's last tensor
    for tagged, when, says in ((True, "after", False), (True, "before", False), (False, "before", True)):
        before = shm_segments()
        eng = Engine(tagged=tagged, refuse_at=2, when=when, says_unopened=says)
        err = _sync(module, eng, strategy)
        assert shm_segments() - before == set(), (tagged, when)
        assert err and err.startswith(f"SyncError: weight sync failed: engine update of {what} on rank 0/1"), err
        words = (f"WeightUpdateError: {refused}: shape mismatch (injected)" if when == "after"
                 else "no weight update session (injected)")     # the engine's own words
        assert words in err, err
        assert eng.log == ["begin", "call 0", "call 1", "call 2", "abort"], (tagged, when, eng.log)


@pytest.mark.parametrize("strategy", ["flattened", "per_tensor"])
def test_an_engine_that_answers_without_acknowledging_fails_the_sync(strategy):
    """Every call answered but no payload acknowledged (an engine that never opened them): the
    sync fails with `HandleError` naming the first such call, after the engine committed (each
    call was answered); the payloads are given back all the same."""
    module = _module()
    before = shm_segments()
    eng = Engine()
    eng.update_weights_from_tensor = lambda named, load_format=None, flush_cache=True: eng.log.append("call")
    err = _sync(module, eng, strategy)
    assert shm_segments() - before == set()
    what = "'0.weight'" if strategy == "per_tensor" else "bucket 0 (0.weight…)"
    assert err == (f"HandleError: engine answered for {what} but consumer ranks [0] never "
                   f"acknowledged their payloads (rank 0/1 (dp 0/1, infer_tp 0/1))"), err
    assert eng.log[-1] == "commit", eng.log


def test_bucketed_refuses_an_export_that_comes_in_another_order_than_its_plan(monkeypatch):
    """``bucketed`` plans its buckets from the tensors' metadata and takes the tensors from the
    export one by one: a tensor in another place than planned would be sent under the planned
    name (another tensor's). Refused naming both, before any call; the update aborted."""
    from fsdp_sync.weights import export

    real = export.iter_params

    def swapped(*a, **kw):
        items = list(real(*a, **kw))
        items[0], items[1] = items[1], items[0]
        yield from items

    monkeypatch.setattr(export, "iter_params", swapped)
    module = _module()
    before = shm_segments()
    eng = Engine()
    # a making that fails is every rank's error at that call's agree (`transport.unmade`)
    err = _sync(module, eng, "bucketed")
    assert "RuntimeError: export order changed: expected '0.weight', got '0.bias'" in (err or ""), err
    assert shm_segments() - before == set()
    assert eng.log == ["begin", "abort"], eng.log



def test_layout_auto_sends_the_strategy_asked_for_not_per_rank_buckets(strategy="bucketed"):
    """Per-rank buckets are a ``flattened`` layout: under ``layout="auto"`` an engine that takes
    them still gets the ``bucketed`` (or ``per_tensor``) calls asked for (the baseline a user
    measures against), full tensors, and the stats say so; no layout is even considered (that
    takes a collective over the world: here, with no process group, it would fail)."""
    eng = Engine()
    eng.accepts_rank_buckets = True
    eng.load_rank_bucket = lambda *a, **kw: eng.log.append("rank bucket")
    module = _module()
    cfg = SyncConfig(strategy=strategy, bucket_bytes=16 << 10, dtype=torch.float32)
    assert cfg.layout == "auto"
    ctx = SyncContext(module, cfg, TOPO, None, [eng], 0, SyncStats())
    TensorTransport(cfg).sync(ctx)
    assert ctx.stats.extra["layout"] == "full" and "rank bucket" not in eng.log, eng.log
    assert sorted(eng.held) == sorted(n for n, _ in module.named_parameters())


def test_send_without_a_check_still_fails_on_a_payload_never_acknowledged():
    """`TensorTransport.send` (verl's loop) with no ``check``: an engine that answered a call
    without opening its payload fails the send with `HandleError` naming the call (with a
    ``check`` the verify step says it: tests/test_h14_tensor_in_process.py)."""
    from fsdp_sync.transport.tensor import Call

    def calls():
        for i in range(2):
            sets = [handles.make_payloads(torch.full((8,), float(i)), 1, ranks=[0])]
            yield Call(sets, sets[0].payloads[0], lambda g, _i=i: [(f"w{_i}", g[0])], None,
                       i == 1, f"'w{i}'")

    eng = Engine()
    eng.update_weights_from_tensor = lambda named, load_format=None, flush_cache=True: eng.log.append("call")
    before = shm_segments()
    with pytest.raises(handles.HandleError, match=r"engine answered for 'w0' but consumer ranks \[0\] never "
                                                  r"acknowledged their payloads \(rank 0/1"):
        TensorTransport().send(calls(), topo=TOPO, engine=eng)
    assert eng.log == ["begin", "call", "call", "commit"], eng.log
    assert shm_segments() - before == set()


def test_a_sync_without_the_mesh_is_refused_naming_what_to_pass():
    cfg = SyncConfig(layout="full")
    eng = Engine()
    with pytest.raises(ValueError, match=r"method='tensor' needs the \('dp', 'infer_tp'\) mesh: pass "
                                         r"mesh= to the manager"):
        TensorTransport(cfg).sync(SyncContext(_module(), cfg, None, None, [eng], 0, SyncStats()))
    assert eng.log == []


def test_an_engine_without_an_update_bracket_is_said_to_hold_partly_new_weights():
    """No ``begin_weight_update``: each call applied as it came, so after a refused third call
    the engine holds two new buckets. The error says so and the manager is told (it keeps
    generation paused on such an engine: `fleet.take_noted`)."""
    from fsdp_sync import fleet

    class Bare:                          # update_weights_from_tensor only
        def __init__(self) -> None:
            self.inner = Engine(refuse_at=2)

        def update_weights_from_tensor(self, *a, **kw):
            return self.inner.update_weights_from_tensor(*a, **kw)

    eng = Bare()
    fleet.take_noted()
    cfg = SyncConfig(layout="full", bucket_bytes=16 << 10, dtype=torch.float32)
    with pytest.raises(SyncError) as info:
        TensorTransport(cfg).sync(SyncContext(_module(), cfg, TOPO, None, [eng], 0, SyncStats()))
    assert "could not drop any calls it took before the failure" in "".join(info.value.__notes__)
    assert len(fleet.take_noted()) == 1 and eng.inner.log == ["call 0", "call 1", "call 2"]
