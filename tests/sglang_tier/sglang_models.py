"""Build SGLang's own Qwen2 / Llama model classes on CPU, one TP rank at a time, and compare them
with fsdp_sync's layout map and per-rank buckets. Run in the SGLang tier venv; prints JSON.

What it does, per (model, tp, rank), in ONE process (no process groups: SGLang's runtime context
is published for the rank with ``runtime_context.publish`` and its group objects are stand-ins,
which is all that constructing the layers reads):

1. ``A = ModelClass(config)``; ``A.load_weights(full HF tensors)``: SGLang's default loading path
   (its stacked-params mapping and the layers' own ``weight_loader``s cut the rank's shard).
2. ``B = ModelClass(config)`` filled with NaN; SGLang's real ``WeightUpdater.update_weights_from_tensor``
   with ``load_format = fsdp_sync.engines.sglang.loader.LOADER`` (listed as a custom weight loader) and one
   ``LocalSerializedTensor`` per bucket whose value for this rank is a payload of
   `reshard.iter_rank_buckets`' buffer for it (SGLang's deserializer opens it).
3. Reports parameter names and shapes of SGLang's model, our layout's engine shapes, and digests of
   A's, B's and `layout.shard_state_dict`'s tensors (vocab padding rows reported apart: SGLang
   leaves them as allocated when it loads full tensors).
4. The disk method's per-rank checkpoint (`transport.disk`, ``layout="engine"``), written for the
   case: the files SGLang's ``ShardedStateLoader`` pattern globs for the rank, their tensor names
   and shapes beside the keys and shapes that loader requires (``_filter_subtensors`` of the
   model's ``state_dict()``), and what SGLang's real ``WeightUpdater.update_weights_from_disk``
   answers for ``load_format="sharded_state"`` on that directory (once per case).

Modules SGLang imports at module level that need a GPU stack or packages the tier does not install
(tvm_ffi, vllm, torchvision users, compressed_tensors, gguf, sentencepiece) are replaced by empty
stand-ins before the import; nothing of them runs while building a model or loading weights.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import os
import sys
import tempfile
import types
from importlib.machinery import ModuleSpec

STUBS = ("tvm_ffi", "vllm", "compressed_tensors", "gguf", "sentencepiece",
         "sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")


class _Meta(type):
    def __getattr__(cls, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Meta(k, (), {"model_type": "stub_" + k.lower()})

    def __iter__(cls):
        return iter(())

    def __or__(cls, o):
        return cls

    __ror__ = __or__

    def __getitem__(cls, k):
        return cls


class _StubModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        v = _Meta(k, (), {"model_type": "stub_" + k.lower()})
        setattr(self, k, v)
        return v


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBS):
            return ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Stubs())

import torch  # noqa: E402


class _Group:
    """What SGLang's layers read of a group while they are built (no collective runs)."""

    def __init__(self, size: int, rank: int):
        self.world_size, self.rank_in_group, self.rank = size, rank, rank
        self.ranks, self.cpu_group, self.device_group = list(range(size)), None, None

    is_first_rank = property(lambda s: s.rank_in_group == 0)
    is_last_rank = property(lambda s: s.rank_in_group == s.world_size - 1)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def build(cls, cfg, model_dir: str, tp: int, rank: int):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=model_dir, device="cpu", tp_size=tp, skip_tokenizer_init=True, load_format="dummy")
    rc.get_parallel().clear_stamp()     # the previous case's groups; publish stamps the ranks again
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    p = rc.get_parallel()
    assert (p.tp_size, p.tp_rank) == (tp, rank), (p.tp_size, p.tp_rank)
    # TP-wide groups hold this rank; no pipeline, context, expert or data parallelism
    groups = {f"{n}_group": _Group(tp, rank) if n in ("tp", "attn_tp", "moe_tp") else _Group(1, 0)
              for n in ("tp", "pp", "attn_tp", "attn_cp", "moe_tp", "moe_ep", "moe_dp")}
    p.override_permanently(**groups)
    return cls(cfg)


