# ecd: `make serve`, `make test`, `make bench`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch: a plain `pip install torch` would pull several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/node.toml
PYTEST_ARGS ?=

.PHONY: serve test bench install venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Install torch first (only if the venv has none), so resolving ecd's "torch>=2.1" finds it.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

venv install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/ecd serve --config $(CONFIG)

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
