"""`fsdp-sync bench --methods`: the disaggregated update methods' rows, each beside its own floor.

Called by `bench.bench_rank` on every trainer rank of a job, for each method other than
``tensor`` (whose rows `bench` measures with the colocated engine):

- ``distributed``: a `ReferenceEngine` of the job's TP size held by trainer rank 0, its workers in
  processes of their own (outside the trainer's world). Rows: the flattened-bucket format per
  bucket size and per ``--layouts`` value (``full``: strategy ``distributed:flattened_bucket``;
  per-rank buckets, each engine rank sent only its shard: ``distributed:per_rank_bucket``, once
  per share-host-memory x pipelined value), and the per-tensor format (``load_format=None``, the
  baseline). Every row has the layout figures (`bench.layout_figures`: ``layout``,
  ``engine_rank_bytes_in``, ``engine_rank_shard_bytes``, ``trainer_rank_bytes_in``, ...). Floor,
  measured in the same job on the same groups, timed as the row's syncs (``warmup`` runs, then the
  median of ``repeats``; ``floor_bytes``: what it moved): a bare gather of the bytes the sync
  gathers (the rollout dtype's: an FP8 row is quantized on rank 0 after the gather) to rank 0 in
  bucket-sized pieces over the trainer's group, plus bare broadcasts of the bytes the sync sends
  over the update group (per-rank rows: bare point-to-point sends of one engine rank's bytes to each
  engine rank; the engine workers receive and drop them: `ReferenceEngine._receive_raw`; a per-rank
  row that took the host-shared path gathers nothing, so its floor has one copy of each trainer
  rank's shard in place of the gather).
- ``disk``: the checkpoint transport (`transport.disk`) and its floor `transport.disk.disk_floor`
  (one process writing and reading the bytes the sync wrote, on rank 0; ``warmup`` runs not
  counted, then the median of ``repeats``), a row per bucket size, layout and share-host-memory
  value (``share_host_memory``: what the sync did; ``trainer_rank_bytes_in``: the most any trainer
  rank received, as its sync counted it); skipped with a note when this build has no disk method.

FP8 rows: ``quantized_tensors`` is the most any trainer rank quantized (`most_of_ranks`).

``peak_extra_bytes`` is the largest rise of any one process's RSS (every trainer rank and every
engine worker, sampled from trainer rank 0) above its level before the sync stage. ``split``:
where a row's time goes (`SPLIT_KEYS`, medians over the timed syncs).

Not here: the colocated rows, the sweep and the table (`bench`).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .floors import bucket_pieces, layout_figures, median_seconds
from .gpu_memory import CudaPeaks
from .sampling import DeviceSampler, rises, sampled_sync
from .targets import process_ratios
from ...topology import cpu_group

MiB = 2**20

SPLIT_KEYS = ("export_s", "file_write_s", "write_wait_s", "fsync_s", "publish_s", "read_hash_s",
              "copy_s", "load_s", "send_wait_s")
"""The parts of a sync a row's ``split`` reports (`stats.extra`, seconds, the slowest rank's):
disk: the export (gathers and the cut), the writer thread's writes and hashing (beside the export),
the export held back by an unfinished write, the fsyncs, the manifest and rename, the engine's
hashing pass and its copy into the weights (inside ``load_s``); distributed: the export and the
wait for each bucket's broadcast and the engine's stage of it."""


def _floor_distributed(transport: Any, engine: Any, gathered: int, sent: int, bucket: int, device: str,
                       repeats: int, warmup: int, rank_bytes: int | None = None, shared: bool = False,
                       moved: dict | None = None) -> float:
    """Bare gather of ``gathered`` bytes to rank 0 (bucket-sized pieces: what the sync gathers, in
    the rollout dtype, as trainer rank 0 quantizes an FP8 row's buckets after the gather) + bare
    broadcasts of ``sent`` bytes (what the sync sends: an FP8 row's FP8 bytes); per-rank rows
    (``rank_bytes``: what each engine rank gets): the same gather + bare point-to-point sends of
    ``rank_bytes`` to every engine rank in bucket-sized pieces. ``shared`` (a per-rank row that
    took the host-shared path: the trainer ranks write their shards into buffers rank 0 maps, no
    gather): one copy of each rank's shard (``gathered / world``) instead of the gather. Timed as
    the row's syncs (``warmup`` runs, then the median of ``repeats``); ``moved``: the bytes moved."""
    import concurrent.futures as cf

    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    p2p = rank_bytes is not None
    parts = [-(-p // world) for p in bucket_pieces(gathered, bucket)]   # each rank's part of a piece
    out = bucket_pieces(rank_bytes if p2p else sent, bucket)            # to each engine rank / everyone
    runs = [(size, out.count(size)) for size in dict.fromkeys(out)]     # the receivers' calls
    dev = "cuda" if device == "cuda" else "cpu"
    send = torch.ones(max(parts, default=0), dtype=torch.uint8, device=dev)
    rows = [torch.empty_like(send) for _ in range(world)] if rank == 0 else None
    flat = torch.ones(max(out, default=0), dtype=torch.uint8, device=dev)
    pool = cf.ThreadPoolExecutor(1) if rank == 0 else None
    own = (torch.ones(max(1, gathered // world), dtype=torch.uint8, device=dev), ) if shared else ()
    into = torch.zeros_like(own[0]) if shared else None
    if moved is not None:
        moved.update({"own_copy": own[0].numel()} if shared else {"gathered": sum(parts) * world})
        moved.update({"sent_to_each_engine_rank" if p2p else "broadcast": sum(out)})
    group_name = transport.config.dist_group_name

    def receive() -> None:      # the engine workers: every piece, received and dropped
        for size, count in runs:
            engine._receive_raw(group_name, size, count, p2p)

    def body() -> None:
        if shared:
            into.copy_(own[0])
            dist.barrier(group=cpu_group())
        for k in ([] if shared else parts):
            dist.gather(send[:k], [r[:k] for r in rows] if rank == 0 else None, dst=0)
        if rank == 0:
            fut = pool.submit(receive)
            for k in out:
                if p2p:
                    works = [dist.isend(flat[:k], group=transport.pg, group_dst=o + r)
                             for o in transport.offsets for r in range(engine.tp_size)]
                    for w in works:
                        w.wait()
                else:
                    dist.broadcast(flat[:k], src=0, group=transport.pg)
            fut.result()
        dist.barrier(group=cpu_group())     # ends when every rank is done

    try:
        return median_seconds(body, dev, repeats, warmup)
    finally:
        if pool is not None:
            pool.shutdown()


def method_rows(rank: int, world: int, job: Any, model: torch.nn.Module, cfg: Any, params: int,
                tensors: int, method: str, pids: list, largest: int) -> list[dict]:
    """This job's rows of ``method`` (returned on rank 0; [] elsewhere)."""
    import torch.distributed as dist

    from ...config import SyncConfig
    from ...engines import ReferenceEngine
    from ...manager import FSDPShardingManager
    from ...weights.export import param_metas
    from ...weights.fp8_config import held_layout
    from ...weights.layout import layout_for

    dtype = getattr(torch, job.dtype)
    if method == "disk":
        try:
            from ...transport.disk import disk_floor  # noqa: F401
        except ImportError:
            return [{"method": "disk", "skipped": "this build has no disk method"}] if rank == 0 else []
    # on CUDA a distributed engine's workers go after the trainer ranks' GPUs, as the demo's (NCCL
    # refuses one GPU on both ends of the update group: `transport.distributed.check_distinct_gpus`)
    base_gpu = world if job.device == "cuda" and method == "distributed" else 0
    engine = ReferenceEngine(model_config=cfg, tp_size=job.tp, device=job.device, dtype=dtype,
                             base_gpu_id=base_gpu, **job.engine_kw) if rank == 0 else None
    # one engine rank's shard, beside what a disk row's engine rank read (the full layout's rows
    # carry no layout figures of their own: the workers slice their parts out of the HF files)
    shard = held_layout(cfg, layout_for(cfg, job.tp, job.ep), job.quantization).engine_bytes(dtype.itemsize)
    rows: list[dict] = []
    try:
        # distributed: the flattened format per bucket size and layout (job.layouts; per-rank rows
        # once per share_host_memory x pipelined), then the per-tensor baseline (full tensors);
        # disk: one row per bucket size, layout (full: HF files; engine: per-rank files) and
        # share_host_memory value (both layouts fill a host-shared buffer or else gather)
        full = ("full", job.share_host_memory[0], job.pipelined[0])
        variants = ([("flattened_bucket", b, v) for b in job.bucket_mb for lay in dict.fromkeys(job.layouts)
                     for v in ([full] if lay == "full" else
                               [(lay, sh, pp) for sh in job.share_host_memory for pp in job.pipelined])]
                    + [("per_tensor", job.bucket_mb[0], full)]
                    if method == "distributed" else
                    [("checkpoint", b, (lay, sh, full[2])) for b in job.bucket_mb
                     for lay in dict.fromkeys(job.layouts) for sh in dict.fromkeys(job.share_host_memory)])
        baseline = None
        for fmt, bucket_mb, (layout, share, piped) in variants:
            bucket_bytes = int(bucket_mb * MiB)
            extra = {"dist_format": fmt, "layout": layout, "share_host_memory": share,
                     "pipelined": piped} if method == "distributed" else {}
            workdir = None
            if method == "disk":
                # a fresh directory per row: versions are never overwritten, and the manager
                # numbers its syncs from 0. Only rank 0's name is used (the ranks share a host).
                import tempfile
                box = [tempfile.mkdtemp(prefix="fsdp-sync-bench-disk-") if rank == 0 else None]
                dist.broadcast_object_list(box, src=0, group=cpu_group())
                workdir = box[0]
                extra = {"disk_dir": workdir, "layout": layout, "share_host_memory": share}
            conf = SyncConfig(method=method, bucket_bytes=bucket_bytes, dtype=dtype, memory_probe="off",
                              dist_master_address="127.0.0.1", quantization=job.quantization,
                              multi_stage_wake_up=job.multi_stage, **extra)
            manager = FSDPShardingManager(model, engine, config=conf)
            try:
                # disk: the steady state a run reaches once keep-N has dropped a version, whose
                # files each later sync overwrites in place (transport.disk's pool): disk_keep
                # more warm-up syncs (their seconds in the row's warmup_seconds)
                warm = []
                for _ in range(job.warmup + (conf.disk_keep if method == "disk" else 0)):
                    with manager:
                        pass
                    warm.append(manager.stats.seconds)
                secs, splits = [], []
                for _ in range(job.repeats):
                    dist.barrier(group=cpu_group())
                    with manager:
                        pass
                    secs.append(manager.stats.seconds)
                    splits.append({k: v for k, v in manager.stats.extra.items()
                                   if k in SPLIT_KEYS and v is not None})
                stats = manager.stats
                sampler = None
                if rank == 0:
                    workers = list(getattr(engine, "worker_pids", []) or [])
                    sampler = DeviceSampler([(p, None) for p in list(pids) + workers])
                peaks = CudaPeaks(engine) if job.device == "cuda" else None
                if peaks:       # the sync stage alone, as a tensor row's (`gpu_memory`)
                    manager.watch["sync_weights"] = peaks
                sampled_sync(manager, sampler)
                manager.watch.pop("sync_weights", None)
                # FP8: the busiest trainer rank's quantizer count (a disk writer quantizes its own
                # buckets), as the plan counts it; collective, as trainer_rank_bytes_in's
                quantized = most_of_ranks(stats.extra.get("quantized_tensors", 0)) if job.quantization else None
                lay = None
                if method == "distributed":
                    # the full path gathers to rank 0 (no host-shared memory): share only per-rank
                    lay = layout_figures(model, cfg, job, stats,
                                          share and stats.extra.get("layout") == "engine")   # collective
                    # gathered: the rollout-dtype bytes (an FP8 row is quantized on rank 0 after
                    # the gather); sent: what the sync sent (stats.bytes: an FP8 row's FP8 bytes)
                    per_rank = lay["layout"] == "engine"
                    floor_bytes = {}
                    floor = _floor_distributed(manager.transport, engine, lay["model_bytes"], stats.bytes,
                                               bucket_bytes, job.device, job.repeats, job.warmup,
                                               lay["engine_rank_bytes_in"] if per_rank else None,
                                               shared=lay["share_host_memory"], moved=floor_bytes)
                else:
                    # the sync's timing: job.warmup runs not counted (not the disk_keep more the
                    # sync warms up: the floor keeps no versions), then the median of job.repeats
                    from ...transport.disk import disk_floor
                    floor_bytes = {"written_and_read": stats.bytes}
                    floor = statistics.median(
                        [disk_floor(stats.bytes, workdir, files=max(stats.buckets, 1))
                         for _ in range(job.warmup + job.repeats)][job.warmup:]) if rank == 0 else None
                med = statistics.median(secs)
                if fmt == "per_tensor":
                    baseline = med
                if rank == 0:
                    rows.append(_row(job, method, fmt, bucket_bytes, params, tensors, stats, secs, med,
                                     floor, manager, sampler, largest, warm))
                    rows[-1].setdefault("engine_rank_shard_bytes", shard)
                    rows[-1]["floor_bytes"] = floor_bytes
                    if quantized is not None:
                        rows[-1]["quantized_tensors"] = quantized
                    # where the time goes: each part's median over the timed syncs
                    rows[-1]["split"] = {k: statistics.median(s[k] for s in splits if k in s)
                                         for k in SPLIT_KEYS if any(k in s for s in splits)}
                    if lay is not None:
                        rows[-1].update(lay)
                        if lay["layout"] == "engine":
                            rows[-1]["strategy"] = "distributed:per_rank_bucket"
                    elif method == "disk":
                        # what the sync did: one host-shared buffer, or (full) every rank
                        # all-gathering each bucket; the most any rank received, as it counted
                        rows[-1]["share_host_memory"] = bool(stats.extra.get("host_shared"))
                        rows[-1]["trainer_rank_bytes_in"] = int(stats.extra["trainer_rank_bytes_in"])
                    names = [f"trainer rank {r}" for r in range(len(pids))] + \
                        [f"engine worker {j}" for j in range(len(getattr(engine, "worker_pids", []) or []))]
                    rows[-1]["peak_extra_by_process"] = dict(zip(names, rows[-1].pop("_peaks")))
                    # the engine workers' own rule: the reference engine stages a disaggregated
                    # update beside the weights it holds (loaded by the warm-up) until the commit,
                    # except per-rank disk files (checked first, then read into the weights)
                    from ...plan import reference_engine_stages
                    staged = reference_engine_stages("reference", method, rows[-1].get("layout") or "full")
                    rows[-1].update(engine_memory_budget(method, bucket_bytes, largest,
                                                         rows[-1]["engine_rank_shard_bytes"], staged=staged))
                    if peaks:
                        r = rows[-1]
                        rows[-1]["gpu_memory"] = peaks.result(
                            memory_budget(method, bucket_bytes, largest, r.get("layout") or "full",
                                          bool(r.get("pipelined", True)), job=job, cfg=cfg,
                                          model=model)["memory_budget_bytes"],
                            manager.timeline, rows[-1]["engine_memory_budget_bytes"])
            finally:
                manager.close()
                if workdir is not None:
                    dist.barrier(group=cpu_group())
                    if rank == 0:
                        import shutil
                        shutil.rmtree(workdir, ignore_errors=True)
        for r in rows:
            r["baseline_seconds"] = baseline
            r["speedup_vs_baseline"] = (baseline / r["seconds"]) if baseline else None
    finally:
        if engine is not None:
            engine.shutdown()
    return rows


def most_of_ranks(value: int) -> int:
    """The largest ``value`` of any trainer rank (collective: every rank of the job calls it)."""
    import torch.distributed as dist

    from ...topology import released_by_backend

    t = torch.tensor([int(value)], dtype=torch.int64)
    with released_by_backend(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return int(t.item())


def memory_budget(method: str, bucket_bytes: int, largest: int, layout: str = "full",
                  pipelined: bool = True, *, job: Any = None, cfg: Any = None,
                  model: torch.nn.Module | None = None) -> dict:
    """A row's memory budget and its rule: `fsdp_sync.plan.memory_budget` (the one formula the
    bench and ``fsdp-sync plan`` share). An FP8 ``job`` (``cfg``, ``model``: what it syncs): the
    quantized buckets its transport holds, each the largest quantized bucket of its plan, both
    as the plan counts them (`plan.quantized_buffers`, `plan_bytes.sync_quantized_bucket`), and
    the quantizer's scratch (`plan_bytes.sync_quantize_scratch`)."""
    from ...plan import memory_budget as rule
    from ...plan_bytes import sync_quantize_scratch, sync_quantized_bucket

    quantization = getattr(job, "quantization", None)
    if not quantization:
        return rule(method, bucket_bytes, largest, layout=layout, pipelined=pipelined)
    dtype = getattr(torch, job.dtype)
    q = sync_quantized_bucket(cfg, model, method, layout, bucket_bytes, dtype, job.tp, job.ep)
    return rule(method, bucket_bytes, largest, quantization, dtype, layout=layout, pipelined=pipelined,
                quantized_bytes=q, quantize_scratch=sync_quantize_scratch(cfg, layout, dtype, job.tp, job.ep))


def engine_memory_budget(method: str, bucket_bytes: int, largest: int, shard: int, staged: bool) -> dict:
    """An engine worker's budget and its rule (`fsdp_sync.plan.engine_memory_budget`)."""
    from ...plan import engine_memory_budget as rule

    return rule(method, bucket_bytes, largest, shard, staged)


def flag_over_budget(rows: list[dict]) -> list[dict]:
    """Mark every measured row whose peak extra memory is over its budget (``over_budget``): a
    device's peak against the trainer's rule; where the row has each process's peak (the
    disaggregated methods), each trainer rank against the trainer's rule and each engine worker
    against the engine's (``engine_memory_budget_bytes``); a CUDA row by its GPU's allocator rise
    (``gpu_memory``, `gpu_memory.CudaPeaks`), not the host's RSS."""
    for r in rows:
        if "within_budget" in (r.get("gpu_memory") or {}):
            r["over_budget"] = not r["gpu_memory"]["within_budget"]
            continue
        if "peak_extra_bytes" not in r or "memory_budget_bytes" not in r:
            continue
        r["over_budget"] = max(process_ratios(r).values()) > 1    # the rule the targets judge by
    return rows


def over_budget_line(r: dict) -> str:
    """What a row over its budget took, against the rule (a CUDA row: its GPU's allocator rise). A
    CPU row with each process's peak names the process furthest over its own budget
    (`targets.process_ratios`: a trainer rank against the trainer's rule, an engine worker against
    the engine's), with that process's peak and budget; the row's ``peak_extra_bytes`` is the
    largest peak of any process, which another process's budget does not bound."""
    gpu = r.get("gpu_memory") or {}
    if "engine_budget_mib" in gpu or "within_budget" in gpu:
        if "engine_budget_mib" in gpu:      # disaggregated: each process against its own rule
            took = (f"GPU: trainer {gpu['trainer_peak_allocated_mib']:.1f} MiB, engine workers "
                    f"{', '.join(f'{w:.1f}' for w in gpu.get('engine_workers_peak_allocated_mib', []))} MiB")
        else:
            took = (f"GPU {gpu['device_peak_allocated_mib']:.1f} MiB (trainer "
                    f"{gpu['trainer_peak_allocated_mib']:.1f} + its GPU's engine worker)")
        return (f"{r['strategy']}: {took} > {r['memory_budget_bytes'] / MiB:.1f} MiB = {r['memory_budget_rule']}"
                + (f" (an engine worker: {r['engine_memory_budget_bytes'] / MiB:.1f} MiB "
                   f"= {r['engine_memory_budget_rule']})" if "engine_memory_budget_bytes" in r
                   and "engine_budget_mib" in gpu else ""))
    ratios = process_ratios(r)
    worst = max(ratios, key=ratios.get)
    if worst == "device":
        return (f"{r['strategy']}: {r['peak_extra_bytes'] / MiB:.1f} MiB > "
                f"{r['memory_budget_bytes'] / MiB:.1f} MiB = {r['memory_budget_rule']}")
    engine = worst.startswith("engine")
    budget = r["engine_memory_budget_bytes" if engine else "memory_budget_bytes"]
    rule = r["engine_memory_budget_rule" if engine else "memory_budget_rule"]
    peak, cap = _two_mib(r["peak_extra_by_process"][worst], budget)
    return f"{r['strategy']}: {worst} {peak} > its budget {cap} = {rule}"


def _two_mib(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` bytes in MiB with the fewest decimals (1 to 3) that tell them apart (a peak
    2.23 MiB over a budget of 2.19 MiB printed as '2.2 > 2.2' read as false), else in bytes."""
    for d in (1, 2, 3):
        x, y = f"{a / MiB:.{d}f}", f"{b / MiB:.{d}f}"
        if x != y:
            return f"{x} MiB", f"{y} MiB"
    return f"{a} bytes", f"{b} bytes"


def _row(job, method, fmt, bucket_bytes, params, tensors, stats, secs, med, floor, manager, sampler,
         largest, warm=()) -> dict:
    timeline = manager.timeline.to_dict()
    peak, peaks = 0, []
    if sampler is not None and sampler.samples:
        peaks = rises(timeline, sampler)
        peak = max(peaks)
    return {
        "method": method, "strategy": f"{method}:{fmt}", "model": job.model, "params": params,
        "tensors": tensors, "bytes": stats.bytes, "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": largest, "ranks": job.ranks, "tp": job.tp,
        "multi_stage": job.multi_stage, "device": job.device, "dtype": job.dtype, "seconds": med,
        "repeats": secs, "warmup_seconds": list(warm), "floor_seconds": floor, "baseline_seconds": None,
        "peak_extra_bytes": int(peak),
        **memory_budget(method, bucket_bytes, largest, stats.extra.get("layout") or "full",
                        bool(stats.extra.get("pipelined", True))),
        **{k: stats.extra[k] for k in ("quantize_s", "quantized_tensors") if k in stats.extra},
        "engine_calls": stats.engine_calls, "buckets": stats.buckets, "stages": timeline,
        # what the sync ran with (the distributed rows say below which path it took)
        "memory_curve": [], "share_host_memory": bool(getattr(manager.config, "share_host_memory", False)),
        "floor_shared_seconds": None,
        "_peaks": [int(p) for p in peaks],
        **{k: stats.extra[k] for k in ("layout", "engine_rank_bytes_in", "engine_rank_shard_bytes",
                                       "trainer_rank_bytes_in", "reshard_path", "files_told_ahead",
                                       "files_hashed_ahead") if k in stats.extra},
    }
