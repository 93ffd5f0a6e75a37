"""The disk method's ``layout="engine"`` (per-rank files) is cut for ONE engine split and model:
engines of different TP sizes, or an engine holding another model than the trainer's, are refused
before anything is written, naming what differs; ``layout="auto"`` writes Hugging Face files then.

One process (no process group): `disk_ranked.choose_layout` on trainer rank 0, with stand-in
engines that say what the reference engine says (``accepts_rank_checkpoints``, ``tp_size`` and
their `layout.TPLayout`).
"""

from __future__ import annotations

import types

import pytest

from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError
from fsdp_sync.transport.disk_ranked import choose_layout
from fsdp_sync.weights.layout import layout_for


def _engine(tp: int, cfg=None):
    return types.SimpleNamespace(accepts_rank_checkpoints=True, tp_size=tp,
                                 layout=layout_for(cfg, tp) if cfg is not None else None)


def _ctx(module, engines, layout="engine"):
    return types.SimpleNamespace(module=module, engines=engines,
                                 config=types.SimpleNamespace(layout=layout, fsdp1_state_dict="sharded"))


def test_engines_of_one_tp_size_and_the_trainers_model_get_the_engine_layout():
    cfg = load_config("tiny")
    module = build_model(cfg)
    got = choose_layout(_ctx(module, [_engine(2, cfg), _engine(2, cfg)]), 0, None, "sync")
    assert got is not None and got.tp == 2 and got.spec == layout_for(cfg, 2).spec


def test_engines_of_different_tp_sizes_are_refused_naming_the_sizes():
    cfg = load_config("tiny")
    module = build_model(cfg)
    with pytest.raises(SyncError) as info:
        choose_layout(_ctx(module, [_engine(2, cfg), _engine(1, cfg)]), 0, None, "sync")
    assert "the engines' TP sizes [1, 2] differ: per-rank files are cut for one" in str(info.value)
    assert "use layout='full'" in str(info.value)
    # "auto": Hugging Face files instead
    assert choose_layout(_ctx(module, [_engine(2, cfg), _engine(1, cfg)], "auto"), 0, None, "sync") is None


def test_an_engine_holding_another_model_is_refused_naming_what_differs():
    cfg = load_config("tiny")
    module = build_model(cfg)
    other = load_config("tiny", vocab_size=cfg.vocab_size + 64)
    with pytest.raises(SyncError) as info:
        choose_layout(_ctx(module, [_engine(2, cfg), _engine(2, other)]), 0, None, "sync")
    assert (f"engine 1's model differs from the trainer's (trainer, engine): "
            f"{{'vocab_size': ({cfg.vocab_size}, {cfg.vocab_size + 64})}}") in str(info.value)
    assert choose_layout(_ctx(module, [_engine(2, other)], "auto"), 0, None, "sync") is None
