"""FP8 refusals and failures heard where they belong, in one process.

- ``verify`` with FP8: `verify.trainer_tensors` quantizes each gathered bucket (``"full"``) or
  tensor (``"sample"``) on every trainer rank, then gathers the next. A failure there (its output
  buffer not allocated, a MemoryError in the quantizer's scratch) raised on that rank alone, and
  its peers waited in the next gather out the process group's timeout (seen in a 2-rank run: rank 0
  "Timed out waiting 10000ms for recv"). Each quantization's success is now agreed over the trainer
  ranks (`topology.agree`, as `gather.alloc_bucket` agrees the export's buffers): here the rank's
  view of the process group is a stand-in of two ranks (this one rank 1) and ``agree`` a recorder
  that raises as the real one does, so what each rank contributes, and when, is what is checked.
- A NaN or Inf met while quantizing one engine rank's slice (the per-rank layout) is refused naming
  the HF tensor, its place in the FULL tensor and the engine rank; it named the place in the slice
  (``(200, 44)`` for element ``(200, 300)`` of a ``[256, 512]`` down_proj on engine rank 1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import verify
from fsdp_sync.config import SyncConfig
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError
from fsdp_sync.weights import quantize, reshard
from fsdp_sync.weights.layout import layout_for


@pytest.fixture(scope="module")
def model():
    return build_model(load_config("tiny-fp8"), seed=2)


@pytest.fixture
def two_ranks(monkeypatch):
    """verify's process group: two ranks, this one rank 1; ``agree`` records each rank's word."""
    said: list = []

    def agree(error, group=None, *, what="sync", digest=None):
        said.append((error, group, what))
        if error is not None:
            raise SyncError(f"{what} failed on rank 1: {error}")

    monkeypatch.setattr(verify, "dist", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                                        get_world_size=lambda group=None: 2,
                                                        get_rank=lambda group=None: 1), raising=False)
    monkeypatch.setattr(verify, "agree", agree, raising=False)
    return said


def _config(mode: str) -> SyncConfig:
    return SyncConfig(dtype=torch.float32, bucket_bytes=256 << 10, quantization="fp8", verify=mode)


@pytest.fixture(scope="module")
def sent(model):
    """Digest of each tensor of a full verify's FP8 stream, in stream order (one process)."""
    return verify.digests(verify.trainer_tensors(model, _config("full"), [], every=True))


def test_a_quantization_failing_on_one_rank_in_a_full_verify_is_heard(model, sent, monkeypatch, two_ranks):
    config = _config("full")
    assert sorted(sent) == sorted(m.name for m in quantize.sync_metas(model, config))
    ok = list(sent)
    real, calls = quantize.StreamQuantizer.bucket, [0]

    def bucket(self, bkt, flat, alloc, **kw):      # this rank's allocator fails at its 2nd bucket
        calls[0] += 1
        if calls[0] == 2:
            def alloc(n):
                raise MemoryError(f"cannot allocate {n} bytes")
        return real(self, bkt, flat, alloc, **kw)

    monkeypatch.setattr(quantize.StreamQuantizer, "bucket", bucket)
    got = []
    with pytest.raises(SyncError, match=r"verify's fp8 stream failed on rank 1: quantizing bucket 1 "
                                        r"\('.*'\.\.\.\) on rank 1: MemoryError: cannot allocate \d+ bytes"):
        for name, _t in verify.trainer_tensors(model, config, [], every=True):
            got.append(name)
    assert [e is None for e, _, _ in two_ranks] == [True, False], two_ranks   # bucket 0 agreed, then 1
    assert got == ok[:len(got)] and 0 < len(got) < len(ok), got      # bucket 0 only


