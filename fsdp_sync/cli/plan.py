"""`fsdp-sync plan`: bytes, engine calls, peak extra memory and a time estimate of a sync, before
running it, for any model and cluster (`fsdp_sync.plan` does the planning); and ``--cluster
this-machine``: this machine's links measured by small timed copies, all-gathers, file writes and
round trips (two gloo ranks), then real syncs of a tiny model: tens of seconds (about a minute on a
loaded 2-core host).

Takes the bench's flags (``--models``, ``--methods``, ``--ranks``, ``--tp``, ``--bucket-mb``,
``--layout``, ``--dtype``, ...): one row per combination, under the bench's field names, so
``fsdp-sync plan --json P`` and ``fsdp-sync bench --json B`` of the same job compare key by key.
A sweep may also come from a YAML recipe (``--recipe``, keys as the flags, under ``plan:``).

Not here: the planning (`fsdp_sync.plan`), the measured runs (`bench`).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import args as ca
from .plan_recipe import DEFAULTS, cluster_spec, fraction, lora_targets, read_recipe
from .plan_table import cluster_line, plan_table, refusals, size
from ..topology import cpu_group

__all__ = ["add_plan_parser", "cluster_line", "cluster_of", "cmd_plan", "measure_this_machine", "plan_rows", "plan_recipes", "plan_table",
           "refusals", "split_refusal", "size"]

MiB = 2**20
GPU_COPY = 1 << 30          # the bytes of a GPU host's timed copies (1 GiB: launch costs vanish)


# --------------------------------------------------------------------------- this machine

def _measure_rank(rank: int, world: int, nbytes: int, repeats: int) -> dict:
    """Two gloo ranks: memcpy, all-gather, a tiny collective, file write/read, a pipe round trip."""
    import multiprocessing as mp
    import tempfile

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    def timed(body, n: int = repeats) -> float:
        times = []
        for _ in range(n + 1):
            dist.barrier(group=cpu_group())
            t0 = time.perf_counter()
            body()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    from ..weights import handles
    from ..weights.gather import all_gather

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    copy_s = timed(lambda: dst.copy_(src))
    fresh: list = []                 # the same copy into a fresh shared buffer: its first touch
    fresh_s = timed(lambda: fresh.append(handles.empty_shared(nbytes).copy_(src)))
    fresh.clear()
    part = torch.ones(nbytes // world, dtype=torch.uint8)
    out = torch.empty(part.numel() * world, dtype=torch.uint8)
    gather_s = timed(lambda: all_gather(out, part, None))     # the sync's own gather call

    def send() -> None:              # one rank to another, as the distributed method sends
        if rank == 0:
            dist.send(src, 1)
        elif rank == 1:
            dist.recv(dst, 0)

    send_s = timed(send)
    # a small object exchanged by every rank: what the tensor method does with each bucket's
    # handles (gathered to infer-TP rank 0 in its one send loop, which alone calls gather_object)
    objs: Any = [None] * world
    coll_s = timed(lambda: dist.all_gather_object(objs, {"handle": bytes(600)}, group=cpu_group()), 50)
    # rank 1 maps a buffer rank 0 shared (an engine worker opening a bucket) and copies it out,
    # against the same copy from a buffer it has mapped already
    map_s = []
    for _ in range(repeats + 1):
        buf = handles.empty_shared(nbytes).copy_(src) if rank == 0 else None
        sets = handles.make_payloads(buf, 2, ranks=[1]) if rank == 0 else None
        box = [sets.payloads[0] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=cpu_group())
        if rank == 1:
            t0 = time.perf_counter()
            rec = handles.open_payload(box[0], 1)
            dst.copy_(rec.value)
            t1 = time.perf_counter()
            dst.copy_(rec.value)
            map_s.append((t1 - t0) - (time.perf_counter() - t1))
            rec.ack()
            del rec
        dist.barrier(group=cpu_group())
        if rank == 0:
            sets.release(require_ack=False)
        del buf
    map_s = [statistics.median(map_s[1:])] if rank == 1 else [0.0]
    dist.broadcast_object_list(map_s, src=1, group=cpu_group())
    call_s = disk_w = disk_r = 0.0
    if rank == 0:
        # one engine call at least: a payload pickled to another process and its answer back
        parent, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=_echo, args=(child,), daemon=True)
        proc.start()
        payload = {"names": [f"t{i}" for i in range(64)], "handle": bytes(256)}
        parent.send(payload)
        parent.recv()
        rts = []
        for _ in range(50):
            t0 = time.perf_counter()
            parent.send(payload)
            parent.recv()
            rts.append(time.perf_counter() - t0)
        parent.send(None)
        proc.join(10)
        call_s = statistics.median(rts)
        data = memoryview(os.urandom(nbytes))
        with tempfile.TemporaryDirectory(prefix="fsdp-sync-plan-") as d:
            ws, rs = [], []
            for i in range(3):
                path = os.path.join(d, f"f{i}")
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                ws.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with open(path, "rb") as f:
                    while f.read(8 << 20):
                        pass
                rs.append(time.perf_counter() - t0)
            disk_w, disk_r = statistics.median(ws), statistics.median(rs)
    dist.barrier(group=cpu_group())
    return {"copy_s": copy_s, "gather_s": gather_s, "gather_bytes": part.numel() * (world - 1),
            "collective_s": coll_s, "call_s": call_s, "disk_write_s": disk_w, "disk_read_s": disk_r,
            "send_s": send_s, "touch_s": max(fresh_s - copy_s, 1e-9), "map_s": max(map_s[0], 1e-9)}


def _measure_sync_rank(rank: int, world: int, device: str, repeats: int) -> dict:
    """One trainer rank and a reference engine of TP 1 on ``device``: real syncs (the tensor
    method, what the bench times: ``stats.seconds``) of a deep tiny model, to price what bytes do
    not explain. Three runs per layout: the deep model in one bucket (A), the deep model in 256 KiB
    buckets (B: n of them), a one-layer model in one bucket (C); A = F + c + N t, B = F + n c + N t,
    C = F + c + N1 t give the cost per bucket c (an engine call: handles made, sent, opened,
    loaded, acknowledged), per tensor t (packing it, the engine loading it) and per sync F."""
    from ..config import SyncConfig
    from ..engines import ReferenceEngine
    from ..manager import FSDPShardingManager
    from ..models import build_model, load_config
    from ..topology import SyncTopology, make_mesh
    from .trainer import wrap_fsdp

    import torch

    torch.set_num_threads(1)
    mesh = make_mesh(1, 1, device)
    SyncTopology.from_mesh(mesh)
    out: dict = {}
    for layers in (12, 1):
        cfg = load_config("tiny", num_hidden_layers=layers)
        model = wrap_fsdp(build_model(cfg, seed=0, device="cuda" if device == "cuda" else None), 2, device=device)
        engine = ReferenceEngine(model_config=cfg, tp_size=1, device=device, dtype=torch.float32)
        try:
            for layout in ("full", "engine"):
                for bucket in ((1 << 30,) if layers == 1 else (1 << 30, 256 << 10)):
                    conf = SyncConfig(dtype=torch.float32, bucket_bytes=bucket, layout=layout, memory_probe="off")
                    manager = FSDPShardingManager(model, engine, mesh=mesh, config=conf)
                    secs = []
                    for _ in range(repeats + 1):
                        with manager:
                            pass
                        secs.append(manager.stats.seconds)
                    out[(layers, layout, bucket)] = (statistics.median(secs[1:]), manager.stats.buckets,
                                                     manager.stats.tensors)
                    manager.close()
        finally:
            engine.shutdown()
    costs: dict = {"quantize": _measure_quantize(device, repeats),
                   "device": _measure_device(GPU_COPY, repeats) if device == "cuda" else None}
    for layout in ("full", "engine"):
        a, n_a, tensors_a = out[(12, layout, 1 << 30)]
        b, n_b, _ = out[(12, layout, 256 << 10)]
        c1, _, tensors_c = out[(1, layout, 1 << 30)]
        per_bucket = max((b - a) / max(n_b - n_a, 1), 0.0)
        per_tensor = max((a - c1) / max(tensors_a - tensors_c, 1), 0.0)
        costs[layout] = {"bucket_s": per_bucket, "tensor_s": per_tensor,
                         "sync_s": max(a - per_bucket - tensors_a * per_tensor, 0.0)}
    return costs


def _measure_quantize(device: str, repeats: int) -> dict:
    """The FP8 bucket quantizer on ``device``: one bucket of one qwen2-1500m-shaped layer (large
    tensors: bytes dominate) and one of sixteen 128-wide layers (small tensors: each quantized
    tensor's own kernels dominate), timed as the sync times it (its one wait for the device per
    bucket included); solved for seconds per byte and per quantized tensor."""
    import torch

    from ..models import load_config
    from ..plan import meta_model
    from ..weights import bucket as bk
    from ..weights.export import param_metas
    from ..weights.fp8 import quantized_layout
    from ..weights.layout import layout_for
    from ..weights.quantize import StreamQuantizer

    def timed(cfg: Any) -> tuple[float, int, int]:
        _, module = meta_model(cfg)
        quant = StreamQuantizer(quantized_layout(layout_for(cfg, 1), "fp8"))
        metas = [m for m in param_metas(module, torch.bfloat16) if "layers." in m.name]
        (plan,) = bk.plan_buckets(metas, sum(m.nbytes for m in metas) + bk.ALIGNMENT * len(metas) + 1)
        flat = torch.randn(plan.nbytes // 2, dtype=torch.bfloat16, device=device).view(torch.uint8)
        out = torch.empty(quant.plan(plan).nbytes, dtype=torch.uint8, device=device)
        secs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            quant.bucket(plan, flat, lambda n: out)
            secs.append(time.perf_counter() - t0)
        return statistics.median(secs[1:]), plan.payload_bytes, sum(m.name in quant.hf for m in metas)

    big = timed(load_config("qwen2-1500m", num_hidden_layers=1, vocab_size=256))
    small = timed(load_config("tiny", num_hidden_layers=16, hidden_size=128, intermediate_size=256,
                              num_attention_heads=1, num_key_value_heads=1))
    # big = B1 s + N1 t, small = B2 s + N2 t
    (t1, b1, n1), (t2, b2, n2) = big, small
    det = b1 * n2 - b2 * n1
    per_byte = max((t1 * n2 - t2 * n1) / det, t1 / b1 / 4)     # noise must not make it free
    per_tensor = max((t2 - b2 * per_byte) / n2, 0.0)
    return {"quantize_gbps": 1 / per_byte / 1e9, "quantize_tensor_s": per_tensor,
            "quantize_measured": f"{b1 / 2**20:.0f} MiB in {n1} tensors {t1 * 1e3:.1f} ms, "
                                 f"{b2 / 2**20:.1f} MiB in {n2} tensors {t2 * 1e3:.1f} ms"}


def _measure_device(nbytes: int, repeats: int) -> dict:
    """A CUDA device as the plan sees it: one copy on it (d2d, bytes it reads and writes), and
    with two or more devices a copy from device 0 to device 1 (intra: the link between them)."""
    import torch

    def copy_s(src: Any, dst: Any) -> float:
        secs = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        return statistics.median(secs[1:])

    props = torch.cuda.get_device_properties(0)
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    out = {"name": props.name, "count": torch.cuda.device_count(), "memory": props.total_memory,
           "copy_s": copy_s(src, torch.empty_like(src))}
    if out["count"] > 1:
        out["peer_copy_s"] = copy_s(src, torch.empty(nbytes, dtype=torch.uint8, device="cuda:1"))
    return out


def _echo(conn: Any) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(True)


def measure_this_machine(nbytes: int = 64 * MiB, repeats: int = 5) -> Any:
    """This machine as a `Cluster`, its links and costs measured: a CPU host holding every rank,
    or, where CUDA is available, its GPUs (`cluster_of`)."""
    from .launch import run_ranks, spawn_env

    m = run_ranks(_measure_rank, 2, nbytes, repeats, timeout_s=180, env=spawn_env())[0]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    costs = run_ranks(_measure_sync_rank, 1, device, 3, timeout_s=300, env=spawn_env(),
                      backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")[0]
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cluster_of(m, costs, nbytes, cores, total)


def cluster_of(m: dict, costs: dict, nbytes: int, cores: int, host_memory: int) -> Any:
    """The `Cluster` of this machine's measurements: ``m`` from two gloo ranks (`_measure_rank`),
    ``costs`` from real syncs on its device (`_measure_sync_rank`: per layout, the quantizer, and
    ``device``, a CUDA device's figures or None).

    A CPU host: every rank on it, shards in host memory (``gpus_per_node`` is not a limit,
    ``memory_per_gpu`` its RAM), its cores and its first-touch and mapping rates priced. A GPU
    host: ``device`` cuda, its GPUs and their memory, ``d2d`` one copy on GPU 0, ``intra`` a copy
    from GPU 0 to GPU 1 (one GPU: the host's gloo send, as it has no link between GPUs to measure),
    ``inter`` the host's gloo send (one machine: no network between nodes to measure); first
    touch, mapping and cores are not priced (CUDA's caching allocator keeps memory mapped, a CUDA
    IPC open is part of ``bucket_s``, each rank has a device of its own)."""
    from ..plan import GB, Cluster

    layouts = {k: v for k, v in costs.items() if k in ("full", "engine")}
    # one figure each for both layouts (their mean): the rows of either stay within it
    per = {k: statistics.fmean(c[k] for c in layouts.values()) for k in ("tensor_s", "bucket_s", "sync_s")}
    q, dev = costs.get("quantize") or {}, costs.get("device")
    gather = m["gather_bytes"] / m["gather_s"] / GB
    send = nbytes / m["send_s"] / GB
    where = "cuda" if dev else "cpu"
    common = dict(disk_write_gbps=nbytes / m["disk_write_s"] / GB, disk_read_gbps=nbytes / m["disk_read_s"] / GB,
                  call_s=m["call_s"], collective_s=m["collective_s"], tensor_s=per["tensor_s"],
                  bucket_s=per["bucket_s"], sync_s=per["sync_s"], quantize_gbps=q.get("quantize_gbps", 0.0),
                  quantize_tensor_s=q.get("quantize_tensor_s", 0.0))
    syncs = (f"tensor_s, bucket_s, sync_s: real tensor-method syncs on {where} (one trainer rank, a "
             f"reference engine of TP 1, a tiny model of 12 and 1 layers in one bucket and in 256 KiB "
             f"buckets; the mean of layouts "
             + ", ".join(f"{lay}: {c['tensor_s'] * 1e6:.0f} us/tensor, {c['bucket_s'] * 1e3:.2f} ms/bucket, "
                         f"{c['sync_s'] * 1e3:.2f} ms/sync" for lay, c in layouts.items()) + ")"
             + (f"; quantize_gbps, quantize_tensor_s: the FP8 bucket quantizer on {where} "
                f"({q['quantize_measured']})" if q else ""))
    host = (f"a gloo send of {nbytes // MiB} MiB between two processes, a file write + fsync and read of "
            f"{nbytes // MiB} MiB, a pipe round trip to another process (the least an engine call "
            f"costs), a small object all-gathered (collective_s)")
    when = time.strftime('%Y-%m-%d %H:%M')
    if dev:
        peer = dev.get("peer_copy_s")
        return Cluster(
            name="this-machine", device="cuda", gpus_per_node=dev["count"], memory_per_gpu=dev["memory"],
            d2d_gbps=GPU_COPY / dev["copy_s"] / GB, intra_gbps=GPU_COPY / peer / GB if peer else send,
            inter_gbps=send, **common,
            source=(f"measured {when} on {dev['count']} x {dev['name']}: a 1 GiB copy on GPU 0 (d2d), "
                    + ("a 1 GiB copy from GPU 0 to GPU 1 (intra), " if peer else
                       "one GPU: intra is the host's gloo send (no link between GPUs to measure), ")
                    + f"inter is the host's gloo send (one machine); on the host: {host}; medians. "
                    + syncs))
    return Cluster(
        name="this-machine", device="cpu", gpus_per_node=1024, memory_per_gpu=host_memory,
        d2d_gbps=nbytes / m["copy_s"] / GB, intra_gbps=send, inter_gbps=send, cores=cores,
        touch_gbps=nbytes / m["touch_s"] / GB, map_gbps=nbytes / m["map_s"] / GB, collective_gbps=gather,
        **common,
        source=(f"measured {when} on {cores} CPUs, two gloo ranks: a {nbytes // MiB} MiB memcpy (both "
                f"ranks at once), the same into a fresh shared buffer (less the memcpy: touch), "
                f"{host}, a gloo all-gather of {nbytes // MiB} MiB (collective), another process "
                f"mapping a shared buffer (map); medians. " + syncs + ". One host: every rank on it "
                f"(gpus_per_node is not a limit), memory_per_gpu is the host's RAM"))


# --------------------------------------------------------------------------- the sweep

def plan_recipes() -> list[str]:
    """The plan sweeps shipped with the package (``memory_tuning/plan_*.yaml``)."""
    return ca.shipped_sweeps("plan")


def split_refusal(model: Any, tp: int, ep: int, quantization: str | None) -> str | None:
    """Why ``model`` cannot be held by an engine of ``tp`` TP ranks and ``ep`` expert ranks in
    ``quantization`` (``--ep 2`` on a dense model, heads that ``--tp`` does not divide, an FP8
    block cut by the split), or None when it can. A row of the sweep, not the sweep: the other
    combinations still plan."""
    from ..plan import meta_model
    from ..weights.fp8_config import held_layout
    from ..weights.layout import layout_for

    try:
        cfg = meta_model(model)[0]
        held_layout(cfg, layout_for(cfg, tp, ep), quantization)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


_SWEEP_KEYS = ("models", "methods", "layouts", "bucket_mb", "ranks", "tp", "ep", "quantization")


def plan_job(sweep: dict, model: Any, method: str, layout: str, mb: float, ranks: int, tp: int, ep: int,
             q: str | None) -> Any:
    """The `PlanJob` of one combination of ``sweep``'s lists (ValueError where PlanJob refuses it)."""
    from ..plan import PlanJob

    reps = sweep.get("replicas")
    return PlanJob(model, method, layout, int(mb * MiB), sweep["dtype"], q, ranks, sweep["fsdp"], tp, ep,
                   replicas=None if method == "tensor" or not reps else reps,
                   share_host_memory=sweep["share_host_memory"], pipelined=sweep["pipelined"],
                   gpu_memory_utilization=sweep["gpu_memory_utilization"],
                   trainer_dtype=sweep["trainer_dtype"], engine=sweep["engine"],
                   fsdp1_state_dict=sweep["fsdp1_state_dict"], free_cache_engine=sweep["free_cache_engine"],
                   weights_cpu_backup=sweep["weights_cpu_backup"],
                   trainer_resident_bytes=None if sweep["trainer_resident_gib"] is None
                   else int(sweep["trainer_resident_gib"] * 2**30))


def plan_rows(sweep: dict, cluster: Any) -> list[dict]:
    """One row per combination of ``sweep``'s lists (a refused plan: a row with ``refused`` and
    ``suggested_bucket_bytes``, None where no bucket size helps, e.g. a sync the engine refuses,
    `plan_checks.engine_refusal`; a model that this TP/EP split or quantization cannot hold: a row
    with ``refused`` saying why, `split_refusal`)."""
    from ..plan import PlanError, plan_row

    rows = []
    for model, method, layout, mb, ranks, tp, ep, q in itertools.product(*(sweep[k] for k in _SWEEP_KEYS)):
        why = split_refusal(model, tp, ep, q)
        if why is not None:
            rows.append({"plan": True, "model": model, "method": method, "layout": layout,
                         "bucket_bytes": int(mb * MiB), "ranks": ranks, "tp": tp, "ep": ep,
                         "quantization": q, "refused": f"tp {tp}, ep {ep}"
                         + (f", {q}" if q else "") + f": {why}", "suggested_bucket_bytes": None})
            continue
        job = plan_job(sweep, model, method, layout, mb, ranks, tp, ep, q)
        try:
            rows.append(plan_row(job, cluster))
            if sweep.get("lora_r") is not None:
                from ..plan_lora import adapter_fields

                rows[-1].update(adapter_fields(job, cluster, rows[-1], sweep["lora_r"], sweep["lora_targets"]))
        except PlanError as exc:
            rows.append({"plan": True, "model": model, "method": method, "layout": layout,
                         "bucket_bytes": job.bucket_bytes, "ranks": ranks, "tp": tp, "ep": ep,
                         "quantization": q, "refused": str(exc),
                         "suggested_bucket_bytes": exc.suggested_bucket_bytes})
    return rows


# --------------------------------------------------------------------------- CLI

def add_plan_parser(sub) -> None:

    p = sub.add_parser(
        "plan", help="predict a sync's bytes, engine calls, peak memory and time for any model and cluster",
        description="Plan weight syncs without running them: for each combination of the flags, the bytes "
                    "every trainer rank receives and every engine rank takes in, the engine calls, the peak "
                    "extra memory bounds (the budget rules the bench holds measured rows to: a trainer rank "
                    "2 x max(bucket, largest tensor) + largest tensor, disk and pipelined distributed "
                    "per-rank buckets 3 x, one more where SGLang at TP > 1 on a GPU makes the tensor method's "
                    "pipelined per-rank buffers take turns; + FP8's quantized buckets and the quantizer's "
                    "scratch, + an FSDP1 full or sharded state dict; an engine rank of the distributed and "
                    "disk methods max(bucket, largest tensor), + its shard on an engine that stages, --engine "
                    "reference, as on the tensor method's device with --free-cache-engine off; each row's "
                    "memory_budget_rule says which) and whether it fits the memory left on a GPU (a CPU "
                    "cluster: the host's RAM), and a "
                    "time estimate (each link's floor + per-call overheads). The model is built on the meta "
                    "device: a 235B model plans in seconds without memory. A plan that cannot fit is refused "
                    "with the largest bucket that would, and one the engine would refuse with its reason "
                    "(SGLang takes per-rank buckets from the tensor method only) (exit code 1 when every "
                    "plan is refused). Rows use the bench's field names. A LoRA adapter's syncs: --lora-r.",
        formatter_class=ca.DefaultsFormatter)
    p.add_argument("--recipe", type=_plan_recipe,
                   help="a plan sweep shipped with fsdp_sync (" + ", ".join(plan_recipes()) + ") or a YAML file "
                        "(keys as the flags' names with underscores, under 'plan:'); flags given override it")
    p.add_argument("--models", type=ca.csv_of(ca.model_spec), default="qwen2-160m",
                   help="comma-separated model recipes or config paths")
    p.add_argument("--config-json", type=ca.existing_file, metavar="PATH",
                   help="a Hugging Face config.json to plan (instead of --models)")
    p.add_argument("--methods", type=ca.csv_of(ca.choice_of(("tensor", "distributed", "disk"))), default="tensor",
                   help="comma-separated update methods: tensor, distributed, disk")
    p.add_argument("--layout", type=ca.csv_of(ca.choice_of(("full", "engine"))), default="full",
                   help="comma-separated: full (full tensors; disk: a Hugging Face checkpoint), engine "
                        "(per-rank buckets; disk: per-rank files)")
    p.add_argument("--bucket-mb", type=ca.csv_of(ca.mib), default="64",
                   help="comma-separated bucket sizes in MiB")
    p.add_argument("--ranks", type=ca.csv_of(ca.positive_int), default="2", help="comma-separated trainer world sizes")
    p.add_argument("--tp", type=ca.csv_of(ca.positive_int), default="2", help="comma-separated engine TP sizes")
    p.add_argument("--ep", type=ca.csv_of(ca.positive_int), default="1",
                   help="comma-separated engine expert-parallel sizes (MoE; each divides --tp)")
    p.add_argument("--replicas", type=ca.positive_int,
                   help="engines fed by one sync (distributed, disk; default 1; tensor: ranks / tp)")
    p.add_argument("--dtype", type=ca.dtype_name, default="float32", help=f"rollout dtype: {', '.join(ca.DTYPES)}")
    p.add_argument("--quantization", type=ca.csv_of(ca.choice_of(("none", "fp8"))), default="none",
                   help="comma-separated rollout formats: none, fp8 (block FP8)")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=2, help="the trainer's FSDP version (FSDP1: flat parameters as "
                   "fsdp-sync's trainer wraps them, one unit per decoder layer with use_orig_params; "
                   "its bytes are exact for that wrapping, exported through --fsdp1-state-dict)")
    p.add_argument("--fsdp1-state-dict", type=ca.choice_of(("full", "sharded", "local")), default="full",
                   help="with --fsdp 1, SyncConfig.fsdp1_state_dict: full (its default: torch all-gathers "
                        "the whole model on every rank first, and holds it), sharded (unshards every unit, "
                        "keeps a sharded copy, then gathers as FSDP2), local (the flat parameters' pieces only)")
    p.add_argument("--share-host-memory", type=ca.on_off, default="on",
                   help="on, off: host-shared buckets where the shards are in one host's memory (CPU)")
    p.add_argument("--pipelined", type=ca.on_off, default="on", help="on, off: per-rank buckets pipelined")
    p.add_argument("--cluster", type=cluster_spec, default="this-machine",
                   help="h100-node, h200-node (NVLink + 400 Gb/s IB, spec figures), this-machine (measured "
                        "now: timed copies, then real syncs of a tiny model, tens of seconds; --save-cluster "
                        "keeps it), or a JSON file with the fields of fsdp_sync.plan.Cluster")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.85,
                   help="the engine's static memory fraction (SGLang's --mem-fraction-static)")
    p.add_argument("--trainer-dtype", type=ca.dtype_name, default="float32",
                   help="the trainer's parameter dtype (its FSDP shard stays on the GPU during the sync)")
    p.add_argument("--trainer-resident-gib", type=ca.nonnegative_float,
                   help="GiB the trainer keeps on each GPU during the sync (default: its FSDP parameter "
                        "shard in --trainer-dtype; 0 when offloaded)")
    p.add_argument("--engine", type=ca.choice_of(("sglang", "reference")), default="sglang",
                   help="the rollout engine: sglang (loads in place) or reference (fsdp_sync's, which "
                        "stages a disaggregated update beside its weights until the commit: + its shard)")
    p.add_argument("--free-cache-engine", type=ca.on_off, default="on",
                   help="on, off: SyncConfig.free_cache_engine. on: the colocated engine's weights are "
                        "released after each rollout and resumed before the sync (zeros, nothing to keep); "
                        "off: they are still loaded when the sync begins, and --engine reference stages "
                        "the tensor method's update beside them until the commit (+ its shard on the device)")
    p.add_argument("--weights-cpu-backup", type=ca.on_off, default="off",
                   help="on, off: the reference engine's weights_cpu_backup: released weights keep their "
                        "contents, so they are valid when the sync begins, as with --free-cache-engine off")
    p.add_argument("--lora-r", type=ca.positive_int, help="plan a LoRA adapter of rank r too (SyncConfig.lora="
                   "'adapter'): each row gains the adapter's bytes, tensors and buffer, the first sync's bytes "
                   "(base + adapter) and an adapter-only sync's calls and estimate (adapter_* fields)")
    p.add_argument("--lora-targets", type=lora_targets, default=",".join(DEFAULTS["lora_targets"]),
                   help="with --lora-r: the linear layers of each decoder layer the adapter is on (peft's "
                        "target_modules, by name)")
    p.add_argument("--save-cluster", metavar="PATH", help="write the cluster used (measured or not) as JSON here")
    p.add_argument("--json", metavar="PATH", help="write {'cluster': ..., 'rows': [...]} here")
    p.add_argument("--plot", metavar="DIR", help="write a PNG per model here (needs matplotlib)")
    p.set_defaults(check=check_plan_args, run=cmd_plan)


