# Set-up and everyday commands. `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-demo native demo test test-all bench bench-codec setup312 test-latest testbed-setup demo-cluster bench-cluster

# Two levels of set-up in one .venv:
#   setup-demo  torch==2.13.0 (CPU) + megatron-core + matplotlib: the demos, the launch scripts, the tools
#   setup       plus what the tests and benchmarks need: triton (its interpreter runs the kernel
#               tests on CPU), pytest, hypothesis, tensorboard and wandb (logging tests)
# GPU clusters install with `pip install -e '.[triton]'` into their own torch.
setup-demo: $(VENV)/.base $(VENV)/.native
setup: $(VENV)/.installed $(VENV)/.native

# pip builds the native codecs from the current C source, hence the .native stamp.
# pip -qq --disable-pip-version-check: errors only, no banners (the demo's output stays short).
PIP_QUIET := -qq --disable-pip-version-check
$(VENV)/.base: setup.py
	@echo "setting up $(VENV) (torch CPU, megatron-core, matplotlib)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install $(PIP_QUIET) --upgrade pip setuptools wheel
	@$(BIN)/python -m pip install $(PIP_QUIET) -e '.[cpu,plots]'
	@touch $@ $(VENV)/.native

$(VENV)/.installed: $(VENV)/.base
	$(BIN)/python -m pip install -q -e '.[cpu,triton,dev]'
	touch $@ $(VENV)/.native

# An edit of ciera/native/csrc (any .c or .h) rebuilds only the extension in place (seconds), not
# the venv. The stamp is tested again here: .base may have rebuilt it after make compared times.
NATIVE_SRC := $(wildcard ciera/native/csrc/*.c ciera/native/csrc/*.h)
$(VENV)/.native: $(NATIVE_SRC) | $(VENV)/.base
	@[ -e $@ ] && [ -z "$$(find $(NATIVE_SRC) -newer $@)" ] || { $(BIN)/python setup.py -q build_ext --inplace && touch $@; }

# Rebuild the native CPU codecs in place now, whatever the stamps say.
native: | $(VENV)/.base
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(VENV)/.native

demo: setup-demo
	@$(BIN)/python examples/cpu_demo.py

test: setup testbed-setup
	$(BIN)/python -m pytest -q

test-all: setup testbed-setup
	$(BIN)/python -m pytest -q --runslow

bench: setup
	$(BIN)/python tools/bench_codec.py
	$(BIN)/python tools/bench_allgather.py

# Multi-host testbed (tools/testbed): network namespaces need root; SLURM needs slurm-wlm + munge.
# As root, installs what is missing (Debian); otherwise says so, and the testbed tests skip.
testbed-setup:
	@if [ "$$(id -u)" != 0 ]; then echo "testbed-setup: not root: the testbed tests will skip"; \
	elif command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v tc >/dev/null; then \
	  echo "testbed-setup: slurm-wlm, munge, iproute2 present"; \
	else apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  slurm-wlm munge iproute2 >/dev/null && echo "testbed-setup: installed slurm-wlm munge iproute2"; fi

# 2 hosts at 1 Gbit/s: iteration time and bytes with and without CIERA, bit-identical (root).
demo-cluster: setup-demo
	$(BIN)/python tools/testbed/demo_cluster.py

# The measurement: gather and training on the testbed at 1, 2.5 and 10 Gbit/s (root; ~40 min on 2 cores with
# the native codecs). Writes outputs/bench-cluster/bench_cluster.{md,png}. BENCHMARKS.md's figures: collate.py.
bench-cluster: setup
	$(BIN)/python tools/testbed/bench_cluster.py --autogroup-nice -19 --experts 32 --bucket-size 2000000 \
	  --out-dir outputs/bench-cluster

# The second stack: megatron-core 0.19.2 (needs Python >= 3.12; torch for 3.12 comes from PyPI as its
# default CUDA build, which runs on CPU). Its own venv, stamped like .venv; CI runs its tests from
# .ci/run (`make test-latest`), not from `make test`.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV312 ?= .venv312
TORCH312 ?= 2.14.1
MCORE312 ?= 0.19.2
setup312: $(VENV312)/.installed $(VENV312)/.native

$(VENV312)/.installed: setup.py
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VENV312)/bin/python -m pip install -q torch==$(TORCH312) megatron-core==$(MCORE312)
	$(VENV312)/bin/python -m pip install -q -e '.[triton,dev]'
	$(VENV312)/bin/python -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
	touch $@ $(VENV312)/.native

# The native codecs for Python 3.12 (their own .so beside .venv's), rebuilt when the C source changes.
$(VENV312)/.native: $(NATIVE_SRC) | $(VENV312)/.installed
	@[ -e $@ ] && [ -z "$$(find $(NATIVE_SRC) -newer $@)" ] || { $(VENV312)/bin/python setup.py -q build_ext --inplace && touch $@; }

# The Megatron tests and the library's multi-process ones on the second stack (both run; either failing fails).
test-latest: setup312
	$(VENV312)/bin/python -m pytest -q tests/megatron; a=$$?; \
	$(VENV312)/bin/python -m pytest -q -m distributed tests/ciera; b=$$?; exit $$(( a || b ))

# The codec table in one command: reference vs native (1 and 2 threads) vs ZipNN and zstd,
# wall and CPU clocks, with a verdict line per target.
bench-codec: setup
	$(BIN)/python -m pip install -q -e '.[cpu,triton,dev,peers]'
	$(BIN)/python tools/bench_codec.py --lr 1e-4 --steps 8
