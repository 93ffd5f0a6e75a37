"""The sync on a default process group with no CPU backend, as users' NCCL-only groups are.

``init_process_group("nccl")`` (torchrun, accelerate) makes a group that runs CUDA tensors only:
on the first GPU run the demo failed at its first sync with ``No backend type associated with device
type cpu`` (`shared/FACTS-gpu.md`), because the sync ran its object and agreement collectives on it.
On a CPU machine ``init_process_group("cuda:gloo")`` makes the same kind of group: gloo mapped to
``cuda`` only, so a CPU tensor's collective on it fails with the very message NCCL-only gives, and
the device mesh's subgroups inherit it. That is what these tests emulate. The sync must run its
objects and flags on a gloo group of its own (`topology.cpu_group`) and its data where the data is.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from fsdp_sync.cli.launch import RankError, run_ranks, spawn_env

from _util import run_output

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates NCCL-only on a CPU machine")


def _raw_cpu_all_reduce(rank, world):
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))


@pytest.mark.timeout(90)
def test_the_emulated_group_fails_as_nccl_only_does():
    """Without the twin, a CPU collective on the group raises what the GPU run raised."""
    with pytest.raises(RankError, match="No backend type associated with device type cpu"):
        run_ranks(_raw_cpu_all_reduce, 2, backend="cuda:gloo", timeout_s=60, pg_timeout_s=30,
                  env=spawn_env())


def _collectives(rank, world):
    import torch.distributed as dist

    from fsdp_sync.topology import (SyncError, SyncTopology, agree, broadcast_from_src, cpu_group,
                                    gather_to_src, has_cpu_backend, make_mesh)

    topo = SyncTopology.from_mesh(make_mesh(1, world, "cpu"))
    out = {"world_has_cpu": has_cpu_backend(), "tp_has_cpu": has_cpu_backend(topo.tp_group)}
    agree(None)                                              # default group
    agree(None, topo.tp_group)
    out["gathered"] = gather_to_src({"rank": rank}, topo)
    out["broadcast"] = broadcast_from_src(f"from {rank}", topo)
    try:
        agree("boom" if rank == 1 else None, what="the test's stage")
    except SyncError as exc:
        out["error"] = str(exc)
    twin = cpu_group()
    out["same_twin"] = twin is cpu_group() and twin is cpu_group(topo.tp_group)   # one per ranks
    out["twin_ranks"] = dist.get_process_group_ranks(twin)
    return out


@pytest.mark.timeout(120)
def test_objects_and_agreement_run_on_a_gloo_twin():
    res = run_ranks(_collectives, 2, backend="cuda:gloo", timeout_s=90, pg_timeout_s=30, env=spawn_env())
    for r, out in enumerate(res):
        assert out["world_has_cpu"] is False and out["tp_has_cpu"] is False
        assert out["gathered"] == ([{"rank": 0}, {"rank": 1}] if r == 0 else None)
        assert out["broadcast"] == "from 0"
        assert out["error"] == "the test's stage failed on rank 1: boom"
        assert out["same_twin"] and out["twin_ranks"] == [0, 1]


def _demo(tmp_path, *flags: str) -> dict:
    out = tmp_path / "demo.json"
    # ranks started as fresh interpreters (spawn), as `fsdp-sync demo` starts them for a user
    env = dict(os.environ, TMPDIR=str(tmp_path), FSDP_SYNC_RANKS_START="spawn")
    proc = run_output([sys.executable, "-m", "fsdp_sync.cli", "demo", "--backend", "cuda:gloo",
                       "--steps", "1", "--no-progress", "--json", str(out), *flags],
                      timeout=250, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["config"]["backend"] == "cuda:gloo"
    for s in result["steps"]:
        assert s["tokens_exact"] and s["max_abs_logit_diff"] <= s["atol"], s
        assert s["changed_since_last_step"], s
    return result


@pytest.mark.timeout(300)
def test_demo_syncs_on_a_group_without_cpu_backend(tmp_path):
    """The CLI end to end (FSDP shards over the twin: a CPU trainer's tensors need a CPU group),
    colocated: handles gathered to infer-TP rank 0. The distributed and disk methods' demos run
    on the same group in `test_demo_methods`."""
    _demo(tmp_path, "--method", "tensor")


def test_backend_flag_is_checked(capsys):
    from _util import cli_here

    from fsdp_sync.cli.app import build_parser

    for good in ("gloo", "nccl", "cuda:gloo", "cpu:gloo,cuda:nccl"):
        assert build_parser().parse_args(["demo", "--backend", good]).backend == good
    # through the command's own main in this process: a child spends 2 s of CPU on its imports to
    # print one line (`test_cli_args` runs a refusal from the shell)
    proc = cli_here(capsys, "demo", "--backend", "mpi")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "expected gloo, nccl or a device map such as cpu:gloo,cuda:nccl, got 'mpi'" in proc.stderr


# --------------------------------------------------------------------------- one GPU, distributed

class _EngineOn:
    def __init__(self, ids):
        self._ids = ids

    def gpu_ids(self):
        return self._ids


def test_distributed_on_one_gpu_is_refused_before_anything_starts():
    """NCCL's ``Duplicate GPU detected`` came after the model was built and the engine started:
    the CLI refuses by arithmetic first, the transport before it joins the update group."""
    from fsdp_sync.cli.args import check_gpus
    from fsdp_sync.transport.distributed import check_distinct_gpus

    with pytest.raises(ValueError, match=r"--method distributed --device cuda needs --ranks \+ --tp = 2 "
                                         r"GPUs .* this machine has 1\. Use --method tensor"):
        check_gpus("distributed", "cuda", 1, 1, gpus=1)
    check_gpus("distributed", "cuda", 1, 1, gpus=2)
    check_gpus("tensor", "cuda", 1, 1, gpus=1)
    check_gpus("disk", "cuda", 1, 1, gpus=1)
    with pytest.raises(ValueError, match=r"trainer rank 0 \(cuda:0\) and engine 1's TP worker 1 would "
                                         r"share GPU 0.*base_gpu_id"):
        check_distinct_gpus([_EngineOn([1]), _EngineOn([1, 0])], torch.device("cuda", 0))
    check_distinct_gpus([_EngineOn([1, 2]), object()], torch.device("cuda", 0))


def test_reference_engine_places_workers_after_base_gpu_id():
    from fsdp_sync.engines import ReferenceEngine

    with pytest.raises(ValueError, match="base_gpu_id must be an int >= 0, got -1"):
        ReferenceEngine(model_config="tiny", base_gpu_id=-1)
