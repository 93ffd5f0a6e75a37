# Two commands work on a fresh machine: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on CPU machines of this kind. It is installed before the project,
# so `torch>=2.6` in pyproject.toml is already met and no CUDA build is ever pulled. Override
# TORCH_SPEC on a GPU machine (e.g. TORCH_SPEC=torch) if you want pip to pick a CUDA build there.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.fsdp_sync-installed

.PHONY: venv demo test test-gpu test-sglang bench bench-targets clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fsdp-sync demo

test: $(STAMP)
	$(PY) -m pytest -q

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

bench-targets: $(STAMP)
	$(VENV)/bin/fsdp-sync bench --preset targets --json bench-out/targets.json --plot bench-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-out
