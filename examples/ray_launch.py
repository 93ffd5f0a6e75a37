"""Run a torchrun-style training script on Ray: one Ray actor per rank, each with the environment
torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so the same script
trains under either launcher. Ray is what verl uses to place its workers.

    python examples/ray_launch.py --nproc 2 examples/torchrun_rollout.py --method distributed
    python examples/ray_launch.py --nproc 2 examples/torchrun_rollout.py            # colocated

The job's rendezvous store is hosted here, in the launching process, before any actor starts
(`fsdp_sync.wire.host_store`: the OS picks its port, so nothing else can take it), and the ranks
join it as torchrun's ranks join its agent's (`wire.agent_store_env`:
``TORCHELASTIC_USE_AGENT_STORE=True``); a port picked free here and bound by rank 0 seconds later,
once its actor had started, could have been taken in between.

Each rank's output comes back to this process and is printed with its rank in front. A rank that
fails fails the launch (exit status 1), after every rank has finished or failed. Ray kills its
actors at shutdown; the script's engine workers are shut down by the script itself before that
(`engine.shutdown()` in its `finally`).

Needs `pip install ray` (it is not a dependency of fsdp_sync).
"""

import argparse
import contextlib
import io
import os
import runpy
import sys
import traceback

import ray

from fsdp_sync.wire import agent_store_env, host_store


@ray.remote(num_cpus=0)
class Rank:
    """One rank of the job: runs the script in this actor's process, as torchrun's child would."""

    def run(self, script: str, argv: list[str], env: dict[str, str]) -> tuple[bool, str]:
        os.environ.update(env)
        sys.argv = [script, *argv]
        out = io.StringIO()
        ok = True
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                ok = e.code in (None, 0)
            except BaseException:   # noqa: BLE001: the driver reports it with the rank's output
                traceback.print_exc()
                ok = False
        return ok, out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one Ray actor each); default 2")
    ap.add_argument("script", help="the training script, as torchrun would run it")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = ap.parse_args()

    # the script's directory first on its path, as `python script.py` would have it
    env = {"PYTHONPATH": os.pathsep.join(p for p in [os.path.dirname(os.path.abspath(args.script)),
                                                     os.environ.get("PYTHONPATH", "")] if p)}
    ray.init(num_cpus=args.nproc, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False)
    try:
        store = host_store(args.nproc, timeout_s=1800)      # as torchrun's default timeout
        ranks = [Rank.remote() for _ in range(args.nproc)]
        futures = [r.run.remote(os.path.abspath(args.script), args.args,
                                {"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(args.nproc),
                                 "LOCAL_WORLD_SIZE": str(args.nproc), **agent_store_env(store)})
                   for i, r in enumerate(ranks)]
        results = ray.get(futures)
    finally:
        ray.shutdown()
    for i, (ok, out) in enumerate(results):
        for line in out.splitlines():
            print(f"[rank {i}] {line}")
        if not ok:
            print(f"[rank {i}] failed", file=sys.stderr)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
