#!/usr/bin/env bash
# GRPO, Qwen2.5-0.5B-Instruct on GSM8K, SGLang rollout, in verl's override style. The line marked
# fsdp_sync is the only change to a stock verl run: drop it and verl syncs weights its own way.
# Needs verl 0.9.1 with its GPU extras (e.g. pip install "verl[sglang]==0.9.1") and fsdp_sync
# installed in the same environment (pip install -e . from a clone of fsdp_sync: it is not on
# a package index), and the GSM8K parquet files
# (python3 examples/data_preprocess/gsm8k.py from verl's repository).
set -xeuo pipefail

DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
NGPUS=${NGPUS:-8}

ARGS=(
  algorithm.adv_estimator=grpo
  data.train_files="$DATA/train.parquet"
  data.val_files="$DATA/test.parquet"
  data.train_batch_size=256
  data.max_prompt_length=512
  data.max_response_length=1024
  data.filter_overlong_prompts=True
  data.truncation=error
  actor_rollout_ref.model.path="$MODEL"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.strategy=fsdp2
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=64
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.use_kl_loss=True
  actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.actor.kl_loss_type=low_var_kl
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=sglang
  actor_rollout_ref.rollout.tensor_model_parallel_size=2
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  actor_rollout_ref.rollout.n=5
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
  actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512
  +actor_rollout_ref.rollout.custom.fsdp_sync.enable=true          # fsdp_sync
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
  actor_rollout_ref.ref.fsdp_config.param_offload=True
  algorithm.use_kl_in_reward=False
  trainer.critic_warmup=0
  trainer.logger='["console"]'
  trainer.project_name=fsdp_sync_verl
  trainer.experiment_name=qwen2_5_0_5b_grpo_gsm8k_fsdp_sync
  trainer.n_gpus_per_node="$NGPUS"
  trainer.nnodes=1
  trainer.save_freq=-1
  trainer.test_freq=5
  trainer.total_epochs=15
)

python3 -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
