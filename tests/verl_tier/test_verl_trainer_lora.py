"""verl's own trainer loop with fsdp_sync and LoRA (`make test-verl`): the tiny GRPO recipe with
``lora_rank=4``, end to end; the checks are test_verl_trainer.py's (its docstring), and those of the
test's own docstring."""

from __future__ import annotations

import pytest

from grpo_recipe import run_recipe

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]


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

    run_recipe(tmp_path, tiny_grpo_dir, [f"actor_rollout_ref.model.lora_rank={LORA_R}",
                           f"actor_rollout_ref.model.lora_alpha={LORA_ALPHA}"], check)
