"""Checks of `lora_sync` that no test held (H32's mutation pass: each test below fails with the
check taken out), in process, fake engines, cheap."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import lora_sync

pytestmark = pytest.mark.timeout(60)


class Fake:
    """An SGLang-like engine (no staged swap): ``/v1/models``, unload, load; ``fail``: its loads raise."""

    def __init__(self, held=(), fail=False):
        self.held, self.fail, self.calls = set(held), fail, []

    def available_models(self):
        return {"object": "list", "data": [{"id": n} for n in sorted(self.held)]}

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))
        self.held.discard(name)

    def load_lora_adapter_from_tensors(self, name, tensors, cfg):
        self.calls.append(("load", name))
        if self.fail:
            raise RuntimeError("worker 0 ran out of memory")
        assert name not in self.held, "two adapters live under one name"
        self.held.add(name)


def test_under_abort_the_load_stops_at_the_first_failure_and_touches_no_other_replica():
    """``on_replica_failure="abort"`` (``keep_going=False``): a failed load ends the loads; the
    replicas after it keep their adapter untouched (no unload, no load that would have to be put
    back: each put back is one more chance of a replica left on another adapter)."""
    t = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}
    engines = [Fake({"L"}), Fake({"L"}, fail=True), Fake({"L"})]
    loaded, failed, had = lora_sync.load_all(engines, "L", t, {"r": 2}, None, keep_going=False)
    assert loaded == [0] and list(failed) == [1] and "out of memory" in failed[1]
    assert had == [True, True, None]
    assert engines[0].calls == [("unload", "L"), ("load", "L")]
    assert engines[2].calls == [] and engines[2].held == {"L"}
    # under quarantine (keep_going) the others still take it
    engines = [Fake({"L"}), Fake({"L"}, fail=True), Fake()]
    loaded, failed, had = lora_sync.load_all(engines, "L", t, {"r": 2}, None, keep_going=True)
    assert loaded == [0, 2] and list(failed) == [1] and had == [True, True, False]
    assert engines[2].calls == [("load", "L")]          # held none: nothing to unload


def _agree(err, what=""):
    from fsdp_sync.topology import SyncError
    if err is not None:
        raise SyncError(f"{what} failed: {err}")


def _lora():
    m = torch.nn.Linear(4, 4, bias=False)
    m.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
    m.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})
    m.weight.requires_grad_(False)
    return m


def _model():
    """peft's layout of a rank-2 adapter "default" on q_proj and v_proj (no transformers needed)."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_proj, layer.self_attn.v_proj = _lora(), _lora()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


class Dead(Fake):
    """A replica whose workers died: its checks raise, `fleet.problem` says why."""

    def dead_reason(self):
        return "worker 0 died"

    def lora_refusal(self, cfg, metas):
        raise RuntimeError("worker 0 does not answer")


def test_under_quarantine_every_replica_dead_fails_the_sync_before_any_load():
    """Each replica's check fails because it cannot take updates: each is taken out (``blame``),
    and with none left the sync fails saying so; it never goes on to load into no replica at all
    and report success."""
    from types import SimpleNamespace

    from fsdp_sync.topology import SyncError

    engines, out = [Dead(), Dead()], []
    config = SimpleNamespace(lora_name="L", dtype=torch.float32, verify="off")
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(SyncError, match=r"replica 1 cannot take updates \(RuntimeError: worker 0 does "
                                        r"not answer\): quarantined.*nothing was loaded"):
        lora_sync.sync_adapter(_model(), config, engines, cfg, {}, _agree, names=["replica 0", "replica 1"],
                               quarantine=lambda i, why: out.append(("q", i)),
                               blame=lambda i, why: out.append((i, why)))
    assert out == [(0, "worker 0 died"), (1, "worker 0 died")]
    assert all(e.calls == [] for e in engines)
    # one of two dead: the other takes the adapter, the dead one is out
    engines, out = [Dead(), Fake()], []
    stats = lora_sync.sync_adapter(_model(), config, engines, cfg, {}, _agree, names=["r0", "r1"],
                                   quarantine=lambda i, why: out.append(("q", i)),
                                   blame=lambda i, why: out.append((i, why)))
    assert out == [(0, "worker 0 died")] and engines[1].held == {"L"}
    assert stats.extra["replicas_out"] == ["r0: worker 0 died"]


