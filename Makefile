# The two front-door commands (see README.md):
#   make demo  - install, build and run the whole product locally (devcluster + simulated GPUs)
#   make test  - install, build and run lint, type checks and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck pytest shim image clean debian-packages test-versions

# --- Kubernetes versions (README "Kubernetes versions") -------------------------------------------
# The minor the devcluster, the demo and the suite run: 1.35, 1.36 or 1.37 (`make test KUBERNETES=1.36`).
# Every devcluster the suite starts reads it from GPUSLICE_KUBERNETES; each minor's binaries are
# built once and cached beside the others. `make test-versions` runs VERSIONS_TESTS on each of
# TEST_VERSIONS, one minor after the other (the default `make test` stays on 1.37).
KUBERNETES ?= $(or $(GPUSLICE_KUBERNETES),1.37)
export GPUSLICE_KUBERNETES := $(KUBERNETES)
TEST_VERSIONS ?= 1.35 1.36
VERSIONS_TESTS ?= tests/devcluster/test_control_plane.py tests/cli/test_check.py \
	tests/operator/test_versions_cluster.py tests/agent/test_agent_e2e.py \
	tests/operator/test_isolation_cluster.py tests/node/test_real_node.py \
	tests/node/test_gpu_health_node.py tests/node/test_product_limits_node.py
test-versions: install shim
	@for v in $(TEST_VERSIONS); do \
	  echo "=== Kubernetes $$v"; start=$$(date +%s); \
	  GPUSLICE_KUBERNETES=$$v $(BIN)/gpuslice-dev devcluster build --with-node || exit 1; \
	  GPUSLICE_KUBERNETES=$$v $(BIN)/pytest -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	    $(VERSIONS_TESTS) $(PYTEST_ARGS) || failed="$$failed $$v"; \
	  echo "=== Kubernetes $$v: $$(( $$(date +%s) - start )) s"; \
	done; test -z "$$failed" || { echo "failed on Kubernetes:$$failed"; exit 1; }
# --- end Kubernetes versions ----------------------------------------------------------------------

# Debian packages real nodes need: libseccomp-dev to build runc with seccomp, busybox-static for the
# probe image, mmdebstrap for the product image; clang with libFuzzer for `make -C shim fuzz`.
# Installed with apt-get when missing (as root: CI and the demo machine are root).
DEBIAN_PACKAGES := libseccomp-dev busybox-static mmdebstrap clang-14 libclang-rt-14-dev
debian-packages:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages: $$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null || \
	      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; \
	  else echo "missing Debian packages (real nodes need them): sudo apt-get install $$missing" >&2; exit 1; fi; \
	fi

# The product (editable, with its dev extras) and, beside it, the dev tooling's own distribution
# (devtools/: devcluster, demo, GPU simulator, image builder; console script gpuslice-dev).
$(BIN)/gpuslice-dev: pyproject.toml devtools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' -e ./devtools
	touch $@

install: $(BIN)/gpuslice-dev debian-packages

shim: install
	$(MAKE) -C shim

# The product image without a Docker engine (root: mmdebstrap + chroot; cached by content), the
# same image as the Dockerfile's. Load it into the devcluster's real nodes with
# `gpuslice-dev devcluster load-image build/gpuslice-image.oci.tar`.
image: install shim
	$(BIN)/python -m gpuslice_dev.image --output build/gpuslice-image.oci.tar

demo: install shim
	$(BIN)/gpuslice-dev demo

lint: install
	$(BIN)/ruff check operator devtools tests bench
	$(BIN)/ruff format --check operator devtools tests bench

typecheck: install
	$(BIN)/mypy

# Test files are spread over PYTEST_WORKERS processes (pytest-xdist), each file's tests in one of them
# (they share its clusters); each worker starts its own devcluster. Files go out longest first, in the
# order tests/conftest.py sorts them (--no-loadscope-reorder: xdist would otherwise send files with
# many tests first and the long single-test files last). Four workers on two cores: most of the suite
# waits on clusters, and one worker spends about 6 minutes in the API server outage file, mostly
# asleep, while the other three share the rest. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 4
pytest: install shim
	$(BIN)/gpuslice-dev devcluster build --with-node
	$(BIN)/pytest -ra --durations=15 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build shim/build .mypy_cache .ruff_cache .pytest_cache
