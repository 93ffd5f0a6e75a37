"""The export of modules as users' runs wrap them, with torch's own wrappers rather than stand-ins
(test_export's ``Holder``): FSDP2 ``fully_shard`` units of mixed dtypes (a bfloat16 model whose
norms stay float32, each norm a unit of its own as FSDP2 requires, under ``MixedPrecisionPolicy``)
with a frozen layer; and FSDP1 over layers wrapped by ``apply_activation_checkpointing``, whose
module names keep ``_checkpoint_wrapped_module`` (FSDP1's names come from the modules). Every
tensor, per parameter and per bucket, must be bit-exact against the unsharded module's
``state_dict`` under its Hugging Face name, in its order, cast where asked. One in-process rank
(`conftest.one_rank`): names, dtypes and order are what is checked here; sharding across ranks is
test_export's. (``torch.compile``'d layers under FSDP2 export the same names too, checked by hand:
its first call costs 2 s of imports no other default-tier test pays, and test_export's
``_orig_mod`` stand-in covers the name.)
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export

# FSDP1 at world size 1 runs NO_SHARD and says so (as every FSDP1 unit here is meant to)
pytestmark = pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")

BF16 = torch.bfloat16


def _model():
    model = build_model(load_config("tiny"), seed=0)
    with torch.no_grad():      # values bfloat16 cannot hold: a cast that is not done shows
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    return model


def _reference(model) -> dict:
    return {export.hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def _check(model, ref: dict, dtype, **kw) -> None:
    want = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in ref.items()}
    got = dict(export.iter_params(model, dtype=dtype, **kw))
    assert list(got) == list(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, bad
    flat_got = {}
    for b, flat in export.iter_buckets(model, 4096, dtype=dtype, **kw, alloc=lambda n: torch.empty(n, dtype=torch.uint8)):
        flat_got.update({e.name: flat[e.start:e.end].view(e.dtype).view(e.shape).clone() for e in b.entries})
    assert list(flat_got) == list(want)
    bad = [k for k in want if flat_got[k].dtype != want[k].dtype or not torch.equal(flat_got[k], want[k])]
    assert not bad, bad


@pytest.mark.timeout(60)
def test_fsdp2_mixed_dtype_units_with_a_frozen_layer(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model().to(BF16)
    norms = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1].endswith("norm")]
    for m in norms:
        m.float()
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    ref = _reference(model)
    assert {v.dtype for v in ref.values()} == {BF16, torch.float32}
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=BF16)
    for m in norms:
        fully_shard(m, mesh=mesh, mp_policy=mp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for dtype in (None, BF16):
        _check(model, ref, dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_over_activation_checkpointed_layers_exports_hf_names(one_rank, use_orig_params):
    """FSDP1 names come from the modules (`export._fsdp1_layout`), where torch's checkpoint
    wrapper's ``_checkpoint_wrapped_module`` level stays (its state-dict hook hides it from
    ``state_dict`` only)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = _model()
    ref = _reference(model)
    layer_type = type(model.model.layers[0])
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, layer_type))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_type}), device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
    assert [m.name for m in export.param_metas(model)] == list(ref)
    for kind in export.STATE_DICT_TYPES:
        _check(model, ref, BF16, fsdp1_state_dict=kind)


@pytest.mark.timeout(60)
def test_fsdp1_tied_embedding_in_a_unit_of_its_own_is_exported_once(one_rank):
    """A tied model (lm_head is embed_tokens' Parameter) under FSDP1 with ``use_orig_params`` and
    the embedding wrapped apart (a size-based or an Embedding wrap policy): lm_head, in the root
    unit, keeps the original parameter that the embedding's unit flattened. That is the tied
    weight, exported once under its first name (as without FSDP), not refused as "held by an
    FSDP1 unit outside this module" (it was: the root itself was refused). At one rank FSDP1
    runs NO_SHARD, where torch trains this model; a sharding strategy cannot run its forward."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build_model(load_config("tiny-tied"), seed=0)
    ref = _reference(model)
    del ref["lm_head.weight"]       # the tied alias: exported under model.embed_tokens.weight
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0]), nn.Embedding}),
                 device_id=torch.device("cpu"), use_orig_params=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [m.name for m in export.param_metas(model)] == list(ref)
    for kind in export.STATE_DICT_TYPES:
        _check(model, ref, None, fsdp1_state_dict=kind)
