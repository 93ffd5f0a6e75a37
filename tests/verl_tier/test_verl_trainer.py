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
- with LoRA (``lora_rank=4``, served as an adapter as verl's SGLang rollout serves it;
  test_verl_trainer_lora.py, a file of its own so the two runs go side by side): the base once,
  then the adapter only (its bytes exactly lora_A + lora_B, far below the model's), every sync
  verified, each step's figures the adapter sync's;
- nothing is left behind (after each run): no process of the run (they carry a marker in their environment), no
  listener on serve's port, no new shared-memory segment that no live process holds (other jobs
  on the machine may hold theirs).
"""
from __future__ import annotations

import re

import pytest

from grpo_recipe import run_recipe

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]


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

    run_recipe(tmp_path, tiny_grpo_dir, [], check)
