"""The installed SGLang (0.5.23, or 0.5.12 in `make test-sglang`'s older-release run) against the
fake the default tier's ``tests/test_sgladapt_lora_rank.py`` refuses an over-rank adapter with:

- its ``ServerArgs``, parsed from ``--enable-lora --max-lora-rank 8 --lora-target-modules q_proj
  v_proj`` (and from no LoRA flag) with its own CLI parser, reports the LoRA launch arguments the
  fake's server info carries (`SERVER_LORA_ARGS`, `NO_LORA_ARGS`; what ``get_server_info``
  answers: ``resolved_dict()`` in 0.5.23, the dataclass's fields in 0.5.12);
- its ``LoRAManager.validate_new_adapter``, with its ``LoRAMemoryPool.can_support`` for a pool of
  ``max_lora_rank`` 8, refuses a rank-16 ``LoRAConfig.from_dict`` with the fake's message
  (`SGLANG_RANK_REFUSAL`) and takes rank 8;
- `SGLangEngine.lora_refusal` on a server whose info is that ``ServerArgs``' names r=16 and the
  limit 8, and nothing is sent.

The LoRA pieces run in a process of their own: the stand-ins their imports need (`sglang_models`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sync.engines.sglang import SGLangEngine

TIER = Path(__file__).resolve().parent
sys.path.insert(0, str(TIER.parent))
import fake_sglang as fake  # noqa: E402
from test_sgladapt_lora_rank import (NO_LORA_ARGS, SERVER_LORA_ARGS, SGLANG_RANK_REFUSAL,  # noqa: E402
                                     as_launched, config, tensors)

pytestmark = pytest.mark.sglang

READ = r"""
import argparse, dataclasses, importlib.util, json, os, sys, types
sys.path.insert(0, sys.argv[1])
import sglang_models
srt = os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), "srt")
if not os.path.exists(os.path.join(srt, "runtime_context.py")):      # 0.5.12, as sglang_lora.py
    sglang_models.STUBS = sglang_models.STUBS + ("sglang.srt.configs.qwen3_asr", "sglang.srt.function_call")
from sglang.srt.server_args import ServerArgs
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.lora.mem_pool import LoRAMemoryPool

def info(flags):
    # the LoRA server args of a launch with ``flags`` ({field: value}, as the CLI parses them)
    if hasattr(ServerArgs, "resolved_dict"):   # 0.5.23: get_server_info's source, from its CLI
        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        argv = ["--model-path", "/unused"]
        for k, v in flags.items():
            argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(x) for x in
                                                                     (v if isinstance(v, list) else [v])])
        d = ServerArgs.from_cli_args(p.parse_args(argv)).resolved_dict()
    else:   # 0.5.12: dataclasses.asdict(server_args) after __post_init__, which needs a GPU (and
        # its CLI parser the stubbed reasoning parsers): the fields' defaults with ``flags``, then
        # __post_init__'s LoRA part, check_lora_server_args
        args = types.SimpleNamespace(**{f.name: f.default if f.default is not dataclasses.MISSING
                                        else f.default_factory() if f.default_factory
                                        is not dataclasses.MISSING else None
                                        for f in dataclasses.fields(ServerArgs)})
        vars(args).update(flags)
        ServerArgs.check_lora_server_args(args)
        d = vars(args)
    return {k: d.get(k, "<absent>") for k in ("enable_lora", "max_lora_rank", "lora_paths",
                                              "lora_target_modules")}

pool = types.SimpleNamespace(max_lora_rank=8, lora_added_tokens_size=0, target_modules={"qkv_proj"})
pool.can_support = lambda cfg: LoRAMemoryPool.can_support(pool, cfg)
manager = types.SimpleNamespace(memory_pool=pool, lora_refs={}, num_pinned_loras=0,
                                max_loras_per_batch=8, attn_dp_enabled=False)
answers = {}
for r in (8, 16):
    cfg = LoRAConfig.from_dict(json.loads(sys.argv[2].replace("RANK", str(r))), None, base_vocab_size=32)
    try:
        LoRAManager.validate_new_adapter(manager, cfg, LoRARef(lora_name="L", lora_path="__tensor__"))
        answers[r] = None
    except ValueError as e:
        answers[r] = str(e)
print("RESULT " + json.dumps({
    "lora": info({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}),
    "none": info({}), "answers": answers}, default=sorted))     # a set goes out as a list (FastAPI's)
"""


@pytest.fixture(scope="module")
def real():
    cfg = json.dumps(config(0)).replace('"r": 0', '"r": RANK').replace('"lora_alpha": 0', '"lora_alpha": 16')
    proc = subprocess.run([sys.executable, "-c", READ, str(TIER), cfg], capture_output=True, text=True,
                          timeout=200)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    return json.loads(line[7:])


@pytest.mark.timeout(240)
def test_the_fakes_server_info_is_sglangs(real):
    # lora_paths: None as 0.5.23 reports it, [] as 0.5.12's check_lora_server_args leaves it
    assert dict(real["lora"], lora_paths=real["lora"]["lora_paths"] or None) == SERVER_LORA_ARGS, real["lora"]
    none = {k: real["none"][k] for k in NO_LORA_ARGS}
    assert dict(none, lora_paths=none["lora_paths"] or None) in (NO_LORA_ARGS, dict(NO_LORA_ARGS, enable_lora=False)), none


@pytest.mark.timeout(240)
def test_sglang_refuses_over_rank_late_with_the_fakes_message(real):
    assert real["answers"]["8"] is None
    assert real["answers"]["16"] == SGLANG_RANK_REFUSAL.format(name="L", r=16)


@pytest.mark.timeout(240)
def test_the_adapter_refuses_before_sending_on_sglangs_server_info(real):
    import sglang

    version = "0.5.12" if sglang.__version__.startswith("0.5.12") else "0.5.23"
    with fake.FakeSGLangServer(tp_size=2, version=version) as srv:
        as_launched(srv.engine, real["lora"])
        a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
        why = a.lora_refusal(config(16))
        assert why and "r=16" in why and "--max-lora-rank 8" in why, why
        assert a.lora_refusal(config(8)) is None
        a.load_lora_adapter_from_tensors("L", tensors(8), config(8))
        assert srv.hits.get("/load_lora_adapter_from_tensors") == 1
