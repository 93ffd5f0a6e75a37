# Two commands work on a fresh machine: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on CPU machines of this kind (where pip's find-links point). It is
# installed before the project, so `torch>=2.6` in pyproject.toml is already met and no CUDA build is
# ever pulled. Override TORCH_SPEC on a GPU machine (e.g. TORCH_SPEC=torch) for a CUDA build there.
# Every venv is built with uv (scripts/uv_env.sh), itself installed once into .venv-uv with pip.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.fsdp_sync-installed

.PHONY: venv demo demo-verl test test-gpu test-sglang test-verl bench bench-targets clean

venv: $(STAMP)

# scripts/project_env.sh: uv installs torch, then the project with its test and cli extras.
$(STAMP): pyproject.toml scripts/project_env.sh scripts/uv_env.sh
	VENV="$(VENV)" TORCH_SPEC="$(TORCH_SPEC)" PYTHON="$(PYTHON)" bash scripts/project_env.sh
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fsdp-sync demo

# The project's bytecode, compiled once before the tests: where PYTHONDONTWRITEBYTECODE is set (as on
# these machines) or the clone is fresh, every process a test starts (a CLI run, a launcher's ranks, a
# snippet, a server) would otherwise compile the library's modules anew: about 0.8 s of CPU each.
BYTECODE = -m compileall -q -j 0 fsdp_sync tests examples scripts dev > /dev/null

# -n 2: two tests at a time (pytest-xdist): the multi-process tests spend much of their time
# waiting (timeouts, polls, replies). Rank processes fork from a server that imported torch and
# transformers once (tests/conftest.py), a rank's engine workers from a server forked from the rank
# (procs.prefork_worker_server), the longest tests start first. On 2 cores: 615 s for 2571 tests
# (1103 s of busy CPU: the machine is CPU-bound, not waiting; -n 3 took 603 s, within the host's
# run-to-run spread, so not kept). --durations: the slowest tests, so the suite's time can be watched
test: $(STAMP)
	$(PY) $(BYTECODE)
	$(PY) -m pytest -q -n 2 --durations=20

# The GPU tier (tests/test_gpu.py and the other gpu-marked tests): skips without CUDA. On a GPU
# machine without the venv (scripts/gpu_check.sh): make test-gpu PY=python3 STAMP=
PYTEST_GPU_ARGS ?=
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_GPU_ARGS)

# Optional tier, not part of `make test`: our payloads and adapter calls against the real sglang,
# installed (CPU torch, sglang without its GPU dependencies) into a venv of its own by
# scripts/sglang_env.sh. Fails, never skips, when sglang cannot be installed or imported.
# Then the wire contract, the receivers, the adapter and LoRA again against each of SGLANG_OLD_VERSIONS
# (0.5.12: verl 0.9.1's pin), installed beside it in the same venv and put first on PYTHONPATH.
# -n 2 --dist loadfile: two test files at a time (a file's module fixtures run once); on 2 cores
# 108 s against 147 s one at a time (the older release's files: 62 s against 74 s).
SGLANG_VENV    ?= .venv-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_OLD_VERSIONS ?= 0.5.12
SGLANG_OLD_TESTS ?= tests/sglang_tier/test_real_sglang.py tests/sglang_tier/test_sglang_distributed.py \
                    tests/sglang_tier/test_sglang_lora.py tests/sglang_tier/test_sglang_memory_tags.py \
                    tests/sglang_tier/test_sgladapt_bodies.py tests/sglang_tier/test_sgladapt_lora_rank_real.py \
                    tests/sglang_tier/test_h11_lora_targets_real.py tests/sglang_tier/test_h53_release_floor.py \
                    tests/sglang_tier/test_h86_launch_fields.py

test-sglang:
	SGLANG_VENV="$(SGLANG_VENV)" SGLANG_VERSION="$(SGLANG_VERSION)" TORCH_SPEC="$(TORCH_SPEC)" \
	  SGLANG_OLD_VERSIONS="$(SGLANG_OLD_VERSIONS)" PYTHON="$(PYTHON)" bash scripts/sglang_env.sh
	$(SGLANG_VENV)/bin/python $(BYTECODE)
	FSDP_SYNC_SGLANG_TIER=1 FSDP_SYNC_SGLANG_VERSION="$(SGLANG_VERSION)" PYTHONPATH=. \
	  $(SGLANG_VENV)/bin/python -m pytest -q -m sglang -n 2 --dist loadfile tests/sglang_tier
	@set -e; for v in $(SGLANG_OLD_VERSIONS); do \
	  echo "sglang $$v: $(SGLANG_OLD_TESTS)"; \
	  FSDP_SYNC_SGLANG_TIER=1 FSDP_SYNC_SGLANG_VERSION=$$v \
	  PYTHONPATH="$(abspath $(SGLANG_VENV))/sglang-$$v:$(CURDIR)/tests/sglang_tier/old_release:$(CURDIR)" \
	    $(SGLANG_VENV)/bin/python -m pytest -q -m sglang -n 2 --dist loadfile $(SGLANG_OLD_TESTS); \
	done

# Optional tier, not part of `make test`: fsdp_sync's verl plug-in, recipes and adapter against the
# real verl (pinned, no extras: they pull another torch), in a venv of its own built by
# scripts/verl_env.sh. Fails, never skips, when verl cannot be installed or imported.
# -n 2 --dist loadfile, as the sglang tier: on 2 cores 322 s against 418 s one file at a time
# (same host, nothing else running). xdist's default order leaves the two runs of verl's own
# trainer (test_verl_trainer.py and test_verl_trainer_lora.py, a file each) to the end, where they
# run side by side (341 s for the tier against 366 s with both in one file, run one after the
# other): Ray starts its workers niced (RAY_worker_niceness), and beside the other files the
# first run took 258 s instead of 109 s (the whole tier 393 s).
VERL_VENV    ?= .venv-verl
VERL_VERSION ?= 0.9.1

test-verl:
	VERL_VENV="$(VERL_VENV)" VERL_VERSION="$(VERL_VERSION)" TORCH_SPEC="$(TORCH_SPEC)" \
	  PYTHON="$(PYTHON)" bash scripts/verl_env.sh
	$(VERL_VENV)/bin/python $(BYTECODE)
	FSDP_SYNC_VERL_TIER=1 PYTHONPATH=. $(VERL_VENV)/bin/python -m pytest -q -m verl \
	  -n 2 --dist loadfile tests/verl_tier

# verl 0.9.1's own trainer on this CPU machine: 3 GRPO steps of a tiny Qwen2, rollout on the
# reference engine (rollout.name=fsdp_sync_ref), every sync verified. Assets go to out/tiny_grpo.
# VERL_ARGS: Hydra overrides, e.g. "actor_rollout_ref.model.lora_rank=4" (LoRA, docs/lora.md).
demo-verl:
	VERL_VENV="$(VERL_VENV)" VERL_VERSION="$(VERL_VERSION)" TORCH_SPEC="$(TORCH_SPEC)" \
	  PYTHON="$(PYTHON)" bash scripts/verl_env.sh
	mkdir -p out
	cd out && PYTHON="$(abspath $(VERL_VENV))/bin/python" bash ../recipes/verl/run_tiny_grpo_cpu.sh $(VERL_ARGS)

bench-targets: $(STAMP)
	$(VENV)/bin/fsdp-sync bench --preset targets --json bench-out/targets.json --plot bench-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-out
