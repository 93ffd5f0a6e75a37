"""H53: fsdp_sync's SGLang adapter modules against values read from SGLang itself, in the default
tier (no sglang import): pinned outputs of SGLang 0.5.23's own hashes, and the refusals and
bookkeeping the adapter's mixins owe SGLang's scheduler."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import checksums

# SGLang 0.5.23's ``mm_utils.tensor_hash`` of each CPU tensor, and its Triton ``gpu_tensor_hash``
# of the same bytes (run by Triton's interpreter on CPU, as tests/sglang_tier/sglang_hash.py does),
# computed once in .venv-sglang and pinned here: a change to either algorithm's byte order, word
# padding, tile handling or position mixing changes these.
SGLANG_0523_HASHES = {
    "u8_7": ("d5912133689bcd41", "83d054b971b72fe3"),
    "bf16_3x5": ("95d7b8539737420b", "0c8f7b78d16d0eca"),
    "f32_9000": ("665d175e0e772860", "4ef9f56617495e5e"),
    "f32_T": ("b38aef6b8bf79335", "8a8f1e30a3c7bdcb"),
}


def _cases():
    return {
        "u8_7": torch.arange(7, dtype=torch.uint8) * 37,       # 7 bytes: padded to 2 words
        "bf16_3x5": (torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7 - 1).to(torch.bfloat16),
        "f32_9000": (torch.arange(9000) % 251).to(torch.float32) / 8 - 3,   # 2 tiles, the last partial
        "f32_T": (torch.arange(12, dtype=torch.float32) * 0.25 - 1).reshape(3, 4).t(),  # non-contiguous
    }


@pytest.mark.parametrize("case", sorted(SGLANG_0523_HASHES))
def test_the_hashes_equal_sglangs_own_for_the_same_bytes(case):
    t = _cases()[case]
    cpu, gpu = SGLANG_0523_HASHES[case]
    assert checksums.hex_hash(t, "cpu") == cpu
    assert checksums.hex_hash(t, "gpu") == gpu


def _fake():
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_sglang

    return fake_sglang


def _first_sync_refusal(module, eng) -> str | None:
    """The manager's first-sync check (`config_check.check_engine`) of ``module`` against the
    fake SGLang ``eng``: its refusal, or None."""
    from fsdp_sync import SyncConfig
    from fsdp_sync.config_check import check_engine

    try:
        check_engine(module, sg.SGLangEngine(eng), SyncConfig(method="disk", disk_dir="/nonexistent"),
                     None, where="engine 0")
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_a_release_older_than_supported_is_refused_before_anything_is_sent():
    """Before: an SGLang reporting 0.4.9 (older than the ``sglang>=0.5.12`` fsdp_sync supports,
    none of its calls read) was synced into as if it were 0.5.12. Now the manager's first-sync
    check (`config_check.check_engine`, asked before any pause or update) refuses it, naming the
    release and the oldest supported; 0.5.12 passes the same check."""
    fake = _fake()

    class Fake049Engine(fake.Fake0512Engine):
        VERSION = "0.4.9"

    module = torch.nn.Linear(2, 2)
    for cls, refused in ((Fake049Engine, True), (fake.Fake0512Engine, False)):
        eng = cls(tp_size=1)
        err = _first_sync_refusal(module, eng)
        assert eng.names() == ["get_server_info"], eng.names()       # nothing but the version asked
        if not refused:
            assert err is None, err
            continue
        assert err and "SGLang 0.4.9 is older than the releases fsdp_sync supports (>=0.5.12" in err, err
        assert "upgrade SGLang to >=0.5.12" in err and "in process" in err, err


# --------------------------------------------------------------------------- the checker

@pytest.fixture(scope="module")
def tiny(tiny_tp2_tensors):
    return tiny_tp2_tensors


def _answer(sums, tp):
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": tp}} for r in range(tp)]
    for name, per_rank in sums.items():
        for r, h in enumerate(per_rank):
            ranks[r]["checksums"][name] = h
    return {"success": True, "ranks": ranks}


def test_a_gpu_servers_cpu_offloaded_parameter_is_read_with_sglangs_cpu_hash(tiny):
    """SGLang's ``tensor_hash`` hashes a CUDA tensor with its tile hash and a CPU one with sha256:
    a GPU server's CPU-offloaded parameter reports the sha256 hash. The checker tries the other
    hash on a difference, so that parameter passes; bytes that differ still fail, naming the
    parameter, the rank and both hashes in the server's algorithm."""
    layout, full = tiny
    gpu = dict(checksums.expected_checksums(layout, full, algorithm="gpu"))
    name, other = "model.embed_tokens.weight", "model.norm.weight"
    cpu = dict(checksums.expected_checksums(layout, full, algorithm="cpu", names=[name]))
    answer = _answer(gpu, layout.tp)
    answer["ranks"][1]["checksums"][name] = cpu[name][1]             # rank 1 holds it on CPU
    c = checksums.Checker(layout, answer, algorithm="gpu")
    assert [p for n, t in full for p in c.feed(n, t)] + c.finish() == []
    answer["ranks"][0]["checksums"][other] = "0123456789abcdef"
    c = checksums.Checker(layout, answer, algorithm="gpu")
    got = [p for n, t in full for p in c.feed(n, t)] + c.finish()
    assert got == [f"{other!r} on TP rank 0: SGLang hashes 0123456789abcdef, the trainer's bytes "
                   f"hash {gpu[other][0]} (gpu)"], got