_plan_recipe = ca.sweep_of("plan")     # ``--recipe``: a YAML path, or a shipped plan sweep's name


_FLAG_KEYS = {"models": "models", "methods": "methods", "layout": "layouts", "bucket_mb": "bucket_mb",
              "ranks": "ranks", "tp": "tp", "ep": "ep", "quantization": "quantization", "replicas": "replicas",
              "dtype": "dtype", "fsdp": "fsdp", "share_host_memory": "share_host_memory",
              "pipelined": "pipelined", "gpu_memory_utilization": "gpu_memory_utilization",
              "trainer_dtype": "trainer_dtype", "trainer_resident_gib": "trainer_resident_gib",
              "cluster": "cluster", "engine": "engine", "fsdp1_state_dict": "fsdp1_state_dict",
              "free_cache_engine": "free_cache_engine", "weights_cpu_backup": "weights_cpu_backup",
              "lora_r": "lora_r", "lora_targets": "lora_targets"}


def check_plan_args(args, given: set[str]) -> None:
    """The sweep (recipe, then the flags given), checked before anything is planned; ValueError
    names the flag, or the recipe's key and value."""
    sweep = dict(DEFAULTS)
    if args.recipe:
        sweep.update(read_recipe(args.recipe))
    for dest, key in _FLAG_KEYS.items():
        if dest in given or not args.recipe:
            v = getattr(args, dest)
            if v is not None or key in ("replicas", "trainer_resident_gib", "lora_r"):
                sweep[key] = v
    if "fsdp1_state_dict" in given and sweep["fsdp"] != 1:
        raise ValueError(f"--fsdp1-state-dict {sweep['fsdp1_state_dict']} is FSDP1's state-dict type; "
                         f"the trainer is --fsdp {sweep['fsdp']}: add --fsdp 1 or drop --fsdp1-state-dict")
    if "replicas" in given and set(sweep["methods"]) == {"tensor"}:
        raise ValueError(f"--replicas {sweep['replicas']} counts the distributed and disk methods' engines; "
                         f"the tensor method runs one per --tp group (ranks / tp): add --methods "
                         f"distributed or disk, or drop --replicas")
    if "lora_targets" in given and sweep["lora_r"] is None:
        raise ValueError("--lora-targets names the adapter's modules; add --lora-r to plan an adapter")
    if args.config_json:
        if "models" in given:
            raise ValueError("--config-json and --models name the model twice: give one")
        sweep["models"] = (args.config_json,)
    sweep["quantization"] = tuple(None if q in (None, "none") else q for q in sweep["quantization"])
    for r, t in itertools.product(sweep["ranks"], sweep["tp"]):
        if "tensor" in sweep["methods"] and r % t:
            raise ValueError(f"--ranks {r} must be a multiple of --tp {t} for the tensor method (colocated)")
    for t, e in itertools.product(sweep["tp"], sweep["ep"]):
        if t % e:
            raise ValueError(f"--ep {e} must divide --tp {t} (SGLang's rule)")
    from ..plan import load_cluster, meta_model

    source = f"--recipe {args.recipe}: " if args.recipe else ""
    if sweep["cluster"] != "this-machine":      # a JSON file's fields, checked before planning
        try:
            load_cluster(sweep["cluster"])
        except (ValueError, TypeError, OSError) as exc:
            where = "--cluster" if "cluster" in given or not args.recipe else source + "cluster:"
            raise ValueError(f"{where} {sweep['cluster']}: {exc}") from None
    for combo in itertools.product(*(sweep[k] for k in _SWEEP_KEYS)):   # what PlanJob refuses
        try:
            plan_job(sweep, *combo)
        except ValueError as exc:
            raise ValueError(f"{source}{exc}") from None

    # named as the user gave them: the flags, or (none of them given) the recipe's keys
    keys = bool(args.recipe) and not given & {"models", "config_json", "tp", "ep", "quantization"}
    flag = "--config-json" if args.config_json else (f"{source}models:" if keys else "--models")
    tp_, ep_, q_ = ("tp ", "ep ", "quantization ") if keys else ("--tp ", "--ep ", "--quantization ")
    for model in sweep["models"]:
        try:
            meta_model(model)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"{flag}: {exc}" if str(model) in str(exc) else f"{flag} {model}: {exc}") from None
        if sweep["lora_r"] is not None:
            import torch

            from ..plan_lora import adapter_metas

            try:
                adapter_metas(meta_model(model)[1], sweep["lora_r"], sweep["lora_targets"], torch.float32)
            except ValueError as exc:
                raise ValueError(f"--lora-targets {','.join(sweep['lora_targets'])} on {model}: {exc}; "
                                 f"give --lora-targets the layers the adapter is on") from None
    # a combination the model cannot split into is a refused row; a sweep of nothing else is
    # refused here, before --cluster this-machine spends tens of seconds measuring
    refused = []
    for model, t, e, q in itertools.product(sweep["models"], sweep["tp"], sweep["ep"], sweep["quantization"]):
        why = split_refusal(model, t, e, q)
        if why is None:
            break
        refused.append(f"{flag} {model} at {tp_}{t} {ep_}{e}" + (f" {q_}{q}" if q else "") + f": {why}")
    else:
        raise ValueError(refused[0] + (f" (and {len(refused) - 1} more: every combination "
                                       f"is refused)" if len(refused) > 1 else ""))
    args.sweep = sweep


