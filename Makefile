# Set-up and everyday commands. `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all bench test-megatron-latest

setup: $(VENV)/.installed

# torch==2.13.0 (CPU) via the `cpu` extra; GPU clusters install with `pip install -e '.[triton]'`.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e '.[cpu,triton,dev]'
	touch $@

demo: setup
	$(BIN)/python examples/cpu_demo.py

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q --runslow

bench: setup
	$(BIN)/python tools/bench_codec.py
	$(BIN)/python tools/bench_allgather.py

# The Megatron tests on the newest megatron-core (needs Python >= 3.12; torch for 3.12 comes from
# PyPI as its default CUDA build, which runs on CPU). Separate venv; CI stays on 0.16.1 / 3.11.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312 ?= .venv312
test-megatron-latest:
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VENV312)/bin/python -m pip install -q --upgrade torch megatron-core
	$(VENV312)/bin/python -m pip install -q -e '.[triton,dev]'
	$(VENV312)/bin/python -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
	$(VENV312)/bin/python -m pytest -q tests/megatron