def test_each_quantized_tensor_of_a_sample_verify_is_agreed_and_a_failure_is_heard(model, monkeypatch, two_ranks):
    config = _config("sample")
    names = [m.name for m in quantize.sync_metas(model, config)][:30]
    quantized = [n for n in names if n in quantize.for_sync(model, config, 1).hf]
    assert len(quantized) >= 3, names
    ok = [n for n, _ in verify.trainer_tensors(model, config, names, every=False)]
    assert len(two_ranks) == len(quantized) and all(e is None for e, _, _ in two_ranks), two_ranks
    assert set(names) <= set(ok), ok
    two_ranks.clear()
    real, calls = quantize.fp8.quantize_block, [0]

    def block(name, w, *a, **kw):                  # this rank's quantizer runs out of memory
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError(f"scratch for {name}")
        return real(name, w, *a, **kw)

    monkeypatch.setattr(quantize.fp8, "quantize_block", block)
    with pytest.raises(SyncError, match=rf"quantizing {quantized[1]!r} on rank 1: MemoryError: scratch for"):
        list(verify.trainer_tensors(model, config, names, every=False))
    assert [e is None for e, _, _ in two_ranks] == [True, False], two_ranks


def test_one_process_raises_the_quantizers_own_error(model, monkeypatch):
    def bucket(self, bkt, flat, alloc, **kw):
        raise MemoryError("no room")

    monkeypatch.setattr(quantize.StreamQuantizer, "bucket", bucket)
    with pytest.raises(MemoryError, match="no room"):
        list(verify.trainer_tensors(model, _config("full"), [], every=True))


@pytest.mark.parametrize("recipe, tp, ep, param, index, hf, rank, engine", [
    ("tiny-fp8", 2, 1, "model.layers.1.mlp.down_proj.weight", (200, 300), "model.layers.1.mlp.down_proj.weight", 1,
     "model.layers.1.mlp.down_proj.weight"),
    ("tiny-fp8", 2, 1, "model.layers.1.self_attn.k_proj.weight", (70, 5), "model.layers.1.self_attn.k_proj.weight", 0,
     "model.layers.1.self_attn.qkv_proj.weight"),
    ("tiny-fp8-moe", 2, 1, "model.layers.0.mlp.experts.down_proj", (2, 17, 200),
     "model.layers.0.mlp.experts.2.down_proj.weight", 1, "model.layers.0.mlp.experts.w2_weight"),
    ("tiny-fp8-moe", 2, 2, "model.layers.0.mlp.experts.gate_up_proj", (3, 400, 3),
     "model.layers.0.mlp.experts.3.up_proj.weight", 1, "model.layers.0.mlp.experts.w13_weight"),
])
def test_a_nan_in_an_engine_ranks_slice_is_named_at_its_place_in_the_full_tensor(recipe, tp, ep, param, index, hf,
                                                                                 rank, engine):
    from fsdp_sync.weights import export

    m = build_model(load_config(recipe), seed=1)
    with torch.no_grad():
        dict(m.named_parameters())[param][index] = float("nan")
    full = dict(export.iter_params(m, names={hf}))[hf]          # the HF tensor as the sync sends it
    at, shape = tuple(int(i) for i in full.isnan().nonzero()[0]), tuple(full.shape)
    assert int(full.isnan().sum()) == 1 and at[-1] >= 128 * (hf.endswith("down_proj.weight")), at
    quant = quantize.for_sync(m, SyncConfig(quantization="fp8"), tp, ep)
    layout = layout_for(m.config, tp, ep)
    errors = {}
    for rb in reshard.iter_rank_buckets(m, layout, 200 << 10, alloc=lambda n: torch.zeros(n, dtype=torch.uint8)):
        if not any(e.name == engine for e in rb.bucket.entries):
            continue                                # (the other buckets are the sync tests')
        for r in sorted(rb.buffers):
            try:
                quant.rank_bucket(rb, lambda k: torch.zeros(k, dtype=torch.uint8), ranks=[r])
            except ValueError as exc:
                errors[r] = str(exc)
    assert list(errors) == [rank], errors           # only the engine rank that serves the element
    msg = errors[rank]
    assert msg.startswith(f"cannot quantize {hf!r} to fp8 on engine rank {rank}: 1 of the "), msg
    assert f"slice of {engine!r} are NaN or Inf (first at {at} of the full {shape} tensor: nan)" in msg, msg


