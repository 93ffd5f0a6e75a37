"""SGLang's own memory handlers under the calls `SGLangEngine` makes for the manager's stages.

SGLang's scheduler keeps the released tags in a set: ``release_memory_occupation`` adds them,
``resume_memory_occupation`` ``remove``s each one, so a resume of a tag SGLang holds raises
KeyError, and an exception in a handler makes its server quit. A freshly launched SGLang holds
everything, so the manager's first ``with`` (resume weights, later the KV cache) must resume
nothing, and ``multi_stage_wake_up=False`` (resume all) must not resume the CUDA-graph pool it
never released. The handlers cannot run whole on a CPU (their module imports GPU-only packages),
so their source is taken from the installed release's file and run on a stand-in of the scheduler
state: the release under test is whichever is on the path (0.5.23, and 0.5.12 in the tier's
old-release pass, see the Makefile's SGLANG_OLD_TESTS).
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import sglang
import torch
from sglang.srt import constants

import fake_sglang as fake
from fsdp_sync.config import SyncConfig
from fsdp_sync.engines import sglang as sg
from fsdp_sync.manager import FSDPShardingManager

pytestmark = [pytest.mark.sglang]

HANDLERS = ("release_memory_occupation", "resume_memory_occupation", "_export_static_state",
            "_import_static_state")


def _source() -> Path:
    root = Path(sglang.__file__).parent / "srt" / "managers"
    for rel in ("scheduler_components/weight_updater.py", "scheduler_update_weights_mixin.py"):
        if (root / rel).exists():
            return root / rel
    raise AssertionError(f"no memory handlers found under {root} (sglang {sglang.__version__})")


def _handlers() -> dict:
    """SGLang's functions of `HANDLERS`, compiled from its own file (annotations dropped)."""
    path = _source()
    tree = ast.parse(path.read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in HANDLERS and node.name not in found:
            node.returns = None
            for a in node.args.args:
                a.annotation = None
            found[node.name] = node
    assert set(found) == set(HANDLERS), (path, sorted(found))
    barrier = types.SimpleNamespace(barrier=lambda *a, **k: None)   # one TP rank
    ns = {name: getattr(constants, name) for name in dir(constants) if name.startswith("GPU_MEMORY")}
    ns["torch"] = types.SimpleNamespace(distributed=barrier, inference_mode=torch.inference_mode,
                                        get_device_module=lambda: torch.cpu)
    for out in ("ReleaseMemoryOccupationReqOutput", "ResumeMemoryOccupationReqOutput"):
        ns[out] = types.SimpleNamespace         # the answer's type: an empty reply either way
    exec(compile(ast.Module(list(found.values()), []), str(path), "exec"), ns)
    return ns


class SGLangMemory(fake.FakeSGLangEngine):
    """The fake engine with SGLang's own release/resume handlers on a stand-in scheduler."""

    def __init__(self) -> None:
        super().__init__(tp_size=1)
        self.h = _handlers()
        self.saver: list[tuple[str, str]] = []
        model = torch.nn.Linear(2, 2)
        model.register_buffer("inv_freq", torch.arange(3.0))
        self.state = types.SimpleNamespace(
            offload_tags=set(), scheduler=None, tp_cpu_group=None,
            memory_saver_adapter=types.SimpleNamespace(
                pause=lambda tag: self.saver.append(("pause", tag)),
                resume=lambda tag: self.saver.append(("resume", tag))),
            is_fully_idle=lambda **_: True, flush_cache=lambda: True,
            _assert_weight_cache_inactive=lambda op: None,
            tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model)))
        for name in ("_export_static_state", "_import_static_state"):
            setattr(self.state, name, self.h[name])

    def release_memory_occupation(self, tags=None):
        self._record("release_memory_occupation", tags=tags)
        self.h["release_memory_occupation"](self.state, types.SimpleNamespace(tags=tags))

    def resume_memory_occupation(self, tags=None):
        self._record("resume_memory_occupation", tags=tags)
        self.h["resume_memory_occupation"](self.state, types.SimpleNamespace(tags=tags))


def _stages(engine: sg.SGLangEngine, multi_stage: bool) -> types.SimpleNamespace:
    """The manager's own `_resume` / `_release` on a stand-in holding just what they read."""
    return types.SimpleNamespace(config=SyncConfig(multi_stage_wake_up=multi_stage),
                                 transport=types.SimpleNamespace(colocated=True), engines=[engine])


@pytest.mark.timeout(60)
def test_sglangs_own_handler_quits_on_a_resume_of_what_it_holds():
    eng = SGLangMemory()
    with pytest.raises(KeyError):
        eng.resume_memory_occupation(["weights"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("multi_stage", [True, False], ids=["multi_stage", "resume_all"])
def test_the_managers_stages_on_a_launched_engine_pass_sglangs_handlers(multi_stage):
    eng = SGLangMemory()
    adapter = sg.SGLangEngine(eng, tp_size=1)
    m = _stages(adapter, multi_stage)
    for _ in range(3):                                 # three syncs: launched, then released
        if multi_stage:
            FSDPShardingManager._resume(m, ["weights"])
            FSDPShardingManager._resume(m, ["kv_cache"])
        else:
            FSDPShardingManager._resume(m, None)
        assert eng.state.offload_tags == set()         # SGLang holds all it needs to generate
        assert not hasattr(eng.state, "stashed_model_static_state")   # taken back if released
        FSDPShardingManager._release(m)
        assert eng.state.offload_tags == {"kv_cache", "weights"}
    resumed = [tag for op, tag in eng.saver if op == "resume"]
    paused = [tag for op, tag in eng.saver if op == "pause"]
    assert paused == ["kv_cache", "weights"] * 3
    assert resumed == ["weights", "kv_cache"] * 2      # the first sync resumed nothing: all held


@pytest.mark.timeout(60)
def test_an_engine_released_before_it_was_wrapped():
    eng = SGLangMemory()
    eng.release_memory_occupation(["kv_cache", "weights"])      # as verl does after launching it
    adapter = sg.SGLangEngine(eng, tp_size=1, released_tags=["kv_cache", "weights"])
    adapter.resume_memory_occupation(["weights"])
    adapter.resume_memory_occupation(["kv_cache"])
    assert eng.state.offload_tags == set()
