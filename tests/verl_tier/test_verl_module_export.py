"""verl's own FSDP engine export, wrapped by fsdp_sync's plug-in (`integrations.module_stream`).

On 2 gloo ranks with a real FSDP2 model, verl 0.9.1's ``FSDPEngine.get_per_tensor_param`` (the
function itself, on an engine object holding only what it reads) once `module_stream.install` ran:

- it hands back a `ModuleStream` whose items are verl's own, name for name and bit for bit, with
  the module and the flags verl called it with;
- fsdp_sync's export of the same module is exact against it (`refusal` says None, with verl's own
  ``convert_weight_keys`` and ``unfuse_moe_params``): a dense Qwen2 and a Qwen3-MoE whose
  transformers-5 fused experts verl cuts into per-expert tensors, every bucket's bytes equal to
  verl's tensors;
- a kept `ExportDecision` holds across two of verl's streams of the same engine and is made
  again once the module changed;
- `uninstall` gives verl its function back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]


class _Lora(dict):
    pass


def _engine(module, model_type):
    """What FSDPEngine.get_per_tensor_param reads of its engine, and nothing else."""
    return SimpleNamespace(module=module, _uses_fsdp2_cpu_offload_policy=False,
                           _is_offload_param=False, _qat_enabled=False,
                           model_config=SimpleNamespace(lora=_Lora(),
                                                        hf_config=SimpleNamespace(model_type=model_type)))


def _ranks(rank, world, models):
    import verl  # noqa: F401  (the plug-in, the CPU platform)
    from verl.workers.engine.fsdp import transformer_impl as impl

    from fsdp_sync.integrations import module_stream
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.verify import tensor_digest
    from fsdp_sync.weights import export
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    original = impl.FSDPEngine.__dict__["get_per_tensor_param"]
    out = {"installed": module_stream.install(), "again": module_stream.install()}
    out["wrapped"] = impl.FSDPEngine.__dict__["get_per_tensor_param"] is not original
    for name in models:
        cfg = load_config(name)
        module = wrap_fsdp(build_model(cfg, seed=0), 2)
        stream, peft = impl.FSDPEngine.get_per_tensor_param(
            _engine(module, cfg.model_type), layered_summon=False, base_sync_done=True)
        is_module_stream = isinstance(stream, module_stream.ModuleStream)
        prepare = (lambda n, t: t.detach().contiguous())
        reason, metas = module_stream.refusal(stream, SimpleNamespace(
            strategy="flattened", quantization=None, dtype=None), prepare)
        theirs = {n: tensor_digest(n, t) for n, t in stream}     # verl's own export, walked
        ours = {}
        for bkt, flat in export.iter_buckets(module, 64 << 10, share_host_memory=True):
            for e in bkt.entries:
                ours[e.name] = tensor_digest(e.name, flat[e.start:e.end].view(e.dtype).view(e.shape))
        # a second stream of the same engine (verl's next sync): its naming promises the same
        # names, so an adapter's kept decision holds; a changed module is compared again
        decision = module_stream.ExportDecision()
        builds = []
        for _ in range(2):
            again, _ = impl.FSDPEngine.get_per_tensor_param(
                _engine(module, cfg.model_type), layered_summon=False, base_sync_done=True)
            kept = module_stream.refusal(again, SimpleNamespace(
                strategy="flattened", quantization=None, dtype=None, bucket_bytes=64 << 10),
                prepare, decision=decision)
            builds.append((decision.builds, decision.kept, kept == (reason, metas)))
        with torch.no_grad():
            module.model.norm.weight.data = module.model.norm.weight.data.to(torch.bfloat16)
        again, _ = impl.FSDPEngine.get_per_tensor_param(
            _engine(module, cfg.model_type), layered_summon=False, base_sync_done=True)
        module_stream.refusal(again, SimpleNamespace(
            strategy="flattened", quantization=None, dtype=None, bucket_bytes=64 << 10),
            prepare, decision=decision)
        builds.append((decision.builds, decision.kept, decision.reason or {
            m.name: m.dtype for m in decision.metas}.get("model.norm.weight")))
        out[name] = {"module_stream": is_module_stream, "peft": peft, "reason": reason,
                     "builds": builds,
                     "flags": stream.flags, "same_module": stream.module is module,
                     "names": [m.name for m in metas or []], "verl_names": list(theirs),
                     "equal": theirs == ours}
    module_stream.uninstall()
    out["restored"] = impl.FSDPEngine.__dict__["get_per_tensor_param"] is original
    return out


def test_verls_engine_hands_its_module_along_and_fsdp_syncs_export_is_exact_against_it():
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    models = ("tiny", "tiny-qwen3-moe")
    results = run_ranks(_ranks, 2, models, timeout_s=280, env=spawn_env({"VERL_PLATFORM": "cpu"}))
    for r in results:
        assert r["installed"] and r["again"] and r["wrapped"] and r["restored"]
        for name in models:
            got = r[name]
            assert got["module_stream"] and got["peft"] is None and got["same_module"]
            assert got["flags"] == {"layered_summon": False, "base_sync_done": True}
            assert got["reason"] is None, got["reason"]
            assert got["names"] == got["verl_names"] and got["equal"]
            # kept across verl's streams; after the change compared again: here (a bfloat16
            # local tensor under a float32 DTensor) the two disagree and it is refused by name
            assert got["builds"][:2] == [(1, False, True), (1, True, True)]
            assert got["builds"][2][:2] == (2, False)
            assert ": verl 'model.norm.weight' float32 (64,), fsdp_sync " \
                   "'model.norm.weight' bfloat16 (64,)" in got["builds"][2][2], got["builds"]
    moe = results[0]["tiny-qwen3-moe"]["verl_names"]
    # verl cut the fused experts into per-expert tensors, and so did fsdp_sync's export
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in moe
    assert not any(n.endswith("experts.gate_up_proj") for n in moe)
    assert results[0]["tiny"]["verl_names"] == results[1]["tiny"]["verl_names"]
