"""Compatibility matrix: JAX 0.10.2 with its CUDA 12 plugin (`pip install "jax[cuda12]"`, PyPI) on the
driver test double alone and under an 8 GiB slice of a simulated V100 (shim/README.md, "Real CUDA
software").

JAX sizes itself from the card: its CUDA backend's allocator may use 75 % of the total memory the
driver reports (XLA_PYTHON_CLIENT_MEM_FRACTION), and by default takes all of it at the first
allocation. So under the slice it must see 8 GiB and take 6. With XLA_PYTHON_CLIENT_PREALLOCATE=false
it takes memory as arrays need it, up to the same limit; with XLA_PYTHON_CLIENT_ALLOCATOR=platform
it allocates each buffer from the driver with no limit of its own, so the slice's edge is the one it
meets. Each edge ends in JAX's own RESOURCE_EXHAUSTED.

JAX starts its CUDA backend only where /dev/nvidiactl or /dev/nvidia0 exists (jax/_src/
hardware_utils.py): each client runs where /dev has the card's device nodes, as in a slice
container (matrix.container_dev). The backend's start and the import are the cost, and its
allocator is chosen once from the environment: one long-lived client per mode and allocator setting,
all started at once, and each path sent to all of them at once (XLA waits up to 10 s for memory to
be freed before it gives up on an allocation). The double does not execute XLA's kernels: memory,
JAX's figures and its errors are judged, never computed values.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest

from gpuslice_dev.devcluster.images import probe_binary
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import prepare
from shim.matrix import (
    CLIENTS,
    GIB,
    JAX,
    MODES,
    REAL_GPU,
    Server,
    Tenant,
    container_dev,
    jax_env,
    site_packages,
    tenant,
)

pytestmark = [
    pytest.mark.slow(seconds=90),  # six JAX processes start at once: 35 to 140 s on 2 loaded cores
    pytest.mark.skipif(not REAL_GPU and shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
]
SCRIPT = str(CLIENTS / "jax_paths.py")
ALLOCATORS = {
    "preallocate": {},
    "no-preallocate": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
}
RESOURCE_EXHAUSTED = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."

Clients = dict[tuple[str, str], Server]


@pytest.fixture(scope="module")
def clients(built: ShimPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    """One JAX process per mode and allocator setting, each in a slice of its own."""
    site = site_packages(JAX, tmp_path_factory.mktemp("jax-site"))
    servers: Clients = {}

    def factory(**kwargs: object) -> object:
        kwargs.setdefault("simulate_gpus", "1x Tesla V100-PCIE-32GB")
        kwargs.setdefault("seed", "test-node")
        return prepare(workdir=tmp_path_factory.mktemp("jax"), built=built, **kwargs)  # type: ignore[arg-type]

    try:
        for mode in MODES:
            for allocator, env in ALLOCATORS.items():
                t = container_dev(tenant(factory, mode), tmp_path_factory.mktemp("jax-dev"))
                servers[mode, allocator] = Server(t, [SCRIPT], extra_env={**jax_env(t, site), **env})
        yield servers
    finally:
        for server in servers.values():
            server.close()


def _all(clients: Clients, path: str) -> dict[tuple[str, str], dict[str, str]]:
    for server in clients.values():
        server.send(path)
    return {key: server.receive(path) for key, server in clients.items()}


@pytest.fixture(scope="module")
def started(clients: Clients) -> dict[tuple[str, str], dict[str, str]]:
    return _all(clients, "info")


@pytest.fixture(scope="module")
def edges(clients: Clients, started, first_arrays) -> dict[tuple[str, str], dict[str, str]]:
    return _all(clients, "edge")


@pytest.fixture(scope="module")
def first_arrays(clients: Clients, started) -> dict[tuple[str, str], dict[str, str]]:
    return _all(clients, "fits")


def _limit(t: Tenant) -> int:
    """What JAX's pool may use: XLA_PYTHON_CLIENT_MEM_FRACTION (0.75) of the total it is shown, as
    XLA computes it (a double, truncated)."""
    return int(t.total * 0.75)


def _probe(t: Tenant, built: ShimPaths, *sizes: int) -> list[str]:
    """What gpuslice-probe gets beside the client in its slice: each cuMemAlloc's result name."""
    proc = subprocess.run(
        [str(probe_binary(built)), "alloc", *map(str, sizes)],
        env=t.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [line.rsplit(" ", 1)[-1] for line in proc.stdout.splitlines() if line.startswith("cuMemAlloc(")]


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("mode", MODES)
def test_the_cuda_backend_starts_and_sizes_itself_from_the_slice(clients, started, mode, allocator):
    t, f = clients[mode, allocator].tenant, started[mode, allocator]
    assert (f["platform"], f["count"], f["name"]) == ("gpu", "1", t.name)
    assert f["cc"] == "7.0" or t.real
    limit = t.total if allocator == "platform" else _limit(t)
    assert int(f["bytes_limit"]) == limit
    assert int(f["pool_bytes"]) == 0  # nothing taken before the first array


@pytest.mark.parametrize("mode", MODES)
def test_default_preallocation_takes_three_quarters_of_the_slice_at_the_first_array(
    clients, first_arrays, built, mode
):
    """The first array makes JAX take its whole pool, 75 % of what it is shown (6 of the slice's 8
    GiB, 24 of the card's 32), and the slice counts it: beside it a process gets 1 GiB less than
    the rest, not the rest. The array fits and goes back to the pool."""
    t, f = clients[mode, "preallocate"].tenant, first_arrays[mode, "preallocate"]
    limit = _limit(t)
    assert int(f["fits_pool"]) == limit
    assert int(f["fits_in_use"]) >= int(f["fits"]) * GIB == limit // 2
    assert int(f["fits_in_use_after"]) == 0
    if not t.real:
        assert _probe(t, built, t.total - limit, t.total - limit - GIB) == [
            "CUDA_ERROR_OUT_OF_MEMORY",
            "CUDA_SUCCESS",
        ]


@pytest.mark.parametrize("mode", MODES)
def test_without_preallocation_jax_takes_what_its_arrays_need(clients, first_arrays, built, mode):
    t, f = clients[mode, "no-preallocate"].tenant, first_arrays[mode, "no-preallocate"]
    limit = _limit(t)
    # the pool grows by regions (doubling) as arrays need them, short of JAX's limit
    assert int(f["fits"]) * GIB <= int(f["fits_pool"]) < limit
    if not t.real:  # what the pool holds and the process's own buffers, no more
        assert _probe(t, built, t.total - int(f["fits_pool"]) - GIB) == ["CUDA_SUCCESS"]


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("mode", MODES)
def test_allocation_to_the_edge_then_jax_resource_exhausted(clients, edges, mode, allocator):
    """1 GiB arrays until JAX's RESOURCE_EXHAUSTED: at its own limit (75 % of what it is shown) with
    its pool, at the slice's (or the card's) edge with the platform allocator, where the shim's
    CUDA_ERROR_OUT_OF_MEMORY is what JAX reports; all given back."""
    t, f = clients[mode, allocator].tenant, edges[mode, allocator]
    assert f["edge_error"].startswith(RESOURCE_EXHAUSTED), f["edge_error"]
    in_use = int(f["edge_in_use"])
    assert in_use >= int(f["edge_blocks"]) * GIB
    if allocator == "platform":
        # what the platform allocator got from the driver: the arrays and XLA's own buffers (a few
        # hundred MiB); the next GiB did not fit
        taken = int(f["edge_pool"])
        assert t.real or taken <= t.total < taken + GIB
    else:  # the next GiB, with the few bytes XLA's program takes beside it, did not fit the pool
        assert in_use <= _limit(t) <= in_use + GIB
    assert int(f["edge_in_use_after"]) == 0
