# The two front-door commands (see README.md):
#   make demo  - install, build and run the whole product locally (devcluster + simulated GPUs)
#   make test  - install, build and run lint, type checks and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck pytest shim image clean debian-packages test-versions

# --- Kubernetes versions (README "Kubernetes versions") -------------------------------------------
# The minor the devcluster, the demo and the suite run: 1.35, 1.36 or 1.37 (`make test KUBERNETES=1.36`).
# Every devcluster the suite starts reads it from GPUSLICE_KUBERNETES (and extra feature gates from
# GPUSLICE_FEATURE_GATES); each minor's binaries are built once and cached beside the others.
# `make test-versions` (the version job; the default `make test` stays on 1.37) runs, one after the other:
#   1.35 with its default gates: what gpuslice says and refuses there (VERSIONS_CHECKS);
#   1.35 with its alpha DRA gates turned on (a self-managed platform; VERSIONS_135_GATES) and 1.36:
#   the subset VERSIONS_TESTS (allocation, quota, admission policies, the real node's slice pod,
#   health, resources.limits where served).
KUBERNETES ?= $(or $(GPUSLICE_KUBERNETES),1.37)
export GPUSLICE_KUBERNETES := $(KUBERNETES)
VERSIONS_CHECKS ?= tests/cli/test_check.py tests/operator/test_versions_cluster.py tests/devcluster/test_control_plane.py
VERSIONS_TESTS ?= $(VERSIONS_CHECKS) tests/agent/test_agent_e2e.py tests/operator/test_isolation_cluster.py \
	tests/node/test_real_node.py tests/node/test_gpu_health_node.py tests/node/test_product_limits_node.py \
	tests/agent/test_agent_mig_cluster.py tests/operator/test_multigpu_cluster.py
VERSIONS_135_GATES ?= DRAPartitionableDevices=true,DRADeviceTaints=true,DRAExtendedResource=true
VERSIONS_WORKERS ?= $(PYTEST_WORKERS)
NO_GATES :=
# $(1) minor, $(2) the name of a variable holding extra gates, $(3) test files; appends to build/test-versions.txt
define versions_run
	@echo "=== Kubernetes $(1) $(if $($(2)),with $($(2)),with its default gates)"; start=$$(date +%s); \
	GPUSLICE_KUBERNETES=$(1) $(BIN)/gpuslice-dev devcluster build --with-node >/dev/null && \
	GPUSLICE_KUBERNETES=$(1) GPUSLICE_FEATURE_GATES=$($(2)) $(BIN)/pytest -ra -n $(VERSIONS_WORKERS) \
	  --dist loadfile --no-loadscope-reorder $(3) $(PYTEST_ARGS); rc=$$?; \
	line="Kubernetes $(1) $(if $($(2)),+$($(2)),defaults): $$([ $$rc = 0 ] && echo pass || echo FAIL) in $$(( $$(date +%s) - start )) s"; \
	echo "=== $$line"; echo "$$line" >> build/test-versions.txt
endef
test-versions: install shim
	@mkdir -p build && : > build/test-versions.txt
	$(call versions_run,1.35,NO_GATES,$(VERSIONS_CHECKS))
	$(call versions_run,1.35,VERSIONS_135_GATES,$(VERSIONS_TESTS))
	$(call versions_run,1.36,NO_GATES,$(VERSIONS_TESTS))
	@cat build/test-versions.txt; ! grep -q FAIL build/test-versions.txt
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
	$(BIN)/python tests/shim/fetch_wheels.py
	$(BIN)/pytest -ra --durations=15 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build shim/build .mypy_cache .ruff_cache .pytest_cache