def test_digest_verify_names_a_tensor_the_engine_holds_and_was_not_sent():
    from types import SimpleNamespace

    from fsdp_sync.verify import tensor_digest

    a = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    sent = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a}
    sums = {"model.layers.0.self_attn.q_proj.lora_A.weight": tensor_digest("model.layers.0.self_attn.q_proj.lora_A.weight", a)}
    engine = SimpleNamespace(lora_checksums=lambda name: (dict(sums), "float32"))
    assert lora_sync.verify_adapter(engine, "L", sent) is None
    sums["model.layers.0.self_attn.o_proj.lora_A.weight"] = "0" * 64
    assert lora_sync.verify_adapter(engine, "L", sent) == (
        "verify: the engine's adapter 'L' holds ['model.layers.0.self_attn.o_proj.lora_A.weight'] "
        "that was not sent")


def test_an_fsdp1_flat_parameter_counts_by_the_tensors_it_holds():
    """FSDP1 (``use_orig_params=False``): one flat parameter, one ``requires_grad`` for the tensors
    it flattens (``_fqns``): one holding the adapter alone is no base that trains; one holding a
    base weight is, named by that weight."""
    from types import SimpleNamespace

    from fsdp_sync.weights.peft_names import trainable_base

    lora = SimpleNamespace(requires_grad=True, _fqns=("q_proj.lora_A.default.weight", "q_proj.lora_B.default.weight"))
    base = SimpleNamespace(requires_grad=True, _fqns=("q_proj.base_layer.weight", "q_proj.lora_A.default.weight"))
    frozen = SimpleNamespace(requires_grad=False, _fqns=("o_proj.weight",))
    assert trainable_base([("layers.0._fsdp_wrapped_module._flat_param", lora)]) == []
    assert trainable_base([("layers.0._flat_param", base), ("layers.1._flat_param", frozen)]) == [
        "layers.0.q_proj.base_layer.weight"]


def test_verify_compares_the_adapter_bit_for_bit():
    """A tensor of the right shape whose values differ is named (the largest difference with it);
    bit for bit: -0.0 where 0.0 was sent differs, a NaN with the same bits does not."""
    from types import SimpleNamespace

    a = torch.tensor([[0.0, 1.0, float("nan"), 3.0]])
    sent = {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": a}
    held = {"model.layers.0.self_attn.q_proj.lora_B.weight": a.clone()}
    engine = SimpleNamespace(lora_tensors=lambda name: dict(held))
    assert lora_sync.verify_adapter(engine, "L", sent) is None
    held["model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.tensor([[0.0, 1.5, float("nan"), 3.0]])
    assert lora_sync.verify_adapter(engine, "L", sent).startswith(
        "verify: adapter 'L' tensor 'model.layers.0.self_attn.q_proj.lora_B.weight' differs from the "
        "trainer's (max abs difference ")
    held["model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.tensor([[-0.0, 1.0, float("nan"), 3.0]])
    assert "differs from the trainer's" in lora_sync.verify_adapter(engine, "L", sent)


def test_adapter_syncs_release_the_kv_cache_only():
    """Under lora="adapter" the base is sent once and must still be there at the next sync: only
    the KV cache is released between syncs (as verl does for LoRA), never the weights."""
    from types import SimpleNamespace

    on, off = SimpleNamespace(lora="adapter"), SimpleNamespace(lora="off")
    assert lora_sync.memory_tags(on, None) == ["kv_cache"]
    assert lora_sync.memory_tags(on, ["weights", "kv_cache"]) == ["kv_cache"]
    assert lora_sync.memory_tags(on, ["weights"]) == []
    assert lora_sync.memory_tags(off, ["weights"]) == ["weights"] and lora_sync.memory_tags(off, None) is None