def test_the_allocator_switchs_annotations_resolve():
    """`allocator` annotated ``resumed`` / ``released`` with ``Sequence`` without importing it:
    ``typing.get_type_hints`` (documentation tools, runtime type checkers) raised NameError."""
    import typing

    from fsdp_sync.engines.sglang.allocator import ExpandableSegments

    for name in ("resumed", "released"):
        assert "tags" in typing.get_type_hints(getattr(ExpandableSegments, name))


def test_expected_checksums_refuse_a_stream_that_leaves_a_parameter_incomplete(tiny):
    """`checksums.expected_checksums` of tensors that never complete an engine parameter (the
    fused q/k/v here, its v_proj left out) raises naming it, not an answer silently short of it."""
    layout, full = tiny
    left_out = "model.layers.0.self_attn.v_proj.weight"
    stream = [(n, t) for n, t in full if n != left_out]
    with pytest.raises(KeyError, match=r"did not complete \['model\.layers\.0\.self_attn\.qkv_proj\.weight'\]"):
        list(checksums.expected_checksums(layout, stream, names=["model.layers.0.self_attn.qkv_proj.weight",
                                                                   "model.norm.weight"]))


# --------------------------------------------------------------------------- payloads

def test_payloads_of_an_update_refused_unopened_give_their_segments_back():
    """`BucketPayloads` as a context manager: an update SGLang refused before any rank opened its
    payload (`SGLangUpdateError.opened` is False) leaves the with-block; the payloads' references
    to the shared-memory segment are given back there, so the segment goes (it outlived the call
    when ``__exit__`` released without naming the ranks unopened)."""
    import gc
    import os

    from _util import shm_segments
    from fsdp_sync.engines.sglang.payloads import flattened_bucket_payloads

    class Refused(Exception):
        opened = False

    def mine():     # this process's own segments (torch names them torch_<creator pid>_...)
        return {s for s in shm_segments(set()) if s.startswith(f"torch_{os.getpid()}_")}

    before = mine()
    with pytest.raises(Refused):
        with flattened_bucket_payloads({"w": torch.arange(6.0), "b": torch.ones(3)}, 2) as p:
            assert len(p) == 2 and mine() - before, "no segment made: nothing tested"
            raise Refused()
    del p
    gc.collect()
    assert mine() - before == set(), os.listdir("/dev/shm")


def test_rank_params_are_sglangs_tp_shards(tiny):
    """What `checksums.RankParams` assembles for each TP rank is that rank's shard as SGLang's
    parallel layers hold it (column-parallel rows, fused q/k/v and gate/up per rank, row-parallel
    columns, vocab rows, norms whole), written here with ``chunk``: the checker's expected hashes
    are computed from these, so a piece written to the wrong rank is no longer compared with
    itself (hashes of both sides from the same assembly agreed whatever it held)."""
    layout, full = tiny
    rp, got = checksums.RankParams(layout), {}
    for n, t in full:
        got.update(rp.add(n, t))
    assert rp.pending() == []
    f = dict(full)
    p = "model.layers.0."

    def cols(n, r, dim=0):
        return f[n].chunk(2, dim=dim)[r]

    for r in range(2):
        want = {
            p + "self_attn.qkv_proj.weight": torch.cat([cols(p + f"self_attn.{x}_proj.weight", r) for x in "qkv"]),
            p + "self_attn.o_proj.weight": cols(p + "self_attn.o_proj.weight", r, dim=1),
            p + "mlp.gate_up_proj.weight": torch.cat([cols(p + "mlp.gate_proj.weight", r),
                                                      cols(p + "mlp.up_proj.weight", r)]),
            p + "mlp.down_proj.weight": cols(p + "mlp.down_proj.weight", r, dim=1),
            "model.embed_tokens.weight": cols("model.embed_tokens.weight", r),
            "model.norm.weight": f["model.norm.weight"],
        }
        for name, w in want.items():
            assert torch.equal(got[name][r], w), (name, r)


# --------------------------------------------------------------------------- served model, versions

