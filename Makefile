# `make demo` and `make test` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel this project is developed against; set TORCH_SPEC=torch (or a CUDA build) elsewhere.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test test-slow test-min-transformers test-verl test-openrlhf test-swift lint gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev,trl,bench,deepspeed]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m shared_prefix_logps.bench.demo

# Two workers (pytest-xdist), a test file each at a time (module fixtures stay in one process): the tests run on one
# torch thread, so the 2-core machine runs the suite in about 11 minutes instead of 20. The tests marked `slow` (more
# compiled and ZeRO-3 variants of what the suite already checks, the GPU script's full dry run) run apart, in CI too.
test: $(VENV)/.installed
	$(PY) -m pytest -q -ra -n 2 --dist loadfile -m "not slow" tests

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -ra -n 2 --dist loadfile -m slow tests

# The core tests (no TRL) against the lowest transformers that pyproject.toml admits, in their own venv, so the
# lower bound stays a tested one: bump it there when this fails and no small fix makes it pass.
MIN_VENV ?= .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_TRANSFORMERS := $(shell sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
CORE_TESTS := tests/core tests/models tests/backends tests/forward tests/kernels tests/distributed/test_ddp.py \
	tests/distributed/test_fsdp.py

$(MIN_VENV)/.installed: pyproject.toml
	@test -n "$(MIN_TRANSFORMERS)" || { echo "no transformers>= bound found in pyproject.toml"; exit 1; }
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -c "import torch" 2>/dev/null || $(MIN_PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(MIN_PY) -m pip install --quiet --disable-pip-version-check "transformers==$(MIN_TRANSFORMERS)" -e ".[dev]"
	touch $@

test-min-transformers: $(MIN_VENV)/.installed
	$(MIN_PY) -c "import transformers; from packaging.version import Version as V; \
		assert V(transformers.__version__) == V('$(MIN_TRANSFORMERS)'), transformers.__version__"
	$(MIN_PY) -m pytest -p no:cacheprovider -q -ra $(CORE_TESTS)

# The verl plug-in's tests in their own venv: verl pins an older transformers than the other extras. verl is imported
# before pytest runs, so a broken install fails here instead of skipping every test (and pytest's exit code 5, no
# test collected, fails the target too).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_TESTS := tests/integrations/verl benchmarks/test_verl_bench.py

$(VERL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -c "import torch" 2>/dev/null || $(VERL_PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(VERL_PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,verl]"
	touch $@

test-verl: $(VERL_VENV)/.installed
	$(VERL_PY) -c "import verl; print('verl', verl.__version__)"
	$(VERL_PY) -m pytest -p no:cacheprovider -q -ra $(VERL_TESTS)

# The OpenRLHF plug-in's tests in their own venv: OpenRLHF pins transformers and deepspeed, and requires flash-attn
# and vLLM, which build only against CUDA. OpenRLHF is installed without its dependencies, then with the ones its
# actor, losses, replay buffer and launcher import (its own pins); flash-attn, vLLM, bitsandbytes, wandb and
# ray[default]'s dashboard extras are left out (the tests stand in for flash-attn and vLLM, whose functions only
# packing, ring attention and generation call: tests/support/openrlhf_setup.py).
OPENRLHF_VENV ?= .venv-openrlhf
OPENRLHF_PY := $(OPENRLHF_VENV)/bin/python
OPENRLHF_SPEC ?= openrlhf==0.11.2
OPENRLHF_DEPS := "transformers==5.15.0" "deepspeed==0.19.6" "ray==2.55.0" peft accelerate datasets einops tqdm optree \
	jsonlines torchmetrics torchdata pylatexenc sympy isort aiohttp tensorboard

$(OPENRLHF_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OPENRLHF_VENV)
	$(OPENRLHF_PY) -c "import torch" 2>/dev/null || $(OPENRLHF_PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(OPENRLHF_PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(OPENRLHF_SPEC)"
	$(OPENRLHF_PY) -m pip install --quiet --disable-pip-version-check $(OPENRLHF_DEPS) -e ".[dev]"
	touch $@

test-openrlhf: $(OPENRLHF_VENV)/.installed
	$(OPENRLHF_PY) -c "import importlib.metadata as m; print('openrlhf', m.version('openrlhf'))"
	$(OPENRLHF_PY) -m pytest -p no:cacheprovider -q -ra tests/integrations/openrlhf

# The ms-swift plug-in's tests in their own venv: ms-swift 4.6.0 caps transformers (<5.20) and TRL (<1.0) below the
# main venv's. msgspec is imported by its GRPO trainer without being declared; liger-kernel serves the Liger fallback
# test. ms-swift is imported before pytest runs, so a broken install fails here instead of skipping every test.
SWIFT_VENV ?= .venv-swift
SWIFT_PY := $(SWIFT_VENV)/bin/python
SWIFT_SPEC ?= ms-swift==4.6.0

$(SWIFT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(SWIFT_VENV)
	$(SWIFT_PY) -c "import torch" 2>/dev/null || $(SWIFT_PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(SWIFT_PY) -m pip install --quiet --disable-pip-version-check "$(SWIFT_SPEC)" "transformers<5.20" "trl<1.0" msgspec liger-kernel \
		-e ".[dev]"
	touch $@

test-swift: $(SWIFT_VENV)/.installed
	$(SWIFT_PY) -c "import swift, swift.rlhf_trainers.grpo_trainer; print('ms-swift', swift.__version__)"
	$(SWIFT_PY) -m pytest -p no:cacheprovider -q -ra tests/integrations/swift

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# On a CUDA machine: the GPU tests and benchmarks, results under $$OUT (default ./out).
gpu:
	bash benchmarks/run_gpu.sh

clean:
	rm -rf $(VENV) $(MIN_VENV) $(VERL_VENV) $(OPENRLHF_VENV) $(SWIFT_VENV) .pytest_cache .ruff_cache