def test_a_rank_local_failure_while_comparing_keeps_consuming_the_collective_stream(model, sent, monkeypatch,
                                                                                     two_ranks):
    """An engine rank's check of one streamed tensor failing (a MemoryError making the digest's
    host copy) left verify's stream there, while the other trainer ranks went on into the next
    gather (the same hang as above); now it is this rank's error, and the stream is consumed to
    its end (every rank runs the same collectives), each bucket's quantization agreed on the way."""
    config = _config("full")
    engine = SimpleNamespace(tensor_checksums=lambda names: {n: sent[n] for n in names})
    real_digest, real_stream, calls, streamed = verify.tensor_digest, verify.trainer_tensors, [0], []

    def digest(name, t):
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError(f"host copy of {name}")
        return real_digest(name, t)

    def stream(*a, **kw):
        for name, t in real_stream(*a, **kw):
            streamed.append(name)
            yield name, t

    monkeypatch.setattr(verify, "tensor_digest", digest)
    monkeypatch.setattr(verify, "trainer_tensors", stream)
    err, figures = verify.verify_engines(model, config, [engine], 0)
    assert err is not None and "checking " in err and "against the engines failed: MemoryError: host copy of" in err, err
    assert streamed == list(sent) and figures["verify_tensors"] == len(sent), (len(streamed), len(sent))
    # every bucket's quantization agreed (a success too: the peers wait in that agree)
    assert len(two_ranks) > 2 and all(e is None and g is None for e, g, _ in two_ranks), two_ranks


def test_a_sample_that_picks_a_scale_alone_streams_it_as_the_full_stream_does(model, sent):
    """``"sample"`` picks tensors of the FP8 stream by name, a ``weight_scale_inv`` without its
    weight at some turns: the weight is gathered and quantized for it, and the scale streamed has
    the full stream's bytes (mutation pass: asking the export for the scale's own name streamed
    nothing, and verify would have failed every such turn with 'never compared')."""
    config = _config("sample")
    scale = next(n for n in sent if n.endswith("_scale_inv"))
    got = dict(verify.trainer_tensors(model, config, [scale], every=False))
    assert scale in got and verify.tensor_digest(scale, got[scale]) == sent[scale], sorted(got)


def test_the_refusal_names_the_first_bad_element_and_counts_them_all():
    """Two non-finite values: the count is both, the place the first (mutation pass: naming the
    last survived, every NaN test had one)."""
    from fsdp_sync.weights import fp8

    w = torch.zeros(4, 300)
    w[1, 7], w[3, 200] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"'x\.weight' to fp8: 2 of 1200 values are NaN or Inf \(first at \(1, 7\): nan\)"):
        fp8.quantize_block("x.weight", w)


def test_the_named_streams_byte_counts_are_what_it_yields(model):
    """``quantize_bytes_in/out`` of the per-tensor formats (`StreamQuantizer.named`): the weight's
    bytes in, the FP8 weight's and its float32 scale's out (mutation pass: leaving the scale out
    survived)."""
    quant = quantize.for_sync(model, _config("sample"), 1)
    name = "model.layers.0.mlp.down_proj.weight"
    t = dict(model.named_parameters())[name].detach()
    out = list(quant.named([(name, t)]))
    assert [n for n, _ in out] == [name, name + "_scale_inv"], out
    assert quant.bytes_in == t.numel() * t.element_size() and quant.tensors == 1
    assert quant.bytes_out == sum(x.numel() * x.element_size() for _, x in out) == t.numel() + 2 * 4 * 4
    assert quant.figures()["quantize_bytes_out"] == quant.bytes_out


def test_a_config_with_static_activations_is_refused_by_the_sync():
    """``fp8_config.config_refusal``: block FP8 quantizes activations dynamically; a config saying
    ``static`` is refused by name (mutation pass: dropping the check survived; only the reference
    engine's own reading was tested)."""
    from fsdp_sync.weights import fp8_config

    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}
    why = fp8_config.config_refusal(load_config("tiny-fp8", quantization_config=qc), "fp8")
    assert why is not None and "activation_scheme 'static'" in why and "dynamically" in why, why
    assert fp8_config.config_refusal(load_config("tiny-fp8", quantization_config={**qc, "activation_scheme": "dynamic"}),
                                      "fp8") is None
