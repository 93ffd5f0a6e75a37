"""What `module_stream.install`'s wrapper reads off verl 0.9.1's own engine decides the refusals.

`test_verl_module_export` calls verl's ``FSDPEngine.get_per_tensor_param`` only on an engine with
every flag off, so the wrapper could read none of them (parameter offload, FSDP2's CPU-offload
policy, QAT, a merged LoRA, FSDP1) and nothing failed: the fast path would then run where verl's
stream is offloaded, quantized or merged. Here each flag, on verl's own function, must reach the
`ModuleStream` and be refused by name; an engine with every flag off is exact (the control).
One gloo rank, a real FSDP model. Also, in process: `stream.BucketBuffer` at a bucket's capacity,
`metrics.step_metrics` of a step holding both a base and an adapter sync.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]


class _Lora(dict):
    pass


def _engine(module, **over):
    """What FSDPEngine.get_per_tensor_param reads of its engine, and nothing else."""
    eng = dict(module=module, _uses_fsdp2_cpu_offload_policy=False, _is_offload_param=False,
               _qat_enabled=False,
               model_config=SimpleNamespace(lora=_Lora(over.pop("lora", {})),
                                            hf_config=SimpleNamespace(model_type="qwen2")))
    eng.update(over)
    return SimpleNamespace(**eng)


def _one_rank(rank, world):
    import verl  # noqa: F401  (the plug-in, the CPU platform)
    from verl.workers.engine.fsdp import transformer_impl as impl

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    module_stream.install()
    cfg = SimpleNamespace(strategy="flattened", quantization=None, dtype=None)

    def prepare(n, t):
        return t.detach().contiguous()

    out = {}
    try:
        fsdp2 = wrap_fsdp(build_model(load_config("tiny"), seed=0), 2)
        # verl's QATQuantizer needs compressed_tensors (not in this tier's venv): a stand-in that
        # passes the stream through; what is tested is that the wrapper sees _qat_enabled
        import sys
        import types
        stub = types.ModuleType("verl.utils.qat.quantizer")
        stub.QATQuantizer = lambda **kw: SimpleNamespace(
            quantize_with_fusion=lambda items, target_device=None: items)
        sys.modules.setdefault("verl.utils.qat.quantizer", stub)
        qat = dict(_qat_enabled=True, engine_config=SimpleNamespace(mixed_precision=None),
                   _qat_config=SimpleNamespace(mode="w4a16", group_size=16, ignore_patterns=[]))
        cases = {
            "none": _engine(fsdp2),
            "offload": _engine(fsdp2, _is_offload_param=True),
            "cpu_policy": _engine(fsdp2, _uses_fsdp2_cpu_offload_policy=True),
            "qat": _engine(fsdp2, **qat),
        }
        for case, eng in cases.items():
            stream, peft = impl.FSDPEngine.get_per_tensor_param(eng, layered_summon=False,
                                                                base_sync_done=True)
            out[case] = (type(stream).__name__, peft,
                         module_stream.refusal(stream, cfg, prepare)[0])
        # a merged LoRA: verl returns its own merged generator with no peft_config (the CPU-offload
        # policy set only so that verl does not stage the module; the LoRA refusal comes first)
        fsdp2.peft_config = {"default": None}
        eng = _engine(fsdp2, lora={"merge": True}, _uses_fsdp2_cpu_offload_policy=True,
                      _merged_lora_per_tensor_param=lambda: iter(()))
        stream, peft = impl.FSDPEngine.get_per_tensor_param(eng, layered_summon=False,
                                                            base_sync_done=True)
        out["merged_lora"] = (type(stream).__name__, peft,
                              module_stream.refusal(stream, cfg, prepare)[0])
        del fsdp2.peft_config
        fsdp1 = wrap_fsdp(build_model(load_config("tiny"), seed=0), 1)
        stream, peft = impl.FSDPEngine.get_per_tensor_param(
            _engine(fsdp1, _uses_fsdp2_cpu_offload_policy=True), layered_summon=False,
            base_sync_done=True)
        out["fsdp1"] = (type(stream).__name__, peft, module_stream.refusal(stream, cfg, prepare)[0])
    finally:
        module_stream.uninstall()
    return out


def test_verls_engine_flags_reach_the_module_stream_and_are_refused_by_name():
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    got = run_ranks(_one_rank, 1, timeout_s=280, env=spawn_env({"VERL_PLATFORM": "cpu"}))[0]
    expected = {"none": None,
                "offload": "verl offloads the actor's parameters",
                "cpu_policy": "verl offloads the actor's parameters",
                "qat": "QAT is on",
                "merged_lora": "the actor is a LoRA (peft) model",
                "fsdp1": "the actor is FSDP1, not FSDP2"}
    for case, want in expected.items():
        kind, peft, reason = got[case]
        assert kind == "ModuleStream" and peft is None, (case, got[case])
        if want is None:
            assert reason is None, (case, reason)
        else:
            assert reason is not None and want in reason, (case, reason)


def test_stream_buffer_fills_a_bucket_to_exactly_its_capacity():
    """`stream.BucketBuffer.fits` is `plan_buckets`' rule: tensors whose aligned end is exactly the
    bucket's capacity share one bucket (a strict comparison split them into one call each)."""
    from fsdp_sync.integrations.verl.stream import BucketBuffer
    from fsdp_sync.weights.bucket import plan_buckets, TensorMeta

    s = BucketBuffer(64)
    a, b = torch.arange(8, dtype=torch.float32), torch.arange(8, 16, dtype=torch.float32)
    s.add("a", a)
    assert s.fits(32)
    s.add("b", b)
    assert not s.fits(1)
    assert [len(x.entries) for x in plan_buckets([TensorMeta.of("a", a), TensorMeta.of("b", b)], 64)] == [2]
    assert s.bucket().nbytes == 64 and list(s.bucket().names) == ["a", "b"]


