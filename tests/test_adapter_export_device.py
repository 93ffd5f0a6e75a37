"""The adapter's export makes its buffer on the device the LoRA tensors are on.

A LoRA sync (`SyncConfig(lora="adapter")`) gathers the adapter into one flat buffer kept between
syncs (`weights.adapter_export`). That buffer was always made on the CPU: on a CUDA trainer of two
or more ranks the all-gather then had CPU outputs beside CUDA inputs (NCCL moves no CPU tensor),
and one rank copied its GPU shards to the host for the engine to read back. No GPU is needed to
see it: here the meta device stands in for CUDA (a device that is not the CPU, whose tensors the
CPU cannot read), one trainer rank, no process group. Before the fix the export failed with
"Cannot copy out of meta tensor"; the same model on a GPU runs in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.lora_model import add_lora
from fsdp_sync.lora_sync import peft_name
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights.adapter_export import AdapterExport


def _lora_model() -> torch.nn.Module:
    return add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=8)


@pytest.mark.timeout(60)
def test_the_buffer_is_made_where_the_adapter_is():
    model = _lora_model().to("meta")
    export = AdapterExport(peft_name)
    try:
        out = export.tensors(model, torch.float32, "default")
        assert len(out) == 28 and {t.device.type for t in out.values()} == {"meta"}
        assert export.buf is not None and export.buf.device.type == "meta"
        again = export.tensors(model, torch.float32, "default")      # the kept sources' path
        assert export.hits == 1 and {t.device.type for t in again.values()} == {"meta"}
    finally:
        export.close()
    # on the CPU, as before: the buffer there, the values the parameters' own
    cpu = _lora_model()
    export = AdapterExport(peft_name)
    try:
        out = export.tensors(cpu, torch.float32, "default")
        assert export.buf.device.type == "cpu"
        want = dict(cpu.named_parameters())
        name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
        assert torch.equal(out[name], want["base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"])
    finally:
        export.close()


@pytest.mark.timeout(60)
def test_an_adapter_on_two_devices_is_refused_naming_both():
    model = _lora_model()
    model.base_model.model.model.layers[1].to("meta")
    export = AdapterExport(peft_name)
    with pytest.raises(ValueError, match=r"several devices \(cpu: '.*layers\.0\..*', meta: '.*layers\.1\..*'\); "
                                         r"move the LoRA parameters to one device"):
        export.tensors(model, torch.float32, "default")
    assert export.buf is None and export.bucket is None and export.metas is None    # nothing planned
    export.close()
