"""The disk method's fleet load against SGLang 0.5.23's own weight-update code, on CPU.

Two replicas, each SGLang's scheduler-side ``SchedulerWeightUpdaterManager`` over its model-runner
``WeightUpdater`` (begin/end, ``update_weights_from_disk`` -> ``load_weights_and_postprocess``),
behind an in-process stand-in of ``sglang.Engine``'s methods whose ``update_weights_from_disk``
does what its tokenizer manager does (``load_format=None`` becomes the launch ``--load-format``:
here ``dummy``). The model is a toy linear layer whose quant method counts
``process_weights_after_loading`` and, like SGLang's non-idempotent ones (online FP8 transposes,
aiter MoE shuffles), repacks the weight each time it runs.

Before, a fleet disk sync wrapped each replica's load in begin/end: SGLang post-processed the
weights at the load and again at ``end_weight_update`` (its session never counts a disk load),
so every layer was repacked twice and served scrambled weights with no error; and it sent no
load format, which a ``--load-format dummy`` server refused. Now (`transport.disk_load`, run here through `DiskTransport`'s step 4): one
post-process per layer per replica, the new weights served, the format ``auto``. A control run
of begin/disk/end shows the toy detects the double post-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{HERE.parents[1]}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__, str(tmp_path_factory.mktemp("ckpt"))],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_two_replica_disk_fleet_post_processes_each_layer_once(report):
    fleet = report["fleet"]
    assert fleet["error"] is None, fleet["error"]
    assert fleet["post_processes"] == [1, 1], fleet       # one per layer per replica
    assert fleet["post_load_weights"] == [0, 0], fleet
    assert fleet["serves_new_weights"] == [True, True], fleet
    assert fleet["calls"] == [["update_weights_from_disk"]] * 2, fleet   # no begin/end


def test_the_control_shows_the_double_post_process_a_session_caused(report):
    control = report["control"]
    assert control["post_processes"] == 2 and not control["serves_new_weights"], control


def test_the_fleet_names_the_format_a_dummy_launched_sglang_needs(report):
    assert "Failed to get model loader" in report["no_format"], report["no_format"]   # None: refused
    fleet = report["fleet_dummy"]
    assert fleet["error"] is None and fleet["serves_new_weights"] == [True, True], fleet
    assert fleet["load_formats"] == [["auto"]] * 2, fleet


# --------------------------------------------------------------------------- the subprocess

def _main(ckpt_dir: str) -> dict:
    import types

    import sglang_models  # noqa: F401 - the tier's stand-ins for GPU-only imports
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    import sglang.srt.managers.scheduler_components.weight_updater as sched_wu
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                               UpdateWeightFromDiskReqInput)
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.server_args import ServerArgs

    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.transport.disk import DiskTransport

    dist.barrier = lambda *a, **k: None        # TP 1: SGLang's tp_cpu_group barrier does nothing
    sched_wu.get_parallel = lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None),
                                                          tp_rank=0)

    class Repacking(QuantizeMethodBase):
        def __init__(self):
            self.calls = 0

        def create_weights(self, *a, **k):
            pass

        def apply(self, layer, x, bias=None):
            return x @ layer.weight.flip(0).t()

        def process_weights_after_loading(self, layer):
            self.calls += 1
            layer.weight.data.copy_(layer.weight.data.flip(0))

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 3, bias=False)
            self.lin.quant_method = Repacking()
            self.post_load = 0

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for n, t in weights:
                params[n].data.copy_(t)

        def post_load_weights(self):
            self.post_load += 1

    new = torch.arange(6, dtype=torch.float32).view(3, 2)
    save_file({"lin.weight": new}, os.path.join(ckpt_dir, "model.safetensors"))
    with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                   "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
                   "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-6, "torch_dtype": "float32"}, f)
    sa = ServerArgs(model_path=ckpt_dir, device="cpu", tp_size=1, skip_tokenizer_init=True,
                    load_format="dummy")
    rc.get_parallel().clear_stamp()
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))

    def replica():
        model = Toy()
        cfg = types.SimpleNamespace(model_path=ckpt_dir, revision=None, dtype=torch.float32, quantization=None,
                                    hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"],
                                                                    model_type="llama"))
        mr = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=cfg, custom_weight_loaders=[],
                           get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                           recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        tpw = types.SimpleNamespace(weight_update_runners=lambda: [("target", types.SimpleNamespace(weight_updater=mr))],
                                    model_runner=types.SimpleNamespace(weight_updater=mr))
        mgr = sched_wu.SchedulerWeightUpdaterManager(
            tp_worker=tpw, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **k: True,
            is_fully_idle=lambda **k: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=lambda new_version: None))
        return model, mgr

    class Engine:
        """``sglang.Engine``'s weight-update methods (0.5.23 signatures) over one replica."""

        def __init__(self, launch: str = "auto"):
            self.model, self.mgr = replica()
            self.calls, self.formats = [], []
            self.launch = launch        # its --load-format

        def begin_weight_update(self, selector="all"):
            self.calls.append("begin_weight_update")
            return self.mgr.begin_weight_update(BeginWeightUpdateReqInput(selector=selector))

        def end_weight_update(self):
            self.calls.append("end_weight_update")
            return self.mgr.end_weight_update(EndWeightUpdateReqInput())

        def update_weights_from_disk(self, model_path, load_format=None):
            self.calls.append("update_weights_from_disk")
            self.formats.append(load_format)
            # the tokenizer manager: None becomes the launch --load-format
            fmt = self.launch if load_format is None else load_format
            return self.mgr.update_weights_from_disk(UpdateWeightFromDiskReqInput(
                model_path=model_path, load_format=fmt, flush_cache=False))

    def serves_new(model):         # what the layer computes with, its repacking undone
        return torch.equal(model.lin.weight.detach().flip(0), new)

    def fleet(launch: str) -> dict:
        fakes = [Engine(launch), Engine(launch)]
        ctx = types.SimpleNamespace(engines=[SGLangEngine(e, tp_size=1) for e in fakes], version=None,
                                    config=types.SimpleNamespace(pause_mode=None), reload=False,
                                    commit_failed=None, stats=types.SimpleNamespace(engine_calls=0))
        error = None
        try:      # a disk sync's step 4, as trainer rank 0 runs it (one process: no peers)
            DiskTransport(types.SimpleNamespace(disk_dir=ckpt_dir))._load(ctx, ckpt_dir, None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "post_processes": [e.model.lin.quant_method.calls for e in fakes],
                "post_load_weights": [e.model.post_load for e in fakes],
                "serves_new_weights": [serves_new(e.model) for e in fakes],
                "calls": [e.calls for e in fakes], "load_formats": [e.formats for e in fakes]}

    # launched with the default --load-format auto (a load without a format reads the files), then
    # with dummy (verl's rollout servers): the format the transport names is what counts
    out = {"fleet": fleet("auto"), "fleet_dummy": fleet("dummy")}
    # the control: what the disk fleet sent before (begin, disk, end) on one replica
    e = Engine()
    e.begin_weight_update()
    e.update_weights_from_disk(ckpt_dir, "auto")
    e.end_weight_update()
    out["control"] = {"post_processes": e.model.lin.quant_method.calls, "serves_new_weights": serves_new(e.model)}
    answer = Engine("dummy").update_weights_from_disk(ckpt_dir)
    out["no_format"] = str(answer.message)
    return out


if __name__ == "__main__":
    print(json.dumps(_main(sys.argv[1])))