def test_stream_buffer_doubling_stops_at_the_bucket():
    """Growing by doubling from 608 bytes would make 1216; the bucket is 1000: the buffer is 1000."""
    from fsdp_sync.integrations.verl.stream import BucketBuffer

    s = BucketBuffer(1000)
    s.add("a", torch.zeros(150))            # 600 bytes: a 608-byte buffer
    assert s.buf.numel() == 608
    assert s.fits(300)
    s.add("b", torch.ones(75))              # ends at 912
    assert s.buf.numel() == 1000
    assert torch.equal(s.buf[:600].view(torch.float32), torch.zeros(150))


def test_step_metrics_of_a_step_holding_a_base_and_an_adapter_sync_are_the_adapters():
    """`metrics.step_metrics`: where the newest step holds a LoRA run's base sync and its adapter
    sync (both at global_steps 0), the fsdp_sync/* figures are the adapter's (2 replicas), the base
    beside them; gbps is all replicas' bytes over the slowest one's seconds."""
    from fsdp_sync.integrations.verl.metrics import step_metrics

    m = step_metrics([dict(kind="base", global_steps=0, sync_s=1.0, bytes=500.0),
                      dict(kind="base", global_steps=0, sync_s=1.5, bytes=500.0),
                      dict(kind="adapter", global_steps=0, sync_s=0.04, bytes=30.0),
                      dict(kind="adapter", global_steps=0, sync_s=0.05, bytes=30.0)])
    assert m["fsdp_sync/sync_s"] == 0.05 and m["fsdp_sync/bytes"] == 60.0, m
    assert m["fsdp_sync/replicas"] == 2.0 and m["fsdp_sync/adapter"] == 1.0
    assert m["fsdp_sync/base_sync_s"] == 1.5 and m["fsdp_sync/base_bytes"] == 1000.0
    assert m["fsdp_sync/gbps"] == 60.0 / 0.05 / 1e9
