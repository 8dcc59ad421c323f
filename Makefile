# The two front-door commands (see README.md):
#   make demo  - install, build and run the whole product locally (devcluster + simulated GPUs)
#   make test  - install, build and run lint, type checks and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck pytest shim image clean

$(BIN)/gpuslice: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/gpuslice

shim: install
	$(MAKE) -C shim

# The product image without a Docker engine (root: mmdebstrap + chroot; cached by content), the
# same image as the Dockerfile's. Load it into the devcluster's real nodes with
# `gpuslice devcluster load-image build/gpuslice-image.oci.tar`.
image: install shim
	$(BIN)/python -m gpuslice.dev.image --output build/gpuslice-image.oci.tar

demo: install shim
	$(BIN)/gpuslice demo

lint: install
	$(BIN)/ruff check operator tests
	$(BIN)/ruff format --check operator tests

typecheck: install
	$(BIN)/mypy

pytest: install shim
	$(BIN)/gpuslice devcluster build
	$(BIN)/pytest -ra --durations=15 $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build shim/build .mypy_cache .ruff_cache .pytest_cache