def cmd_plan(args) -> int:
    from rich.console import Console

    from ..plan import load_cluster

    console = Console(width=None if sys.stdout.isatty() else 200)
    sweep = getattr(args, "sweep", None)
    if sweep is None:
        check_plan_args(args, set())
        sweep = args.sweep
    if sweep["cluster"] == "this-machine":
        console.print("measuring this machine (memcpy, gloo all-gather, file write/read, round trips) ...")
        cluster = measure_this_machine()
    else:
        cluster = load_cluster(sweep["cluster"])
    t0 = time.perf_counter()
    rows = plan_rows(sweep, cluster)
    took = time.perf_counter() - t0
    console.print(f"[bold]fsdp-sync plan[/] on {cluster_line(cluster)} ({len(rows)} plans in {took:.1f} s)")
    console.print(plan_table(rows))
    refused = [r for r in rows if r.get("refused")]
    for i, why in enumerate(refusals(rows), 1):
        console.print(f"[red]refused[/] ({i}): {why}")
    if args.save_cluster:
        Path(args.save_cluster).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_cluster).write_text(json.dumps(cluster.to_dict(), indent=1))
        console.print(f"wrote {args.save_cluster}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"cluster": cluster.to_dict(), "sweep": {k: v for k, v in sweep.items()}, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        console.print(f"wrote {args.json}")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            console.print("--plot: matplotlib is not installed; no plot written")
        else:
            from .plots import plot_plan

            for path in plot_plan(rows, args.plot):
                console.print(f"wrote {path}")
    return 1 if refused and len(refused) == len(rows) else 0
