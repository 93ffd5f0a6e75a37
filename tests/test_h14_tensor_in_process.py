"""`TensorTransport.send` (the loop verl's adapter drives) in one process, no process group (its
`agree`s then raise on this rank alone): each refusal on infer-TP rank 0 fails the sync as a
`SyncError` naming what refused, before anything more is sent, and the engine's update is
aborted, never committed, after a failed call.

- ``before`` refusing (verl's config/verify check): nothing is taken from the calls, the engine
  is not asked to begin an update;
- ``begin_weight_update`` refusing: nothing is taken from the calls;
- an engine call failing: the error names the call and the rank, the update is aborted (not
  committed), the calls' generator is closed and the payloads released (no segment left);
- ``end_weight_update`` refusing the commit after every call went through: a `SyncError`;
- an engine that answered without opening a payload, with ``check`` given: the verify step says
  "never acknowledged" as a `SyncError` (every rank meets it there), not the rank's own
  `HandleError` after the others passed.
"""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.topology import SyncError
from fsdp_sync.transport.tensor import Call, TensorTransport
from fsdp_sync.weights import handles

pytestmark = pytest.mark.timeout(120)

TOPO = types.SimpleNamespace(is_tp_src=True, tp_size=1, tp_rank=0, tp_src=0,
                             describe=lambda: "rank 0/1 (dp 0/1, infer_tp 0/1)")


class Engine:
    """Opens and acknowledges what it is sent; records the bracket; refuses where told."""

    def __init__(self, refuse: str | None = None, opens: bool = True) -> None:
        self.refuse, self.opens, self.log = refuse, opens, []

    def begin_weight_update(self):
        self.log.append("begin")
        if self.refuse == "begin":
            raise RuntimeError("begin refused (injected)")

    def end_weight_update(self, weight_version=None, abort=False):
        self.log.append("abort" if abort else "commit")
        if self.refuse == "commit" and not abort:
            raise RuntimeError("commit refused (injected)")
        return True

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        self.log.append(f"call flush={flush_cache}")
        if self.refuse == "call" and len([x for x in self.log if x.startswith("call")]) == 2:
            raise RuntimeError("call refused (injected)")
        if self.opens:
            for name, payload in named:
                handles.open_payload(payload, 0).ack()


def _calls(taken: list, n: int = 3):
    """n calls of one tensor each; ``taken`` records each call handed out and whether the
    generator was closed."""
    try:
        for i in range(n):
            sets = [handles.make_payloads(torch.full((8,), float(i)), 1, ranks=[0])]
            taken.append(i)
            yield Call(sets, sets[0].payloads[0], lambda g, _i=i: [(f"w{_i}", g[0])], None,
                       i == n - 1, f"'w{i}'")
    finally:
        taken.append("closed")


def _send(engine, **kw) -> tuple[str | None, list]:
    taken: list = []
    try:
        TensorTransport().send(_calls(taken), topo=TOPO, engine=engine, what="test sync", **kw)
        return None, taken
    except SyncError as exc:
        return str(exc), taken


def test_a_refused_before_sends_nothing():
    for before, text in ((lambda e: "the engine serves another model (injected)", "another model"),
                         (lambda e: 1 / 0, "ZeroDivisionError")):
        eng = Engine()
        err, taken = _send(eng, before=before)
        assert err and err.startswith("test sync failed") and text in err, err
        assert eng.log == [] and taken in ([], ["closed"]), (eng.log, taken)


def test_a_refused_begin_sends_nothing():
    eng = Engine(refuse="begin")
    err, taken = _send(eng)
    assert err and "begin_weight_update on rank 0/1" in err and "begin refused (injected)" in err, err
    assert eng.log == ["begin"] and taken in ([], ["closed"]), (eng.log, taken)


def test_a_failed_call_aborts_names_the_call_and_releases():
    eng = Engine(refuse="call")
    err, taken = _send(eng)
    assert err and "engine update of 'w1' on rank 0/1" in err and "call refused (injected)" in err, err
    assert eng.log == ["begin", "call flush=False", "call flush=False", "abort"], eng.log
    assert taken == [0, 1, "closed"], taken          # the third call never made


def test_a_refused_commit_fails_the_sync():
    eng = Engine(refuse="commit")
    err, taken = _send(eng)
    assert err and "end_weight_update on rank 0/1" in err and "commit refused (injected)" in err, err
    assert eng.log == ["begin"] + ["call flush=False"] * 2 + ["call flush=True", "commit"], eng.log


def test_an_unacknowledged_payload_fails_the_verify_step_on_every_rank():
    eng = Engine(opens=False)
    err, taken = _send(eng, check=lambda e: None)
    assert err and "test sync: verify failed" in err and "never acknowledged" in err, err
    assert eng.log[-1] == "commit"     # the engine answered every call; verify is what fails


