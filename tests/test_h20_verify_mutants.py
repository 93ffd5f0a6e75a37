"""Verify (`fsdp_sync.verify`) must not pass on weights it did not compare: tests that kill the
mutants of the H20 mutation pass that made verify call wrong weights right (a guard dropped, the
last tensor left out, one TP rank's digests ignored). In-process, one tiny model, stub engines."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync import verify
from fsdp_sync.config import SyncConfig
from fsdp_sync.engines.sglang import checksums
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export
from fsdp_sync.weights.layout import layout_for, rank_digest

pytestmark = pytest.mark.timeout(60)

CONFIG = SyncConfig(verify="full", dtype=torch.float32)


@pytest.fixture(scope="module")
def model():
    module = build_model(load_config("tiny"), seed=0)
    full = dict(export.iter_params(module, dtype=torch.float32))
    return module, full


def _wrong(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[-1] += 1.0            # the last element: a check over fewer bytes misses it
    return out


class FullDigests:
    """An engine answering ``tensor_checksums`` (full-tensor digests) from ``held``."""

    def __init__(self, held: dict):
        self.held = held

    def tensor_checksums(self, names):
        return {n: verify.tensor_digest(n, self.held[n]) for n in names}

    def get_weights_by_name(self, name):
        return self.held[name]


class RankDigests(FullDigests):
    """An engine answering ``rank_digests`` (one digest per TP rank of its own pieces), as the
    reference engine does; ``held_by[r]`` is what TP rank r holds."""

    def __init__(self, layout, held_by: list[dict]):
        super().__init__(held_by[0])
        self.layout, self.held_by = layout, held_by

    def rank_digests(self, names):
        return {n: [rank_digest(self.layout, n, r, lambda pl, r=r: self.held_by[r][n][pl.src])
                    for r in range(self.layout.tp)] for n in names}


def _drop_last_from_stream(monkeypatch, last: str) -> None:
    real = verify.trainer_tensors

    def stream(*a, **k):
        return ((n, t) for n, t in real(*a, **k) if n != last)

    monkeypatch.setattr(verify, "trainer_tensors", stream)


def test_a_tensor_the_trainers_stream_never_gave_is_not_a_pass(model, monkeypatch):
    """The engine serves the last tensor wrong and the trainer's stream leaves it out: verify must
    say it never compared it (before: the guard dropped, it passed)."""
    module, full = model
    last = list(full)[-1]
    held = dict(full, **{last: _wrong(full[last])})
    assert verify.verify_engines(module, CONFIG, [FullDigests(full)], 0)[0] is None
    assert verify.verify_engines(module, CONFIG, [FullDigests(held)], 0)[0] is not None
    _drop_last_from_stream(monkeypatch, last)
    err, _ = verify.verify_engines(module, CONFIG, [FullDigests(held)], 3)
    assert err is not None and "never compared" in err and repr(last) in err, err


def _sglang_stub(module, tp: int, held: dict):
    layout = layout_for(module.config, tp)
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": tp}} for r in range(tp)]
    for name, per_rank in checksums.expected_checksums(layout, list(held.items())):
        for r, h in enumerate(per_rank):
            ranks[r]["checksums"][name] = h
    answer = {"ranks": ranks}
    return types.SimpleNamespace(tp_size=tp, weights_checker=lambda action="checksum": answer,
                                 weight_checksums=lambda: {"answer": answer, "algorithm": "cpu",
                                                           "ep_size": 1})


def test_against_sglang_a_tensor_never_streamed_is_not_a_pass(model, monkeypatch):
    """The same against an SGLang-style checker (per-rank hashes of engine parameters)."""
    module, full = model
    last = list(full)[-1]
    held = dict(full, **{last: _wrong(full[last])})
    assert verify.verify_engines(module, CONFIG, [_sglang_stub(module, 2, full)], 0)[0] is None
    assert verify.verify_engines(module, CONFIG, [_sglang_stub(module, 2, held)], 0)[0] is not None
    _drop_last_from_stream(monkeypatch, last)
    err, _ = verify.verify_engines(module, CONFIG, [_sglang_stub(module, 2, held)], 0)
    assert err is not None, "a tensor never streamed passed verify against SGLang"


def test_check_sent_compares_every_chosen_tensor_the_last_too(model):
    """`check_sent` (verl's streamed verify): the last sent tensor served wrong is named."""
    _, full = model
    sent = verify.digests(full.items())
    last = list(full)[-1]
    assert verify.check_sent(FullDigests(full), sent, "full", 0)[0] is None
    err, fig = verify.check_sent(FullDigests(dict(full, **{last: _wrong(full[last])})), sent, "full", 0)
    assert err is not None and repr(last) in err and fig["verify_tensors"] == len(full), err


def test_streamed_check_names_a_parameter_sglang_holds_that_no_sync_writes(model):
    """`SentToSGLang.check`: SGLang hashing a parameter the trainer's layout has none of (so no sync
    writes it: whatever it holds, it is not the trainer's) fails the check, naming it."""
    module, full = model
    stub = _sglang_stub(module, 2, full)
    server = types.SimpleNamespace(server_info=lambda: {"device": "cpu"},
                                   weights_checker=stub.weights_checker)

    def sent_check():
        sent = verify.SentToSGLang(server, "full", 0, hf_config=module.config, tp_size=2)
        for n, t in full.items():
            sent.add(n, t)
        return sent.check(server)[0]

    assert sent_check() is None
    stub.weights_checker()["ranks"][1]["checksums"]["model.extra_head.weight"] = "0" * 64
    err = sent_check()
    assert err is not None and "'model.extra_head.weight' on TP rank 1" in err, err


def test_streamed_check_refuses_an_engine_parameter_the_sent_tensors_left_incomplete(model):
    """`SentToSGLang.check`: a fused parameter (qkv) whose k part was never sent is no pass, even
    though SGLang's hash of it is never compared (the sender cannot compute it)."""
    module, full = model
    stub = _sglang_stub(module, 2, full)
    server = types.SimpleNamespace(server_info=lambda: {"device": "cpu"},
                                   weights_checker=stub.weights_checker)
    k = "model.layers.1.self_attn.k_proj.weight"
    sent = verify.SentToSGLang(server, "full", 0, hf_config=module.config, tp_size=2)
    for n, t in full.items():
        if n != k:
            sent.add(n, t)
    err = sent.check(server)[0]
    assert err is not None and "did not complete" in err and "layers.1.self_attn.qkv_proj" in err, err


def test_a_mismatch_names_the_engine_that_serves_it_in_a_mixed_fleet(model):
    """Engines [an SGLang server (checked by its /weights_checker), a digest engine serving one
    tensor wrong]: the error names engine 1 and reads the tensor back from it. Before, the digest
    engines were numbered by their place among themselves: 'engine 0', read back from the SGLang
    server (which has no get_weights_by_name)."""
    module, full = model
    last = list(full)[-1]
    held = dict(full, **{last: _wrong(full[last])})
    err, _ = verify.verify_engines(module, CONFIG, [_sglang_stub(module, 2, full), FullDigests(held)], 4)
    assert err is not None and f"after sync 4 engine 1 serves {last!r}" in err, err
    assert "first differing element at flat index" in err and "reading it back failed" not in err, err


def test_a_full_digest_engines_own_word_is_no_pass(model):
    """An engine that answers a tensor's digest with its own word (a reference engine behind
    ``fsdp-sync serve`` whose TP replicas differ: `readback.REPLICA_MISMATCH`) fails verify with
    that word, as `check_sent` does."""
    module, full = model
    name = list(full)[3]

    class Noted(FullDigests):
        def tensor_checksums(self, names):
            out = super().tensor_checksums(names)
            out[name] = "replicas differ between TP ranks 0 and 1"
            return out

    err, _ = verify.verify_engines(module, CONFIG, [Noted(full)], 0)
    assert err is not None and repr(name) in err and "the engine says: replicas differ" in err, err
    err, _ = verify.check_sent(Noted(full), verify.digests(full.items()), "full", 0)
    assert err is not None and repr(name) in err and "the engine says: replicas differ" in err, err


def test_a_stream_holding_a_tensor_twice_is_refused():
    rec = verify.SentDigests("full", 0)
    rec.add("w", torch.zeros(2))
    with pytest.raises(ValueError, match="holds 'w' twice"):
        rec.add("w", torch.ones(2))


def test_sample_mode_with_sglang_and_a_digest_engine_side_by_side(model):
    """``verify="sample"`` with [an SGLang server, a digest engine]: the chosen tensors grow to
    whole engine parameters for SGLang (q with k and v); the digest engine was asked for the
    chosen ones only. Before, the grown names were looked up in its answer: a bare KeyError on
    the rank holding the engines, mid-stream (the other ranks went on gathering). Now: a pass on
    equal weights, and a wrong tensor the digest engine serves is still named in its turn."""
    module, full = model
    cfg = SyncConfig(verify="sample", dtype=torch.float32)
    names = list(full)
    wrong = names[-1]
    held = dict(full, **{wrong: _wrong(full[wrong])})
    for step in range(verify.SAMPLE_EVERY):
        err, _ = verify.verify_engines(module, cfg, [_sglang_stub(module, 2, full), FullDigests(full)], step)
        assert err is None, (step, err)
        err, _ = verify.verify_engines(module, cfg, [_sglang_stub(module, 2, full), FullDigests(held)], step)
        assert (err is not None) == (wrong in verify.select(names, "sample", step)), (step, err)
        assert err is None or f"engine 1 serves {wrong!r}" in err, err


def test_full_and_sample_streams_give_the_same_fp8_tensors():
    """``quantization="fp8"``: verify's bucket-by-bucket stream ("full") yields what the sync sent
    (FP8 weights and their scales), as the one-tensor-at-a-time stream ("sample") does."""
    module = build_model(load_config("tiny-fp8"), seed=0)
    cfg = SyncConfig(verify="full", dtype=torch.bfloat16, quantization="fp8", bucket_bytes=1 << 16)
    from fsdp_sync.weights import quantize

    names = [m.name for m in quantize.sync_metas(module, cfg)]
    full = dict(verify.trainer_tensors(module, cfg, names, every=True))
    one = dict(verify.trainer_tensors(module, cfg, names, every=False))
    assert any(t.dtype == torch.float8_e4m3fn for t in full.values())
    assert set(full) == set(names) == set(one)
    for n in names:
        assert full[n].dtype == one[n].dtype and torch.equal(full[n].view(torch.uint8), one[n].view(torch.uint8)), n
