"""`SGLangEngine.lora_refusal`'s target-module check against the installed SGLang's own (0.5.23, or
0.5.12 in `make test-sglang`'s older-release run): for every pair of a server's
``--lora-target-modules`` and an adapter's ``target_modules`` below, SGLang's
``LoRAManager.init_lora_shapes`` sizes the pool from the server's list and its
``validate_new_adapter`` (with ``LoRAMemoryPool.can_support``) takes or refuses a
``LoRAConfig.from_dict`` of the adapter; `SGLangEngine`, on a fake server whose info reports that
list, must refuse exactly the adapters SGLang refuses (no false refusal: an adapter SGLang takes
passes), naming each module outside and the flag. Also `peft_names.sglang_targets` equals SGLang's
``get_normalized_target_modules`` name for name. A server launched with ``all`` is left out here:
SGLang sizes it from the base model (not checked up front, tests/test_h11_lora_targets.py).

The LoRA pieces run in a process of their own: the stand-ins their imports need (`sglang_models`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.engines.sglang import versions
from fsdp_sync.weights.peft_names import sglang_targets

TIER = Path(__file__).resolve().parent
sys.path.insert(0, str(TIER.parent))
import fake_sglang as fake  # noqa: E402
from test_sgladapt_lora_rank import SERVER_LORA_ARGS  # noqa: E402

pytestmark = pytest.mark.sglang

SERVERS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["qkv_proj"],
           ["gate_proj", "up_proj", "down_proj"], ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"],
           ["q_proj", "v_proj", "wk"], ["k_proj"]]
ADAPTERS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj"], ["q_proj", "v_proj", "o_proj"],
            ["gate_proj", "up_proj"], ["up_proj"], ["down_proj"], ["qkv_proj"], ["o_proj"],
            ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"],
            ["wk"], ["indexer.wk"], ["q_proj", "all"], "all-linear", "all", "q_proj.*",
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]

READ = r"""
import importlib.util, json, os, sys, types
sys.path.insert(0, sys.argv[1])
import sglang_models
srt = os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), "srt")
if not os.path.exists(os.path.join(srt, "runtime_context.py")):      # 0.5.12, as sglang_lora.py
    sglang_models.STUBS = sglang_models.STUBS + ("sglang.srt.configs.qwen3_asr", "sglang.srt.function_call")
import torch
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.lora.mem_pool import LoRAMemoryPool
from sglang.srt.lora.utils import get_normalized_target_modules

servers, adapters = json.loads(sys.argv[2]), json.loads(sys.argv[3])
answers, names = [], {}
for served in servers:
    # what LoRAManager.init_state does with the server args (a set after ServerArgs' checks)
    manager = types.SimpleNamespace(configs={}, lora_refs={}, base_model=torch.nn.Module(),
                                    lora_added_tokens_size=0)
    LoRAManager.init_lora_shapes(manager, max_lora_rank=8, target_modules=set(served))
    pool = types.SimpleNamespace(max_lora_rank=8, lora_added_tokens_size=0,
                                 target_modules=manager.target_modules)
    pool.can_support = lambda cfg, pool=pool: LoRAMemoryPool.can_support(pool, cfg)
    m = types.SimpleNamespace(memory_pool=pool, lora_refs={}, num_pinned_loras=0,
                              max_loras_per_batch=8, attn_dp_enabled=False)
    for tm in adapters:
        cfg = LoRAConfig.from_dict({"r": 8, "lora_alpha": 16, "target_modules": tm,
                                    "peft_type": "LORA"}, None, base_vocab_size=32)
        try:
            LoRAManager.validate_new_adapter(m, cfg, LoRARef(lora_name="L", lora_path="__tensor__"))
            answers.append([served, tm, None])
        except ValueError as e:
            answers.append([served, tm, str(e)])
for tm in adapters + servers:
    try:
        names[json.dumps(tm)] = sorted(get_normalized_target_modules(tm))
    except ValueError as e:
        names[json.dumps(tm)] = str(e)
print("RESULT " + json.dumps({"answers": answers, "names": names}))
"""


@pytest.fixture(scope="module")
def real():
    proc = subprocess.run([sys.executable, "-c", READ, str(TIER), json.dumps(SERVERS), json.dumps(ADAPTERS)],
                          capture_output=True, text=True, timeout=200)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    return json.loads(line[7:])


def _version():
    import sglang

    return "0.5.12" if sglang.__version__.startswith("0.5.12") else "0.5.23"


@pytest.mark.timeout(240)
def test_sglang_targets_normalizes_as_sglang_does(real):
    version = versions.parse(_version())
    for key, want in real["names"].items():
        ours = sglang_targets(json.loads(key), version)
        if isinstance(want, str):          # SGLang raises: a string other than all / all-linear
            assert ours is None and "Only 'all' or 'all-linear'" in want, (key, want)
        else:
            assert ours is not None and sorted(ours) == want, (key, ours, want)


@pytest.mark.timeout(240)
def test_the_adapter_refuses_exactly_what_sglang_refuses(real):
    assert any(why is None for *_, why in real["answers"]) and \
        any(why is not None for *_, why in real["answers"])      # both kinds are exercised
    for served in SERVERS:
        with fake.FakeSGLangServer(tp_size=1, version=_version()) as srv:
            info = srv.engine.get_server_info
            srv.engine.get_server_info = lambda: {**info(), **dict(SERVER_LORA_ARGS,
                                                                   lora_target_modules=served)}
            a = SGLangEngine(base_url=srv.url, retry_backoff_s=0.01)
            for s, tm, sglang_why in real["answers"]:
                if s != served:
                    continue
                cfg = {"r": 8, "lora_alpha": 16, "target_modules": tm, "peft_type": "LORA"}
                ours = a.lora_refusal(cfg)
                assert (ours is None) == (sglang_why is None), (served, tm, ours, sglang_why)
                if ours is None or isinstance(tm, str):
                    continue
                assert "incompatible with the current LoRA memory pool" in sglang_why, sglang_why
                assert f"--lora-target-modules {sorted(served)}" in ours, ours
                outside = sorted(m for m in tm if not sglang_targets([m]) <= sglang_targets(served))
                assert f"its target_modules {outside} lie outside" in ours, ours
                flag = ours.split("restart SGLang with --lora-target-modules ")[1].split(" (or all)")[0]
                # the flag it names makes SGLang take the adapter (checked with the same rule)
                assert sglang_targets(tm) <= sglang_targets(flag.split()), (flag, tm)
