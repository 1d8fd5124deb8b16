# specserve: two commands on a fresh Linux or macOS machine.
#   make serve   set up .venv, fetch the default model, serve it on 127.0.0.1:8000
#   make test    set up .venv with the dev tools and run lint, layer contracts and all tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UNAME := $(shell uname -s)
EXTRAS ?= dev
# MLX backend extra on Linux: cuda where an NVIDIA driver answers, else cpu (macOS: Metal, none).
ifeq ($(UNAME),Linux)
BACKEND ?= $(if $(shell nvidia-smi -L 2>/dev/null),cuda,cpu)
INSTALL_EXTRAS := $(EXTRAS),$(BACKEND)
SERVE_SPEC := .[$(BACKEND)]
else
INSTALL_EXTRAS := $(EXTRAS)
SERVE_SPEC := .
endif

.PHONY: setup serve test test-tools lint unit bench clean

# $(call install,<pip requirement>): the venv, the package (editable) and, on Linux, OpenBLAS.
define install
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is required"'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '$(1)'
	$(if $(filter Linux,$(UNAME)),@sh deploy/install-openblas.sh $(PY))
	@touch $@
endef

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(call install,.[$(INSTALL_EXTRAS)])

# serving needs only the runtime dependencies (and the MLX backend)
$(VENV)/.installed-serve: pyproject.toml
	$(call install,$(SERVE_SPEC))

setup: $(VENV)/.installed-$(EXTRAS)

# make serve PORT=8123 (or SPECSERVE_PORT / SPECSERVE_HOST in the environment). Plain `=`, not
# `?=`: a HOST or PORT the shell or a container exports for its own ends does not reach here.
HOST = $(or $(SPECSERVE_HOST),127.0.0.1)
PORT = $(or $(SPECSERVE_PORT),8000)
serve: $(VENV)/.installed-serve
	$(VENV)/bin/specserve --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check server engine drafters metal_kernels benchmarks tests
	$(VENV)/bin/lint-imports

# Prometheus, promtool and Docker Compose for the deploy tests (tests/test_deploy_*.py).
test-tools: $(VENV)/.installed-dev
	@sh deploy/install-test-tools.sh $(VENV)

# Two workers: most of a test's time on a small CPU is MLX waiting on thread hand-offs, which
# the other worker fills (a 2-vCPU AVX2 VM: 27.9 min of pytest serial, 19.1 with two workers).
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev test-tools lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

unit: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not model and not slow"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
