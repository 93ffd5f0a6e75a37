"""The experiment behind the pool (issue 39; `transport.disk` has done this since ae17c95): the disk method writing each new version into the files
of the version keep-N dropped (renamed into it, overwritten in place, cut to size) instead of fresh
files, against fresh files, in one job, syncs alternating ABBA after a warm-up: 2 CPU trainer ranks
(FSDP2), qwen2-160m, reference engine TP 2, 64 MiB buckets, per-rank files, tmpfs. In both arms the
dropped version is renamed to ``<dir>/.recycle`` (the one there before is deleted as keep-N deletes);
in arm "recycle" the writers take their files from it. On tmpfs a fresh file's pages are allocated
and zeroed as it is written, and a dropped version's freed; overwriting reuses them (per 64 MiB,
CPU: fresh write+hash 44.6 ms + unlink 12.7 against 21.8 overwriting). Costs what the library does
not pay today: one more version on disk between syncs, and a reader still holding a dropped
version's file open sees it change (the reference engine's stamps would refuse it).

Prints each sync's seconds, split and CPU seconds (both trainer ranks and the engine workers, from
``/proc``), then each arm's medians.

It patches the tree before the pool (38d1a57): run it with PYTHONPATH at that tree, e.g.
``git archive 38d1a57 | tar -x -C /tmp/t && PYTHONPATH=/tmp/t .venv/bin/python dev/measure_disk_recycle.py``
(PAIRS=3, DIR=/dev/shm).
"""
import os
import statistics
import sys
import tempfile


def _cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def job(rank, world, root):
    import torch
    import torch.distributed as dist
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import disk as disk_mod
    from fsdp_sync.weights import hf_checkpoint as ckpt

    torch.set_num_threads(1)
    d = os.path.join(root, "v")
    pool = os.path.join(d, ".recycle")
    use = [False]
    real_write = ckpt.write_safetensors

    def write(path, flat, entries, *, hash=ckpt.DEFAULT_HASH, rename=str, metadata=None, fsync=True):
        old = os.path.join(pool, os.path.basename(path))
        if not use[0] or not os.path.exists(old):
            return real_write(path, flat, entries, hash=hash, rename=rename, metadata=metadata, fsync=fsync)
        os.rename(old, path)
        head, names, runs = ckpt._file_layout(entries, rename, metadata, flat.numel())
        data, h = memoryview(flat.numpy()), ckpt.new_hash(hash)
        fd = os.open(path, os.O_WRONLY)
        try:
            ckpt._write_all(fd, memoryview(head))
            h.update(head)
            size = len(head)
            for a, b in runs:
                for i in range(a, b, ckpt.WRITE_CHUNK):
                    c = data[i:min(i + ckpt.WRITE_CHUNK, b)]
                    ckpt._write_all(fd, c)
                    h.update(c)
                    size += len(c)
            os.ftruncate(fd, size)
            os.fsync(fd) if fsync else ckpt.start_writeback(fd)
        finally:
            os.close(fd)
        return h.hexdigest(), size, names
    ckpt.write_safetensors = write

    def hide(self):
        versions = self._versions()
        doomed = [p for _, p in versions[:-self.keep] if p != self.loaded]
        hidden = []
        for i, path in enumerate(doomed):
            head, tail = os.path.split(path)
            hidden.append(os.path.join(head, f".{tail}.del-{os.urandom(6).hex()}"))
            if i == 0:
                if os.path.exists(pool):
                    os.rename(pool, hidden[-1])
                else:
                    hidden.pop()
                os.rename(path, pool)
            else:
                os.rename(path, hidden[-1])
        return doomed, hidden
    disk_mod.DiskTransport._hide_doomed = hide

    cfg = load_config("qwen2-160m")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) if rank == 0 else None
    conf = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=64 << 20,
                      memory_probe="off", layout="auto", share_host_memory=True)
    m = FSDPShardingManager(module, engine, config=conf)
    keys = ("export_s", "file_write_s", "write_wait_s", "load_s", "read_hash_s", "copy_s")
    out = []
    try:
        for i in range(int(os.environ.get("PAIRS", 3)) * 2 + 3):
            j = i - 3
            use[0] = j >= 0 and ((j % 2 == 0) if (j // 2) % 2 == 0 else (j % 2 == 1))   # ABBA
            m.step = i
            pids = [os.getpid()] + (list(engine.worker_pids) if engine else [])
            dist.barrier()
            c0 = sum(_cpu(p) for p in pids)
            with m:
                pass
            cpu = sum(_cpu(p) for p in pids) - c0
            if j >= 0:
                out.append({"recycle": use[0], "s": m.stats.seconds, "cpu_s": cpu,
                            **{k: m.stats.extra.get(k) for k in keys}})
    finally:
        m.close()
        if engine:
            engine.shutdown()
    return out


if __name__ == "__main__":
    from fsdp_sync.cli.launch import run_ranks, spawn_env
    root = tempfile.mkdtemp(dir=os.environ.get("DIR", "/dev/shm"))
    try:
        res = run_ranks(job, 2, root, timeout_s=900, env=spawn_env())
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    for r0, r1 in zip(res[0], res[1]):
        r0["cpu_s"] += r1["cpu_s"]     # both trainer ranks and the engine workers
    for r in res[0]:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    for arm in (False, True):
        xs = [r["s"] for r in res[0] if r["recycle"] is arm]
        cs = [r["cpu_s"] for r in res[0] if r["recycle"] is arm]
        print("recycle" if arm else "fresh  ", "median", round(statistics.median(xs), 3), "s, range",
              round(min(xs), 3), "-", round(max(xs), 3), "; CPU s per sync (trainers + workers) median",
              round(statistics.median(cs), 3), "range", round(min(cs), 3), "-", round(max(cs), 3),
              file=sys.stderr)
