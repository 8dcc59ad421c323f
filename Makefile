# The two front-door commands (see README.md):
#   make demo  - install, build and run the whole product locally (devcluster + simulated GPUs)
#   make test  - install, build and run lint, type checks and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck pytest shim clean

$(BIN)/gpuslice: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/gpuslice

shim: install
	$(MAKE) -C shim

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
	rm -rf $(VENV) shim/build .mypy_cache .ruff_cache .pytest_cache