def sglang_disk_update(model, path: str, rank: int) -> list:
    """SGLang's own ``update_weights_from_disk(path, "sharded_state")`` on a built model:
    ``[success, message]``, or ``["raised", repr]`` when it cannot run on CPU."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    cfg = types.SimpleNamespace(model_path=None, dtype=torch.float32, quantization=None)
    updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=cfg, custom_weight_loaders=[],
                            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    try:
        return list(updater.update_weights_from_disk(path, "sharded_state"))
    except Exception as exc:  # noqa: BLE001 - reported, the test says what it means
        return ["raised", f"{type(exc).__name__}: {exc}"]


def main(cases: list) -> dict:
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor, WeightUpdater)
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    from fsdp_sync.weights import handles, reshard
    from fsdp_sync.weights.layout import layout_for, shard_state_dict
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.engines.sglang.loader import LOADER, bucket_name

    from sglang.srt.model_loader.loader import ShardedStateLoader

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    class _RankFilesEngine:
        """Stands in for an engine that loads per-rank checkpoints: only the writing is tested."""

        accepts_rank_checkpoints = True

        def __init__(self, tp):
            self.tp_size = tp

        def update_weights_from_disk(self, path):
            pass

    def rank_checkpoint(hf, tp):
        d = tempfile.mkdtemp(prefix="fsdp_sync_sgl_disk_")
        sc = SyncConfig(method="disk", disk_dir=d, layout="engine", dtype=torch.float32,
                        bucket_bytes=16 << 10)
        ctx = SyncContext(module=hf, config=sc, topo=None, group=None, engines=[_RankFilesEngine(tp)],
                          step=0, stats=SyncStats())
        DiskTransport(sc).sync(ctx)
        return ctx.stats.extra["path"]

    def rank_files(path, rank):
        import glob

        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, ShardedStateLoader.DEFAULT_PATTERN.format(rank=rank, part="*"))))
        keys = {}
        for f in files:
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    keys[k] = list(fh.get_slice(k).get_shape())
        return [os.path.basename(f) for f in files], keys

    torch.manual_seed(0)
    prepared = []
    # every payload is made before SGLang's first update: its monkey_patch_torch_reductions() is
    # process-global and breaks pickling CPU tensors afterwards (FACTS)
    for recipe, ov, tp in cases:
        cfg = load_config(recipe, **ov)
        hf = build_model(cfg, seed=7).eval()
        full = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        layout = layout_for(cfg, tp)
        model_dir = tempfile.mkdtemp(prefix="fsdp_sync_sgl_")
        cfg.architectures = ["Qwen2ForCausalLM" if cfg.model_type == "qwen2" else "LlamaForCausalLM"]
        cfg.save_pretrained(model_dir)
        buckets = list(reshard.iter_rank_buckets(hf, layout, 16 << 10, dtype=torch.float32))
        sets = [[handles.make_payloads(rb.buffers[i], tp, ranks=[i], tagged=False) for i in range(tp)]
                for rb in buckets]
        named = [(bucket_name(rb.bucket), LocalSerializedTensor(values=[s.payloads[0] for s in row]))
                 for rb, row in zip(buckets, sets)]
        ckpt_dir = rank_checkpoint(hf, tp)
        prepared.append((recipe, ov, tp, cfg, full, layout, model_dir, named, sets, len(buckets), ckpt_dir))
    out = {}
    for recipe, ov, tp, cfg, full, layout, model_dir, named, sets, nb, ckpt_dir in prepared:
        cls = Qwen2ForCausalLM if cfg.model_type == "qwen2" else LlamaForCausalLM
        for rank in range(tp):
            ours = shard_state_dict(full, layout, rank)
            a = build(cls, cfg, model_dir, tp, rank)
            a_shapes = {k: list(v.shape) for k, v in a.named_parameters()}
            disk_files, disk_keys = rank_files(ckpt_dir, rank)
            loader_keys = {k: list(v.shape) for k, v in ShardedStateLoader._filter_subtensors(a.state_dict()).items()}
            disk_update = None
            if rank == 0:
                disk_update = sglang_disk_update(a, ckpt_dir, rank)
            a.load_weights(list(full.items()))
            b = build(cls, cfg, model_dir, tp, rank)
            with torch.no_grad():
                for v in b.parameters():
                    v.fill_(float("nan"))
            updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                                    custom_weight_loaders=[LOADER], get_model=lambda b=b: b,
                                    update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
                                    get_model_runner=lambda: None)
            ok_calls = []
            for item in named:
                ok_calls.append(updater.update_weights_from_tensor([item], load_format=LOADER))
            rows = {}
            for k, v in a.named_parameters():
                pad = layout.padding(k, rank)
                keep = slice(0, pad[0].start) if pad is not None else slice(None)
                bv = dict(b.named_parameters())[k]
                rows[k] = {"a": digest(v[keep]), "b": digest(bv[keep]), "ours": digest(ours[k][keep]) if k in ours else None,
                           "b_pad_zero": bool(pad is None or not bv[pad[0]].any()),
                           "b_nan": bool(torch.isnan(bv).any())}
            out[f"{recipe}|{json.dumps(ov, sort_keys=True)}|{tp}|{rank}"] = {
                "sglang_shapes": a_shapes, "layout_shapes": {k: list(s) for k, s in layout.engine_shapes().items()},
                "params": rows, "calls": [list(c) for c in ok_calls], "buckets": nb,
                "disk_files": disk_files, "disk_keys": disk_keys, "sharded_state_keys": loader_keys,
                "disk_update": disk_update}
        for row in sets:
            for s in row:
                s.release(require_ack=False)
    return out


if __name__ == "__main__":
    cases = [tuple(c) for c in json.loads(sys.argv[1])]
    result = main(cases)
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
    os._exit(0)   # SGLang leaves non-daemon threads behind
