# `make demo` and `make test` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel this project is developed against; set TORCH_SPEC=torch (or a CUDA build) elsewhere.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo test lint gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev,trl,bench]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m shared_prefix_logps.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -ra tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# On a CUDA machine: the GPU tests and benchmarks, results under $$OUT (default ./out).
gpu:
	bash benchmarks/run_gpu.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
