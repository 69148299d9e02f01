# Set-up and everyday commands. `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup native demo test test-all bench bench-codec

setup: $(VENV)/.installed

# torch==2.13.0 (CPU) via the `cpu` extra; GPU clusters install with `pip install -e '.[triton]'`.
$(VENV)/.installed: setup.py ciera/native/csrc/ciera_codecs.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e '.[cpu,triton,dev]'
	touch $@

# Rebuild the native CPU codecs in place after editing ciera/native/csrc (make setup builds them too).
native: setup
	$(BIN)/python setup.py -q build_ext --inplace

demo: setup
	$(BIN)/python examples/cpu_demo.py

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q --runslow

bench: setup
	$(BIN)/python tools/bench_codec.py
	$(BIN)/python tools/bench_allgather.py

# Issue 16's codec table in one command: reference vs native (1 and 2 threads) vs ZipNN and zstd.
bench-codec: setup
	$(BIN)/python -m pip install -q -e '.[cpu,triton,dev,peers]'
	$(BIN)/python tools/bench_codec.py --lr 1e-4 --steps 8 --clock cpu
	$(BIN)/python tools/bench_codec.py --lr 1e-4 --steps 8