def test_a_llama_with_mlp_biases_is_refused_for_sglang_before_anything_is_sent():
    """SGLang's LlamaMLP (0.5.12, 0.5.23) has no biases and its loader skips the MLP biases a sync
    sends: the first-sync check refuses a trainer's Llama with ``mlp_bias=True`` for SGLang itself
    (naming it and what to do), before any call but the version; without MLP biases it passes."""
    import types

    class Config(types.SimpleNamespace):       # what the check reads of a transformers config
        def to_dict(self):
            return dict(vars(self))

    fake = _fake()
    for mlp_bias in (True, False):
        module = torch.nn.Linear(2, 2)
        module.config = Config(model_type="llama", mlp_bias=mlp_bias, tie_word_embeddings=False)
        eng = fake.FakeSGLangEngine(tp_size=1)
        err = _first_sync_refusal(module, eng)
        assert eng.names() == ["get_server_info"], eng.names()
        if not mlp_bias:
            assert err is None, err
            continue
        assert err and err.startswith("mlp_bias=True for a 'llama' model: SGLang's LlamaMLP"), err
        assert "train it with mlp_bias=False or serve it with fsdp_sync's reference engine" in err, err


def test_a_version_that_names_no_release_is_not_reported():
    """`versions.reported` gives None for a ``version`` no release can be read from (a source build's
    ``"dev"``), so ``engine.sglang_version`` and the messages say no release was reported rather
    than naming "SGLang dev" as if it were one (the features are the newest either way)."""
    from fsdp_sync.engines.sglang import versions

    assert versions.reported({"version": "dev"}) is None
    assert versions.reported({"version": "0.5.24.dev3"}) == "0.5.24.dev3"


# --------------------------------------------------------------------------- allocator

def test_expandable_segments_stay_off_while_sglang_still_holds_its_kv_cache(monkeypatch):
    """SGLang owns GPU memory while it holds its weights OR its KV cache: releasing the weights
    alone (as a sync that updates in place does) leaves the KV cache mapped, so the trainer's
    allocator must not grow expandable segments yet; they come back once the KV cache goes too."""
    from fsdp_sync.engines.sglang import allocator as sg_allocator

    calls = []
    monkeypatch.setattr(sg_allocator, "_cuda_available", lambda: True)
    monkeypatch.setattr(sg_allocator, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(sg_allocator, "_allocator_settings", lambda: "expandable_segments:True")
    seg = sg_allocator.ExpandableSegments()
    seg.resumed(["weights", "kv_cache"])
    assert calls == ["expandable_segments:False"]
    seg.released(["weights"])                      # the KV cache is still SGLang's
    assert calls == ["expandable_segments:False"], seg.events
    seg.released(["kv_cache"])
    assert calls == ["expandable_segments:False", "expandable_segments:True"], seg.events


def test_a_parameter_every_dp_replica_reports_names_each_tp_rank_once(tiny):
    """`checksums.unfilled` over a DP server's answer (each TP rank reported once per replica)
    names the TP ranks holding a weight no sync writes once each, not once per replica."""
    layout, _ = tiny
    extra = {"lm_head.extra.weight": "0" * 16}
    got = checksums.unfilled(layout, {0: [extra, extra], 1: [extra, extra]})
    assert got == ["'lm_head.extra.weight' on TP ranks 0, 1: SGLang holds it, but the trainer's layout "
                   "has no such parameter, so no sync writes it"], got


def test_untracked_memory_calls_still_tell_the_allocator_what_sglang_took_back(monkeypatch):
    """With ``track_memory=False`` (another client also releases and resumes that SGLang) the tags
    go as given, and a resume still tells the allocator switch SGLang holds them again: after a
    release and a resume of everything, releasing the KV cache alone leaves expandable segments
    off, SGLang holding its weights (they were restored while it held them when a resume of
    ``None`` told the switch nothing)."""
    from fsdp_sync.engines.sglang import allocator as sg_allocator

    calls = []
    monkeypatch.setattr(sg_allocator, "_cuda_available", lambda: True)
    monkeypatch.setattr(sg_allocator, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(sg_allocator, "_allocator_settings", lambda: "expandable_segments:True")
    eng = _fake().FakeSGLangEngine(tp_size=1)
    a = sg.SGLangEngine(eng, tp_size=1, track_memory=False)
    a.release_memory_occupation()
    a.resume_memory_occupation()
    assert calls == ["expandable_segments:False"]
    a.release_memory_occupation(["kv_cache"])
    assert calls == ["expandable_segments:False"], a.allocator.events
    a.release_memory_occupation(["weights"])
    assert calls == ["expandable_segments:False", "expandable_segments:True"], a.allocator.events
    assert [c for c in eng.names() if "memory" in c] == ["release_memory_occupation",
                                                         "resume_memory_occupation",
                                                         "release_memory_occupation",
                                                         "release_memory_occupation"]
