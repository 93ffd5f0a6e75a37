"""verl's own trainer loop with fsdp_sync (`make test-verl`): the tiny GRPO recipe, end to end.

`recipes/verl/run_tiny_grpo_cpu.sh` runs ``python -m verl.trainer.main_ppo`` (verl 0.9.1, GRPO,
FSDP2 actor on 2 CPU ranks, ``VERL_PLATFORM=cpu``) for 3 steps with ``rollout.name=fsdp_sync_ref``:
the replica starts ``fsdp-sync serve --tp 2`` itself and fsdp_sync's adapter syncs into it, with
``verify=full``, before the first rollout and after every step. Checked from verl's own logged
metrics and from the adapter's metrics file:

- verl ran 3 steps and exited 0; the rewards were not constant; the rollout's log-probs (serve's
  ``output_token_logprobs``, ``calculate_log_probs=True``) agree with the actor's recomputation;
- 4 syncs (global steps 0-3), each verified in full: every tensor's digest in the engine equals the
  digest of what was sent (a mismatch would have failed the run), each exported by fsdp_sync's
  bucketed export from verl's FSDP module (`integrations.module_stream`), not verl's per-tensor
  generator (its log line and metrics-file record say so);
- each step's logged metrics carry that step's sync figures (``fsdp_sync/sync_s``, ``bytes``,
  ``buckets``, ``tensors``, ``verify_tensors``, ...) equal to the adapter's own record;
- sync 0 carries exactly the checkpoint's weights (digests of model.safetensors), and every later
  sync carries weights that differ from the one before in every tensor (each step's Adam update
  reaches them all);
- with LoRA (``lora_rank=4``, served as an adapter as verl's SGLang rollout serves it): the base
  once, then the adapter only (its bytes exactly lora_A + lora_B, far below the model's), every
  sync verified, each step's figures the adapter sync's;
- nothing is left behind (after each run): no process of the run (they carry a marker in their environment), no
  listener on serve's port, no new shared-memory segment that no live process holds (other jobs
  on the machine may hold theirs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "recipes" / "verl" / "run_tiny_grpo_cpu.sh"
STEP = re.compile(r"step:(\d+) - (.*)")


def _marked(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FSDP_SYNC_TEST_RUN") == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _orphaned(names: set[str]) -> list[str]:
    """The ``/dev/shm`` entries of ``names`` that still exist and no live process has open or
    mapped: leftovers, as opposed to the segments of other jobs running on this machine."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[9:].split(" ")[0])
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split("/dev/shm/", 1)[1].split(" ")[0].strip()
                            for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return sorted(n for n in names if os.path.exists(f"/dev/shm/{n}") and n not in held)


