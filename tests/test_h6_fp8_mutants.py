"""Cases the fp8 / fp8_config / quantize / verify tests left open, found by a mutation pass (H6 audit):
each test here fails with the mutant named in its docstring and passes on the code as it is."""

from __future__ import annotations

import pytest
import torch


def _layout(recipe="tiny-fp8", tp=1, **kw):
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    return layout_for(load_config(recipe, **kw), tp)


def test_an_ignored_entry_matches_whole_dotted_parts_only():
    """SGLang's ``_module_path_match``: ``model.layers.1`` is layer 1, not layer 10 too, and
    ``mlp.gate`` (a MoE router's name in some configs) is not ``mlp.gate_proj``. Mutant: a plain
    substring match (``ignored in module``)."""
    from fsdp_sync.weights import fp8

    layout = _layout(num_hidden_layers=11)
    everything = set(fp8.quantized_names(layout))
    kept = set(fp8.quantized_names(layout, ["model.layers.1"]))
    assert sorted(everything - kept) == sorted(n for n in everything if n.startswith("model.layers.1.")), \
        sorted(everything - kept)
    assert any(n.startswith("model.layers.10.") for n in kept)
    assert set(fp8.quantized_names(layout, ["mlp.gate"])) == everything
    assert set(fp8.quantized_names(layout, ["layers.1.mlp"])) == everything - {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"}


def test_a_static_activation_scheme_is_refused_by_the_sync_and_the_plan():
    """Block FP8 quantizes activations dynamically; SGLang refuses a static scheme with a block
    size, so does the reference engine (`quant.resolve`), and the sync must say so before it
    quantizes anything (`fp8_config.config_refusal`, `fp8_config.ignored_layers`). Mutant: the
    activation_scheme check dropped."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8_config
    from fsdp_sync.weights.layout import layout_for

    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}
    cfg = load_config("tiny-fp8", quantization_config=qc)
    why = fp8_config.config_refusal(cfg, "fp8")
    assert why and "activation_scheme 'static'" in why and "dynamically" in why, why
    with pytest.raises(ValueError, match="activation_scheme 'static'"):
        fp8_config.held_layout(cfg, layout_for(cfg, 1), "fp8")
    assert fp8_config.config_refusal(load_config("tiny-fp8", quantization_config={**qc, "activation_scheme": "dynamic"}),
                                     "fp8") is None
    assert fp8_config.config_refusal(load_config("tiny-fp8", quantization_config={k: v for k, v in qc.items()
                                                                                  if k != "activation_scheme"}), "fp8") is None


class _NotedEngine:
    """An engine answering full-tensor digests (no per-rank ones): the trainer's, but for ``noted``,
    which gets a replica-mismatch note; reading it back gives the owners' copy, the trainer's."""

    def __init__(self, full: dict, noted: str):
        from fsdp_sync.verify import tensor_digest

        self.full, self.noted = full, noted
        self.digests = {n: tensor_digest(n, t) for n, t in full.items()}

    def tensor_checksums(self, names):
        return {n: (f"replica mismatch: TP rank 1's replica of {n!r} (block (0, 0)) differs from its owner's"
                    if n == self.noted else self.digests[n]) for n in names}

    def get_weights_by_name(self, name):
        return self.full[name]


def test_a_replica_note_whose_owners_copy_is_right_says_so():
    """Where the engine's own word is that a replica differs and the owners' copy it reads back
    equals the trainer's, verify says that, not "its bytes equal the trainer's but its digest does
    not (the engine's checksum is off?)". Mutant: that rewording dropped."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.verify import verify_engines

    module = build_model(load_config("tiny"), seed=0)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    noted = "model.layers.0.mlp.down_proj.weight"
    err, figures = verify_engines(module, SyncConfig(dtype=torch.float32, verify="full"), [_NotedEngine(full, noted)], 3)
    assert err is not None and repr(noted) in err and "after sync 3 engine 0" in err, err
    assert "the engine says: replica mismatch: TP rank 1's replica" in err, err
    assert err.endswith("; the owners' copy it reads back equals the trainer's"), err
    assert "checksum is off" not in err, err
    assert figures["verify_tensors"] == len(full)
    err, _ = verify_engines(module, SyncConfig(dtype=torch.float32, verify="full"), [_NotedEngine(full, "")], 4)
    assert err is None, err


def test_a_sampled_scale_is_checked_without_its_weight():
    """``verify="sample"`` of an FP8 sync picks scales on their own (turn 5: three scales whose
    weights are not picked); each is made from its weight and compared, and a wrong one fails the
    check naming it. Mutant: the sampled stream asked for the scale's own name (no such parameter),
    so the scale never came and verify passed unchecked."""
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.verify import select, verify_engines
    from fsdp_sync.weights import export, quantize

    module = build_model(load_config("tiny-fp8"), seed=0)
    cfg = SyncConfig(dtype=torch.float32, verify="sample", quantization="fp8")
    sent = dict(quantize.for_sync(module, cfg, 1).named(export.iter_params(module, dtype=torch.float32)))
    chosen = select([m.name for m in quantize.sync_metas(module, cfg)], "sample", 5)
    scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    assert scale in chosen and scale.removesuffix("_scale_inv") not in chosen, chosen
    engine = _NotedEngine(sent, "")
    err, figures = verify_engines(module, cfg, [engine], 5)
    assert err is None and figures["verify_tensors"] == len(chosen), (err, figures)
    wrong = dict(sent)
    wrong[scale] = sent[scale] * 2
    engine = _NotedEngine(sent, "")
    engine.digests = _NotedEngine(wrong, "").digests
    engine.full = wrong
    err, _ = verify_engines(module, cfg, [engine], 5)
    assert err is not None and repr(scale) in err and "first differing element" in err, err


def test_sample_turns_start_at_the_runs_global_steps():
    """`SampleTurns`: the first verified sync's turn is the run's ``global_steps`` (0 when unset),
    then one more per verified sync. Mutant: always from 0 (a job that rebuilds its manager every
    step would check the same eighth every time)."""
    from fsdp_sync.verify import SampleTurns

    t = SampleTurns()
    assert [t.next(5), t.next(6), t.next(None), t.next(100)] == [5, 6, 7, 8]
    u = SampleTurns()
    assert [u.next(), u.next(3)] == [0, 1]


def test_a_chosen_tensor_the_stream_never_gives_fails_verify(monkeypatch):
    """Verify compares the tensors as the trainer streams them; one it chose that never came (the
    sampled scale above, under that mutant) was no error: the sync passed a check that did not run.
    Now it fails, naming the tensor."""
    from fsdp_sync import verify
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config

    module = build_model(load_config("tiny"), seed=0)
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    real = verify.trainer_tensors
    gone = "model.layers.1.mlp.up_proj.weight"
    monkeypatch.setattr(verify, "trainer_tensors",
                        lambda *a, **k: ((n, t) for n, t in real(*a, **k) if n != gone))
    err, figures = verify.verify_engines(module, SyncConfig(dtype=torch.float32, verify="full"),
                                         [_NotedEngine(full, "")], 2)
    assert err is not None and "were never compared" in err and repr(gone) in err, err
    assert figures["verify_tensors"] == len(full) - 1
    err, _ = verify.verify_engines(module, SyncConfig(dtype=torch.float32, verify="full"), [], 2)
    assert err is None, err          # no engine on this rank: nothing to compare here
    monkeypatch.setattr(verify, "trainer_tensors", real)
    err, _ = verify.verify_engines(module, SyncConfig(dtype=torch.float32, verify="full"), [_NotedEngine(full, "")], 2)
    assert err is None, err
