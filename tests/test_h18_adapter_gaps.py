"""Behaviours of the SGLang adapter that no test held (H18's mutation pass): each test here fails on
one deliberate mutant of `fsdp_sync.engines.sglang` and passes on the code.

- ``get_weight_version`` over HTTP reads ``/get_model_info`` (SGLang 0.5.23's live version) when
  ``/get_weight_version`` is missing, not ``/get_server_info`` (the launch record, which keeps the
  launch value after updates).
- `checksums.Checker`: a parameter one TP rank's report leaves out is named, an answer of another
  tp_size is refused, a draft model's entries are not read as the target's.
- `loader.load_rank_buckets`: a parameter twice in one call and a bucket naming an unknown dtype are
  refused before any copy, naming the parameter.
- `payloads.bucket_payloads`: a misaligned entry and a buffer shorter than the bucket are refused
  before any payload is made.
- `allocator.ExpandableSegments`: a setting that was not on is never switched, so nothing turns
  expandable segments on that the user had off.

In process, cheap (no launch): the whole file runs in well under a second plus one local server.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.sglang import allocator as sg_allocator
from fsdp_sync.engines.sglang import checksums
from fsdp_sync.engines.sglang.loader import bucket_name, load_rank_buckets
from fsdp_sync.engines.sglang.payloads import bucket_payloads
from fsdp_sync.weights.bucket import Bucket, BucketEntry, TensorMeta, flatten, plan_buckets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang as fake  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- weight version

def test_http_weight_version_is_model_infos_live_one_not_the_launch_record():
    """SGLang 0.5.23 has no /get_weight_version (404) and keeps the launch value in
    /server_info's (and /get_server_info's) weight_version; /get_model_info has the live one."""
    with fake.FakeSGLangServer(tp_size=1) as srv:
        a = sg.SGLangEngine(base_url=srv.url, tp_size=1, retry_backoff_s=0.01, timeout_s=10)
        srv.script["/server_info"] = [(200, json.dumps({"tp_size": 1, "version": "0.5.23",
                                                             "weight_version": "default"}))]
        srv.script["/get_model_info"] = [(200, json.dumps({"model_path": "/m",
                                                            "weight_version": "step-7"}))]
        assert a.get_weight_version() == "step-7"
        assert srv.hits["/get_weight_version"] == 1 and srv.hits["/get_model_info"] == 1


# --------------------------------------------------------------------------- checksums

@pytest.fixture(scope="module")
def tiny(tiny_tp2_tensors):
    return tiny_tp2_tensors


def _answer(layout, full, tp_size=2):
    ranks = [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": tp_size}}
             for r in range(layout.tp)]
    for name, per_rank in checksums.expected_checksums(layout, full):
        for r, h in enumerate(per_rank):
            ranks[r]["checksums"][name] = h
    return {"success": True, "ranks": ranks}


def _problems(layout, full, answer):
    c = checksums.Checker(layout, answer, algorithm="cpu")
    return [p for n, t in full for p in c.feed(n, t)] + c.finish()


def test_checker_names_a_parameter_a_rank_does_not_report(tiny):
    layout, full = tiny
    answer = _answer(layout, full)
    assert _problems(layout, full, answer) == []
    name = "model.norm.weight"
    del answer["ranks"][1]["checksums"][name]
    got = _problems(layout, full, answer)
    assert got == [f"{name!r} on TP rank 1: SGLang reports no checksum for it"], got


def test_checker_refuses_an_answer_of_another_tp_size(tiny):
    layout, full = tiny
    answer = _answer(layout, full, tp_size=4)
    with pytest.raises(ValueError, match="SGLang reports tp_size 4, the layout has 2"):
        checksums.Checker(layout, answer)


def test_checker_does_not_read_a_draft_models_entries_as_the_targets(tiny):
    layout, full = tiny
    answer = _answer(layout, full)
    for r in range(2):       # a speculative server's draft model: same names, other bytes
        answer["ranks"].append({"checksums": {n: "0" * 16 for n in answer["ranks"][r]["checksums"]},
                                "parallelism_info": {"tp_rank": r, "tp_size": 2, "role": "draft"}})
    assert _problems(layout, full, answer) == []


# --------------------------------------------------------------------------- the per-rank loader

class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(2, 3))
        self.b = torch.nn.Parameter(torch.zeros(4))


def _bucket(named):
    (bucket,) = plan_buckets([TensorMeta.of(n, t) for n, t in named], 1 << 30)
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
    flatten(bucket, [t for _, t in named], out=flat)
    return bucket, flat


def test_loader_refuses_a_parameter_twice_in_one_call_before_any_copy():
    m = _Two()
    bucket, flat = _bucket([("a", torch.ones(2, 3)), ("b", torch.ones(4))])
    with pytest.raises(ValueError, match="'a' appears twice in one call"):
        load_rank_buckets(m, [(bucket_name(bucket), flat), ("a", torch.full((2, 3), 2.0))])
    assert not m.a.any() and not m.b.any()          # nothing copied


def test_loader_refuses_a_bucket_naming_an_unknown_dtype():
    m = _Two()
    bucket, flat = _bucket([("b", torch.ones(4))])
    name = bucket_name(bucket).replace('"float32"', '"nn"')     # torch.nn is no dtype
    with pytest.raises(ValueError, match="unknown dtype 'nn' for 'b'"):
        load_rank_buckets(m, [(name, flat)])
    assert not m.b.any()


# --------------------------------------------------------------------------- payloads

def test_bucket_payloads_refuse_a_misaligned_entry_and_a_short_buffer():
    bf = torch.bfloat16
    odd = Bucket(entries=(BucketEntry("x", torch.uint8, (1,), 0, 1),
                          BucketEntry("w", bf, (2,), 1, 5)), nbytes=8)
    with pytest.raises(ValueError, match=r"tensors \['w'\] start at a byte offset"):
        bucket_payloads(torch.zeros(8, dtype=torch.uint8), odd, 1)
    bucket, flat = _bucket([("a", torch.ones(2, 3)), ("b", torch.ones(4))])
    with pytest.raises(ValueError, match=f"at least {bucket.nbytes} bytes"):
        bucket_payloads(flat[:bucket.nbytes - 4], bucket, 1)


# --------------------------------------------------------------------------- allocator

def test_expandable_segments_that_were_off_are_never_switched(monkeypatch):
    calls = []
    monkeypatch.setattr(sg_allocator, "_cuda_available", lambda: True)
    monkeypatch.setattr(sg_allocator, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(sg_allocator, "_allocator_settings", lambda: "expandable_segments:False")
    a = sg.SGLangEngine(fake.FakeSGLangEngine(), tp_size=2)
    a.release_memory_occupation()
    a.resume_memory_occupation()
    a.release_memory_occupation()
    a.shutdown()
    assert calls == []          # never "expandable_segments:True" where the user had them off
    assert any("they were not on" in e for e in a.allocator.events)