class Recorder:
    """Records each call's load format and flush, opening and acknowledging every payload."""

    def __init__(self) -> None:
        self.log = []

    def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
        self.log.append((load_format, flush_cache))
        per_rank = [named] if load_format == "flattened_bucket" else [v.values for _, v in named]
        for payloads in per_rank:
            for r, p in enumerate(payloads):
                handles.open_payload(p, r).ack()


def _plain() -> torch.nn.Module:
    """Twelve tensors of 9 KiB or less: several 16 KiB buckets (no Hugging Face model to import)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(6)])


@pytest.mark.parametrize("strategy", ["flattened", "bucketed", "per_tensor"])
def test_full_tensors_flush_the_cache_with_the_last_call_only(strategy):
    """A flush on an earlier call lets the engine serve from a cache of half-updated weights;
    none leaves the old weights' cache. (Per-rank buckets: tests/test_rank_bucket_flush.py.)"""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats

    eng = Recorder()
    module = _plain()
    cfg = SyncConfig(strategy=strategy, layout="full", bucket_bytes=16 << 10, dtype=torch.float32)
    TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [eng], 0, SyncStats()))
    assert len(eng.log) > 2 and [f for _, f in eng.log] == [False] * (len(eng.log) - 1) + [True], eng.log


def test_a_model_the_quantizer_refuses_fails_before_anything_is_sent(monkeypatch):
    """``quantization="fp8"`` that cannot be done exactly (here: the quantizer refuses) fails the
    sync naming it, on every rank (agreed), before anything is gathered: never an unquantized
    sync in its place."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.weights import quantize

    def refuse(*a, **kw):
        raise ValueError("a block does not split over the engine's TP (injected)")

    monkeypatch.setattr(quantize, "for_sync", refuse)
    eng = Recorder()
    module = _plain()
    cfg = SyncConfig(layout="full", bucket_bytes=16 << 10, quantization="fp8")
    with pytest.raises(SyncError, match=r"quantization='fp8' \(rank 0/1.*\(injected\)"):
        TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [eng], 0, SyncStats()))
    assert eng.log == []


def test_per_rank_buckets_for_an_engine_of_another_model_are_refused_naming_the_difference():
    """An engine that says which model it holds (its ``layout``) and differs from the trainer's:
    per-rank buckets would be cut for the wrong shapes. ``layout="engine"`` is refused naming the
    field, before anything is sent."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.weights.layout import layout_for

    eng = Recorder()
    eng.accepts_rank_buckets = True
    eng.layout = layout_for(load_config("tiny", vocab_size=1024), 1, 1)
    eng.load_rank_bucket = lambda *a, **kw: eng.log.append("rank bucket")
    module = build_model(load_config("tiny"), seed=0)
    cfg = SyncConfig(layout="engine", bucket_bytes=16 << 10, dtype=torch.float32)
    with pytest.raises(SyncError, match=r"layout='engine': the engine's model differs .*vocab"):
        TensorTransport(cfg).sync(SyncContext(module, cfg, TOPO, None, [eng], 0, SyncStats()))
    assert eng.log == []


def test_a_reused_buffer_is_not_handed_out_while_its_bucket_is_in_flight():
    """The full layout's one buffer (`ReusedBuffer`) is taken again only after its bucket was
    given back (answered and acknowledged): taken twice, the second bucket would be packed over
    the first while the engine may still read it."""
    from fsdp_sync.transport.buffers import ReusedBuffer

    buf = ReusedBuffer(256, torch.device("cpu"))
    a = buf.take(200)
    with pytest.raises(RuntimeError, match="still in use by the previous bucket"):
        buf.take(100)
    buf.give_back()
    assert buf.take(100).data_ptr() == a.data_ptr()
    buf.give_back()
    big = buf.take(1000)                 # a bucket larger than planned gets a buffer that fits
    assert big.numel() == 1000
    buf.give_back()


def test_a_pooled_buffer_too_small_for_a_bucket_is_not_handed_out_for_it():
    """`BufferPool` (per-rank buckets): a released buffer smaller than the bucket asked for stays
    in the pool; the bucket gets one that holds it."""
    from fsdp_sync.transport.buffers import BufferPool

    pool = BufferPool(1024, torch.device("cpu"))
    a = pool.take(1000)
    pool.give_back([a])
    big = pool.take(4096)
    assert big.numel() >= 4096 and big.data_ptr() != a.data_ptr()
    assert pool.take(1000).data_ptr() == a.data_ptr()
    pool.close()
