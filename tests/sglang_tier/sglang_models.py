"""Build SGLang's own model classes (Qwen2, Llama, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral) on CPU, one
TP rank at a time, and compare them with fsdp_sync's layout map, per-rank buckets and SGLang
checksums. Run in the SGLang tier venv; prints JSON. A case is ``[recipe, overrides, tp, ep,
options]`` (``ep``: SGLang's ``--ep-size``; options ``checksum``, ``stale``, ``shapes_only``).
``python sglang_models.py PART...``: each PART (a JSON list of cases) in a process of its own,
all at once, forked once SGLang's modules are imported; prints ``RESULT`` and a list, one per part.

What it does, per (model, tp, ep, rank), in ONE process per part (no process groups: SGLang's runtime context
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
   answers for ``load_format="sharded_state"`` on that directory (once per case; EP 1 only).
5. With ``checksum``: SGLang's ``WeightChecker`` checksum action on A and B per rank, the hashes
   `engines.sglang.checksums` computes from the full tensors, and `checksums.Checker`'s verdict
   (and, with ``stale``, its verdict for a trainer whose tensor ``stale`` moved on).

Modules SGLang imports at module level that need a GPU stack or packages the tier does not install
(tvm_ffi, vllm, torchvision users, compressed_tensors, gguf, sentencepiece; einops, which
the MoE models' expert-distribution recorder imports and only its statistics call) are replaced by empty
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

STUBS = ("tvm_ffi", "vllm", "compressed_tensors", "gguf", "sentencepiece", "einops",
         "sglang.srt.parser.reasoning_parser", "sglang.srt.sampling.custom_logit_processor",
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


# model_type -> (SGLang module, class): the classes SGLang's registry picks for these architectures
CLASSES = {"qwen2": ("qwen2", "Qwen2ForCausalLM"), "llama": ("llama", "LlamaForCausalLM"),
           "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
           "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"), "mixtral": ("mixtral", "MixtralForCausalLM")}


def model_class(model_type: str):
    import importlib

    mod, name = CLASSES[model_type]
    return getattr(importlib.import_module(f"sglang.srt.models.{mod}"), name)


def build(cls, cfg, model_dir: str, tp: int, rank: int, ep: int = 1):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=model_dir, device="cpu", tp_size=tp, ep_size=ep, skip_tokenizer_init=True,
                    load_format="dummy")
    rc.get_parallel().clear_stamp()     # the previous case's groups; publish stamps the ranks again
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    p = rc.get_parallel()
    moe_tp = tp // ep
    # SGLang's own rank arithmetic (runtime_context.derive_spawn_ranks), not ours
    assert (p.tp_size, p.tp_rank, p.moe_ep_size, p.moe_tp_size) == (tp, rank, ep, moe_tp), \
        (p.tp_size, p.tp_rank, p.moe_ep_size, p.moe_tp_size)
    ranks = {"tp": (tp, rank), "attn_tp": (tp, rank), "moe_tp": (moe_tp, p.moe_tp_rank),
             "moe_ep": (ep, p.moe_ep_rank)}
    # TP-wide groups hold this rank; no pipeline, context or data parallelism
    groups = {f"{n}_group": _Group(*ranks.get(n, (1, 0)))
              for n in ("tp", "pp", "attn_tp", "attn_cp", "moe_tp", "moe_ep", "moe_dp")}
    p.override_permanently(**groups)
    model = cls(cfg)
    model.sglang_moe_ranks = (p.moe_ep_rank, p.moe_tp_rank)
    return model


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


def sglang_checksums(model) -> dict:
    """SGLang's own ``WeightChecker`` (what ``/weights_checker {"action": "checksum"}`` runs on each
    TP worker) on a built model: ``{checksums, per_gpu_checksum, parallelism_info}``."""
    from sglang.srt.utils.weight_checker import WeightChecker

    return WeightChecker(get_model=lambda: model).handle("checksum", role="target")


def checksum_report(layout, full: dict, reports: list, stale: str | None) -> dict:
    """Our side of the checksum check: the hashes fsdp_sync computes from the trainer's full
    tensors, and `checksums.Checker`'s verdict against SGLang's reports, first for the tensors
    SGLang loaded, then for a trainer whose tensor ``stale`` changed after the engine loaded."""
    from fsdp_sync.engines.sglang import checksums

    answer = {"ranks": reports}
    ours = {}
    for name, per_rank in checksums.expected_checksums(layout, list(full.items())):
        for r, h in enumerate(per_rank):
            ours.setdefault(r, {})[name] = h

    def verdict(tensors):
        c = checksums.Checker(layout, answer, algorithm="cpu")
        problems = [p for name, t in tensors.items() for p in c.feed(name, t)]
        return problems + c.finish(), c.checked

    same, checked = verdict(full)
    out = {"ours": ours, "same": same, "checked": checked}
    if stale:
        newer = dict(full)
        newer[stale] = full[stale] + 1.0     # the trainer moved on, the engine did not
        out["stale"], _ = verdict(newer)
    return out


def main(cases: list) -> dict:
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        LocalSerializedTensor, WeightUpdater)

    from fsdp_sync.weights import handles, reshard
    from fsdp_sync.weights.export import iter_params
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
    for case in cases:
        recipe, ov, tp = case[:3]
        ep = case[3] if len(case) > 3 else 1
        opts = case[4] if len(case) > 4 else {}
        cfg = load_config(recipe, **ov)
        hf = build_model(cfg, seed=7).eval()
        # Hub names (per-expert tensors even where transformers 5 fuses them), full tensors
        full = {k: v.detach().clone() for k, v in iter_params(hf)}
        layout = layout_for(cfg, tp, ep)
        model_dir = tempfile.mkdtemp(prefix="fsdp_sync_sgl_")
        cfg.architectures = [CLASSES[cfg.model_type][1]]
        cfg.save_pretrained(model_dir)
        if opts.get("shapes_only"):
            prepared.append((recipe, ov, tp, ep, opts, cfg, full, layout, model_dir, [], [], 0, None))
            continue
        buckets = list(reshard.iter_rank_buckets(hf, layout, 16 << 10, dtype=torch.float32))
        sets = [[handles.make_payloads(rb.buffers[i], tp, ranks=[i], tagged=False) for i in range(tp)]
                for rb in buckets]
        named = [(bucket_name(rb.bucket), LocalSerializedTensor(values=[s.payloads[0] for s in row]))
                 for rb, row in zip(buckets, sets)]
        # the disk method cuts by TP only (no expert parallelism there)
        ckpt_dir = rank_checkpoint(hf, tp) if ep == 1 else None
        prepared.append((recipe, ov, tp, ep, opts, cfg, full, layout, model_dir, named, sets, len(buckets), ckpt_dir))
    out = {}
    for recipe, ov, tp, ep, opts, cfg, full, layout, model_dir, named, sets, nb, ckpt_dir in prepared:
        cls = model_class(cfg.model_type)
        reports_a, reports_b = [], []
        for rank in range(tp):
            ours = shard_state_dict(full, layout, rank)
            a = build(cls, cfg, model_dir, tp, rank, ep)
            a_shapes = {k: list(v.shape) for k, v in a.named_parameters()}
            moe_layers = {type(m).__module__ + "." + type(m).__name__ for m in a.modules()
                          if hasattr(m, "w13_weight")}
            key = f"{recipe}|{json.dumps(ov, sort_keys=True)}|{tp}|{rank}|ep{ep}"
            if opts.get("shapes_only"):      # a model SGLang builds differently: names and shapes only
                out[key] = {"sglang_shapes": a_shapes, "moe_classes": sorted(moe_layers),
                            "layout_shapes": {k: list(s) for k, s in layout.engine_shapes().items()}}
                continue
            disk_files = disk_keys = loader_keys = disk_update = None
            if ckpt_dir is not None:
                disk_files, disk_keys = rank_files(ckpt_dir, rank)
                loader_keys = {k: list(v.shape) for k, v in ShardedStateLoader._filter_subtensors(a.state_dict()).items()}
                if rank == 0:
                    disk_update = sglang_disk_update(a, ckpt_dir, rank)
            with torch.no_grad():
                for v in a.parameters():      # what SGLang's loader leaves unwritten shows as NaN
                    v.fill_(float("nan"))
            a.load_weights(list(full.items()))
            b = build(cls, cfg, model_dir, tp, rank, ep)
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
            b_params = dict(b.named_parameters())
            for k, v in a.named_parameters():
                pad = layout.padding(k, rank)
                keep = slice(0, pad[0].start) if pad is not None else slice(None)
                bv = b_params[k]
                rows[k] = {"a": digest(v[keep]), "b": digest(bv[keep]), "ours": digest(ours[k][keep]) if k in ours else None,
                           "a_pad_zero": bool(pad is None or not v[pad[0]].any()),
                           "b_pad_zero": bool(pad is None or not bv[pad[0]].any()),
                           "a_nan": bool(torch.isnan(v).any()), "b_nan": bool(torch.isnan(bv).any())}
            if opts.get("checksum"):
                reports_a.append(sglang_checksums(a))
                reports_b.append(sglang_checksums(b))
            out[key] = {
                "sglang_shapes": a_shapes, "layout_shapes": {k: list(s) for k, s in layout.engine_shapes().items()},
                "params": rows, "calls": [list(c) for c in ok_calls], "buckets": nb,
                "disk_files": disk_files, "disk_keys": disk_keys, "sharded_state_keys": loader_keys,
                "disk_update": disk_update, "moe_classes": sorted(moe_layers),
                "moe_ranks": list(a.sglang_moe_ranks)}
        if opts.get("checksum"):
            key = f"{recipe}|{json.dumps(ov, sort_keys=True)}|{tp}|ep{ep}"
            rep = checksum_report(layout, full, reports_a, opts.get("stale"))
            out["checksum|" + key] = {"sglang": reports_a, "sglang_our_loader": reports_b, **rep,
                                      "stale_name": opts.get("stale")}
        for row in sets:
            for s in row:
                s.release(require_ack=False)
    return out


def scratch_tempdir() -> tempfile.TemporaryDirectory:
    """Every mkdtemp of this process (model configs, checkpoints) inside one directory, removed
    before ``os._exit`` (which runs no cleanup)."""
    scratch = tempfile.TemporaryDirectory(prefix="fsdp_sync_sgl_")
    tempfile.tempdir = scratch.name
    return scratch


def preload() -> None:
    """What `main` and `build` import, imported before the parts fork (a fork then starts there)."""
    from sglang.srt import runtime_context  # noqa: F401
    from sglang.srt.model_executor.model_runner_components import weight_updater  # noqa: F401
    from sglang.srt.model_loader import loader  # noqa: F401
    from sglang.srt.server_args import ServerArgs  # noqa: F401
    from sglang.srt.utils import weight_checker  # noqa: F401

    import fsdp_sync.engines.sglang.checksums  # noqa: F401
    import fsdp_sync.engines.sglang.loader  # noqa: F401
    import fsdp_sync.models  # noqa: F401
    import fsdp_sync.transport.disk  # noqa: F401
    import fsdp_sync.weights.reshard  # noqa: F401
    for model_type in CLASSES:
        model_class(model_type)


def run_part(cases: list, w: int) -> None:
    """In a forked child: `main` on ``cases``, its JSON written to ``w``; never returns."""
    code, scratch = 1, scratch_tempdir()
    try:
        data = json.dumps(main(cases)).encode()
        with os.fdopen(w, "wb") as f:
            f.write(data)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reports the exit code, the traceback is above
        import traceback

        traceback.print_exc()
    finally:
        scratch.cleanup()
        sys.stderr.flush()
        os._exit(code)   # SGLang leaves non-daemon threads behind


if __name__ == "__main__":
    # one argument per part (a JSON list of cases): each part runs in a process of its own, all at
    # once, forked from this one once SGLang's modules are imported (its imports: ~9 s of CPU)
    parts = [[tuple(c) for c in json.loads(a)] for a in sys.argv[1:]]
    preload()
    children = []
    for cases in parts:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            run_part(cases, w)
        os.close(w)
        children.append((pid, r))
    results, failed = [], []
    for i, (pid, r) in enumerate(children):
        with os.fdopen(r, "rb") as f:
            data = f.read()
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            failed.append(f"part {i} exited {code}")
        else:
            results.append(json.loads(data))
    if failed:
        sys.exit(f"sglang_models.py: {', '.join(failed)} (their errors above)")
    print("RESULT " + json.dumps(results))
    sys.stdout.flush()
    os._exit(0)