def _steps(log: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for m in STEP.finditer(log):
        metrics = {}
        for part in m.group(2).split(" - "):
            key, _, value = part.partition(":")
            num = re.search(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", value)
            if num:
                metrics[key.strip()] = float(num.group(0))
        steps[int(m.group(1))] = metrics
    return steps


def _temp_dirs(since: float = 0.0) -> set[str]:
    """What a run left in the temp directory: multiprocessing's and torch_shm_manager's
    directories no live process holds (`memory.temp_dirs`) and the run script's own TMPDIR, made
    at ``since`` or later (a directory older than the run is another job's, orphaned meanwhile:
    on a shared machine other test runs come and go)."""
    from fsdp_sync.memory import temp_dirs

    found = temp_dirs() | {str(p) for p in Path(tempfile.gettempdir()).glob("fsr-tmp.*")}
    out = set()
    for d in found:
        try:
            if os.stat(d).st_ctime >= since:
                out.add(d)
        except OSError:
            continue
    return out


def _run_recipe(tmp_path, tiny_dir, overrides: list[str], check) -> None:
    """Run the tiny GRPO recipe with ``overrides`` (assets in ``tiny_dir``, made by the first run
    of the session), call ``check(log, steps, syncs, wall)`` on a successful run (``syncs``: the
    adapter's metrics-file records), then check that nothing is left behind (see the module
    docstring). Ray's dashboard is left out (``include_dashboard=false``): nothing here reads it,
    and its head process and modules are seconds of CPU in every run."""
    marker = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="fsr", dir="/tmp")   # Ray's socket paths must stay short
    shm_before = set(os.listdir("/dev/shm"))
    started = time.time() - 1.0
    tmp_before = _temp_dirs()
    metrics_file = tmp_path / "sync.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, TINY_DIR=str(tiny_dir),
               RAY_TMPDIR=ray_tmp, FSDP_SYNC_TEST_RUN=marker,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", str(RUN), f"+actor_rollout_ref.rollout.custom.fsdp_sync.metrics_file={metrics_file}",
             f"+actor_rollout_ref.rollout.custom.fsdp_sync.log_dir={tmp_path}",
             "+ray_kwargs.ray_init.include_dashboard=false", *overrides],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=780)
        wall = time.monotonic() - t0
        log = proc.stdout + proc.stderr
        (tmp_path / "run.log").write_text(log)
        assert proc.returncode == 0, log[-6000:]
        steps = _steps(log)
        assert sorted(steps) == [1, 2, 3], log[-4000:]
        syncs = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        check(log, steps, syncs, wall)
        url = re.search(r" on http://127\.0\.0\.1:(\d+) ",
                        (tmp_path / "fsdp_sync_serve_0_0.log").read_text())
        assert url, "serve's log has no URL line"
        port = int(url.group(1))
    finally:
        deadline = time.monotonic() + 60
        left = _marked(marker)
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _marked(marker)
        lingered = []
        for p in left:      # named before the kill (a killed one is a zombie: no cmdline)
            try:
                lingered.append((p.pid, p.name(), p.cmdline()[:4]))
            except psutil.Error:
                lingered.append((p.pid, "(gone)", []))
            p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"still running 60 s after the run ended: {lingered}"
    listening = [c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    assert not listening, f"port {port} (serve) still listened on: {listening}"
    left_shm = _orphaned(set(os.listdir("/dev/shm")) - shm_before)
    if left_shm:
        # other jobs on a shared machine make segments too, and one may be unheld for a moment
        # while its processes start or stop: a leftover of this run is still there, still
        # unheld, a few seconds later
        time.sleep(5)
        left_shm = sorted(set(left_shm) & set(_orphaned(set(left_shm))))
    assert not left_shm, f"shared-memory segments left behind: {left_shm}"
    # Ray SIGKILLs its workers: the run script's own TMPDIR takes what multiprocessing left there
    left_tmp = sorted(_temp_dirs(since=started) - tmp_before)
    assert not left_tmp, f"temp directories left behind by the run: {left_tmp}"


def test_tiny_grpo_trains_in_verls_own_loop_with_every_sync_verified(tmp_path, tiny_grpo_dir):
    from safetensors.torch import load_file

    from fsdp_sync.verify import tensor_digest

    def check(log, steps, syncs, wall):
        # verl's own metrics: rewards with spread, rollout log-probs = actor's
        scores = [(s["critic/score/min"], s["critic/score/max"]) for s in steps.values()]
        assert any(lo < hi for lo, hi in scores), f"constant rewards: {scores}"
        for n, s in steps.items():
            assert s["training/rollout_probs_diff_max"] < 1e-3, (n, s["training/rollout_probs_diff_max"])
            assert s["timing_s/update_weights"] > 0

        # the adapter's record of every sync
        assert [s["global_steps"] for s in syncs] == [0, 1, 2, 3]
        assert {s["kind"] for s in syncs} == {"full"}
        ckpt = load_file(str(tiny_grpo_dir / "model" / "model.safetensors"))
        for s in syncs:
            assert s["verify"] == "full" and s["verify_tensors"] == s["tensors"] == len(ckpt), s
            # fsdp_sync's bucketed export from verl's FSDP module, not verl's per-tensor
            # generator: the names match exactly (`integrations.module_stream`)
            assert s["export"] == "fsdp_sync", s
            assert sorted(s["digests"]) == sorted(ckpt)
        # the exactness comparison made once, then kept: verl's loop keeps the module's objects
        assert [s["export_decision"] for s in syncs] == ["made", "kept", "kept", "kept"]
        # the sync's log line says so too (Ray may fold alike lines of a run: one at least)
        assert re.search(r"fsdp_sync verl sync \(step \d\): [\d.]+ s \(fsdp_sync's export", log), \
            log[-4000:]
        assert "walking verl's per-tensor export" not in log
        assert syncs[0]["digests"] == {n: tensor_digest(n, t) for n, t in ckpt.items()}
        for n in (1, 2, 3):
            before, after = syncs[n - 1]["digests"], syncs[n]["digests"]
            changed = [k for k in after if after[k] != before[k]]
            # an Adam step moves every tensor whose gradient is not all zero: all of them here
            assert steps[n]["actor/grad_norm"] > 0
            assert len(changed) == len(after), (
                f"step {n} trained (grad norm {steps[n]['actor/grad_norm']}) but sync {n} carried "
                f"{len(after) - len(changed)} tensors unchanged: "
                f"{sorted(set(after) - set(changed))[:5]}")
        # the adapter's figures reach verl's own step metrics (console here; wandb and
        # tensorboard get the same dict), beside timing_s/update_weights of the same sync
        for n in (1, 2, 3):
            logged, sync = steps[n], syncs[n]
            assert logged["fsdp_sync/replicas"] == 1, logged
            for key in ("bytes", "tensors", "buckets", "engine_calls", "verify_tensors"):
                assert logged[f"fsdp_sync/{key}"] == sync[key], (n, key, logged)
            assert logged["fsdp_sync/sync_s"] == pytest.approx(sync["sync_s"], rel=1e-6)
            assert 0 < logged["fsdp_sync/sync_s"] < logged["timing_s/update_weights"], logged
            assert logged["fsdp_sync/verify_s"] == pytest.approx(sync["verify_s"], rel=1e-6)
        print(f"\ntiny GRPO, 3 steps in {wall:.0f} s; per sync (fsdp_sync s / verl update_weights s): "
              + ", ".join(f"{s['global_steps']}: {s['sync_s']:.3f}" + (
                  f"/{steps[s['global_steps']]['timing_s/update_weights']:.3f}"
                  if s["global_steps"] in steps else "") for s in syncs))

    _run_recipe(tmp_path, tiny_grpo_dir, [], check)


LORA_R, LORA_ALPHA = 4, 8


def test_tiny_grpo_with_lora_syncs_the_base_once_then_the_adapter_only(tmp_path, tiny_grpo_dir):
    """The same recipe with LoRA (``actor_rollout_ref.model.lora_rank=4``, verl's default
    ``target_modules=all-linear``, ``lora.merge=false``: served as an adapter, as verl's own SGLang
    rollout serves it). verl syncs the base once (global step 0, peft's ``.base_layer.`` names),
    then only the adapter, before the first rollout and after every step; each sync verified in
    full (the base's digests against the checkpoint's, the adapter read back from the engine bit
    for bit), the adapter syncs' bytes exactly lora_A + lora_B of every linear layer, far below
    the model's, and each step's logged ``fsdp_sync/*`` figures the adapter sync's (step 1's
    also the base's: ``fsdp_sync/base_sync_s``, ``base_bytes``)."""
    from safetensors.torch import load_file

    from fsdp_sync.models import load_config
    from fsdp_sync.verify import tensor_digest

    def check(log, steps, syncs, wall):
        for n, s in steps.items():
            assert s["training/rollout_probs_diff_max"] < 1e-3, (n, s["training/rollout_probs_diff_max"])
        assert [(s["global_steps"], s["kind"]) for s in syncs] == [
            (0, "base"), (0, "adapter"), (1, "adapter"), (2, "adapter"), (3, "adapter")], syncs
        ckpt = load_file(str(tiny_grpo_dir / "model" / "model.safetensors"))
        base, adapters = syncs[0], syncs[1:]
        assert base["verify"] == "full" and base["verify_tensors"] == base["tensors"] == len(ckpt)
        assert base["digests"] == {n: tensor_digest(n, t) for n, t in ckpt.items()}  # names stripped
        cfg = load_config(str(tiny_grpo_dir / "model" / "config.json"))
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        q, kv, h, i = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim, \
            cfg.hidden_size, cfg.intermediate_size
        shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]     # (in, out) per target
        want_bytes = cfg.num_hidden_layers * sum(LORA_R * (a + b) * 4 for a, b in shapes)   # float32
        for s in adapters:
            assert s["verify"] == "full" and s["verify_tensors"] == s["tensors"] \
                == 2 * len(shapes) * cfg.num_hidden_layers, s
            assert s["bytes"] == want_bytes and s["bytes"] < base["bytes"] / 10, (s["bytes"], base["bytes"])
            assert s["lora_r"] == LORA_R and all(".lora_A." in n or ".lora_B." in n for n in s["digests"])
        for n in (1, 2, 3):
            before, after = adapters[n - 1]["digests"], adapters[n]["digests"]
            changed = {k for k in after if after[k] != before[k]}
            # peft starts B at zero, so A's gradient is zero in step 1; every B moves every step,
            # every tensor from step 2 on
            want = {k for k in after if ".lora_B." in k} if n == 1 else set(after)
            assert want <= changed, (n, sorted(want - changed)[:4])
        for n in (1, 2, 3):
            logged, sync = steps[n], adapters[n]
            assert logged["fsdp_sync/adapter"] == 1.0, logged
            for key in ("bytes", "tensors", "engine_calls", "verify_tensors"):
                assert logged[f"fsdp_sync/{key}"] == sync[key], (n, key, logged)
            assert logged["fsdp_sync/sync_s"] == pytest.approx(sync["sync_s"], rel=1e-6)
        # the base went at on_init_end (step 0), drained with step 1's figures (verl2 audit, item 4)
        assert steps[1]["fsdp_sync/base_sync_s"] == pytest.approx(base["sync_s"], rel=1e-6), steps[1]
        assert steps[1]["fsdp_sync/base_bytes"] == base["bytes"], steps[1]
        assert not any("fsdp_sync/base_bytes" in steps[n] for n in (2, 3)), steps
        print(f"\ntiny GRPO with LoRA r={LORA_R}, 3 steps in {wall:.0f} s; base sync "
              f"{base['sync_s']:.3f} s, {base['bytes']} B; adapter syncs "
              + ", ".join(f"{s['global_steps']}: {s['sync_s']:.3f} s" for s in adapters)
              + f", {adapters[-1]['bytes']} B each")

    _run_recipe(tmp_path, tiny_grpo_dir, [f"actor_rollout_ref.model.lora_rank={LORA_R}",
                           f"actor_rollout_ref.model.lora_alpha={LORA_ALPHA}"], check)
