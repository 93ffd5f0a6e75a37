"""`transport.update_group`: an engine's answer saying it failed is an error, and an engine's TP
size is read or refused by name.

SGLang's in-process ``Engine`` answers ``init_weights_update_group`` / ``update_weights_from_distributed``
with ``(success, message)`` instead of raising, and its HTTP server with ``{"success": false,
"message": ...}``: a ``False`` there must fail the call naming it and carrying the engine's
message, or the trainer would go on as if the engine had joined (or loaded) while it had not.
"""

from __future__ import annotations

import types

import pytest

from fsdp_sync.transport.update_group import check_answer, engine_tp


@pytest.mark.parametrize("answer", [(False, "NCCL error: unhandled system error"),
                                    (False, "NCCL error: unhandled system error", {"extra": 1}),
                                    {"success": False, "message": "NCCL error: unhandled system error"}])
def test_an_answer_saying_it_failed_fails_the_call_with_the_engines_message(answer):
    with pytest.raises(RuntimeError) as info:
        check_answer(answer, "engine 1 init_weights_update_group")
    assert str(info.value) == "engine 1 init_weights_update_group: NCCL error: unhandled system error"


@pytest.mark.parametrize("answer", [(True, "Succeeded"), {"success": True, "message": ""}, None, {"ok": 1}])
def test_an_answer_that_did_not_fail_is_handed_back(answer):
    assert check_answer(answer, "engine 0 update_weights_from_distributed") is answer


@pytest.mark.parametrize("tp, want", [(2, 2), (lambda: 4, 4)])
def test_an_engines_tp_size_is_its_attribute_or_method(tp, want):
    assert engine_tp(types.SimpleNamespace(tp_size=tp)) == want


@pytest.mark.parametrize("tp", [0, -1, None, "2", 1.0])
def test_an_engine_without_a_usable_tp_size_is_refused_by_name(tp):
    with pytest.raises(ValueError) as info:
        engine_tp(types.SimpleNamespace(tp_size=tp))
    assert str(info.value).startswith("cannot tell the TP size of engine namespace(")
    assert str(info.value).endswith(f"(tp_size = {tp!r}); the update group's ranks depend on it")


class _JoinsOnPaper:
    """An engine whose ``init_weights_update_group`` says it joined but never reaches the store
    (its workers died on the way): the trainer's rendezvous times out."""

    tp_size = 1

    def __init__(self) -> None:
        self.left: list[str] = []

    def init_weights_update_group(self, **kw):
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name):
        self.left.append(group_name)
        return True, "Succeeded to destroy custom process group."


@pytest.mark.timeout(60)
def test_a_failed_opening_tells_an_engine_that_said_it_joined_to_leave_the_group():
    import torch

    from fsdp_sync.transport.update_group import EngineCalls, open_group

    engine = _JoinsOnPaper()
    cfg = types.SimpleNamespace(dist_group_name="fsdp_sync_test_leave", dist_timeout_s=2.0,
                                dist_backend="gloo", dist_master_address="127.0.0.1", dist_master_port=None)
    with pytest.raises(RuntimeError) as info:
        open_group([engine], cfg, torch.device("cpu"), "gloo", EngineCalls())
    assert "making the weight-update group 'fsdp_sync_test_leave' at 127.0.0.1:" in str(info.value)
    assert "not every engine TP worker joined within dist_timeout_s=2.0s" in str(info.value)
    assert engine.left == ["fsdp_sync_test_leave"]          # told to leave the half-made group
