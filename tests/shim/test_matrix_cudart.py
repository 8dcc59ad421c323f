"""Compatibility matrix: NVIDIA's CUDA runtime (libcudart 12.9 and 13.0 from the PyPI wheels) on the
driver test double alone and under an 8 GiB slice of a simulated V100 (shim/README.md, "Real CUDA
software"). 13.0 runs on a simulated 580 driver, the first that starts it; on the default 535 driver
it must be refused as a real 535 refuses it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpuslice_dev.gpusim.cudart import build_program
from gpuslice_dev.paths import SHIM_SOURCE_DIR
from shim.matrix import (
    CLIENTS,
    DRIVER_FOR,
    GIB,
    MODES,
    REAL_GPU,
    Holder,
    Tenant,
    cudart,
    explain,
    facts,
    tenant,
)

SCRIPT = str(CLIENTS / "cudart_paths.py")
RUNTIMES = [12, 13]


def _tenant(make_slice, mode: str, major: int) -> Tenant:
    return tenant(make_slice, mode, DRIVER_FOR[major])


def _run(t: Tenant, major: int, path: str) -> dict[str, str]:
    proc = t.run([SCRIPT, str(cudart(major)), path])
    assert proc.returncode == 0, explain(proc)
    return facts(proc.stdout)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_device_shows_the_slice(make_slice, mode, major):
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, "info")
    assert f["name"] == t.name
    assert int(f["total_global_mem"]) == t.total
    assert int(f["mem_total"]) == t.total
    assert int(f["mem_free"]) <= t.total if t.real else int(f["mem_free"]) == t.total


@pytest.fixture(scope="module")
def c_program(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """shim/tests/cudart_probe.c, the C tenant built against each runtime wheel (no CUDA toolkit)."""
    out = tmp_path_factory.mktemp("cprog")
    source = SHIM_SOURCE_DIR / "tests" / "cudart_probe.c"
    return {major: build_program(source, str(major), out / f"cudart_probe{major}") for major in RUNTIMES}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_c_program_sees_the_slice(make_slice, c_program, mode, major):
    """A C program linked against the wheel's libcudart: cudaGetDeviceProperties and cudaMemGetInfo."""
    t = _tenant(make_slice, mode, major)
    proc = subprocess.run(
        [str(c_program[major]), "props"],
        env=t.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, explain(proc)
    f = facts(proc.stdout)
    assert f["name"] == t.name
    assert (int(f["total"]), int(f["mem_total"])) == (t.total, t.total)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_cuda_malloc_to_the_edge(make_slice, mode, major):
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, "edge")
    room = t.available(int(f["free_at_start"]))
    assert (int(f["edge_blocks"]), f["edge_error"]) == (room // GIB, "cudaErrorMemoryAllocation")
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_stream_ordered_pool(make_slice, mode, major):
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, "pool")
    room = t.available(int(f["free_at_start"]))
    assert (int(f["edge_blocks"]), f["edge_error"]) == (room // GIB, "cudaErrorMemoryAllocation")
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_managed_memory(make_slice, mode, major):
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, "managed")
    room = t.available(int(f["free_at_start"]))
    assert (int(f["edge_blocks"]), f["edge_error"]) == (room // GIB, "cudaErrorMemoryAllocation")
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("instantiate", ["graph", "graph-params"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_graph_memory_node_is_charged(make_slice, mode, major, instantiate):
    """cudaGraphInstantiate and cudaGraphInstantiateWithParams: a launched 6 GiB memory node holds its
    memory, so 6 GiB more does not fit an 8 GiB slice (and does on the whole card)."""
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, instantiate)
    assert f["launch_error"] == "cudaSuccess"
    room = t.available(int(f["free_at_start"]))
    assert f["beside_error"] == ("cudaSuccess" if room >= 12 * GIB else "cudaErrorMemoryAllocation")
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("how", ["graph-node", "graph-child"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_a_memory_node_added_by_the_generic_api_or_in_a_moved_child_graph_is_charged(
    make_slice, mode, major, how
):
    """cudaGraphAddNode (the generic node API) and a child graph moved into its parent carry a 6 GiB
    memory node as cudaGraphAddMemAllocNode does: once launched, 6 GiB more does not fit an 8 GiB slice.
    A graph with memory nodes cannot be cloned in, and once moved it is the parent's."""
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, how)
    assert f["launch_error"] == "cudaSuccess"
    if how == "graph-node":
        assert f["node_dptr_set"] == "True"
    else:
        assert f["clone_with_memory_error"] != "cudaSuccess"
        assert f["moved_child_destroy_error"] != "cudaSuccess"
    room = t.available(int(f["free_at_start"]))
    assert f["beside_error"] == ("cudaSuccess" if room >= 12 * GIB else "cudaErrorMemoryAllocation")
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("major", RUNTIMES)
def test_device_reset_returns_the_memory(make_slice, mode, major):
    t = _tenant(make_slice, mode, major)
    f = _run(t, major, "reset")
    room = t.available(int(f["free_at_start"]))
    assert f["alloc_rc"] == "0"
    assert int(f["free_before_reset"]) == room - 6 * GIB
    assert int(f["free_after_reset"]) == room
    assert f["realloc_rc"] == "0"


@pytest.mark.parametrize("major", RUNTIMES)
def test_two_processes_share_the_slice(make_slice, major):
    t = _tenant(make_slice, "slice", major)
    with Holder(t, [SCRIPT, str(cudart(major)), "hold"], "held_rc=0"):
        f = _run(t, major, "second")
    assert f["second_5g_rc"] == "2"  # 5 + 5 GiB > 8 GiB: cudaErrorMemoryAllocation
    assert f["second_2g_rc"] == "0"
    assert int(f["mem_free"]) == 1 * GIB  # 8 - its own 2 - the holder's 5: one slice for both


@pytest.mark.skipif(REAL_GPU, reason="the double's 535 driver; a real GPU has the driver it has")
def test_cuda13_runtime_refused_by_a_535_driver(make_slice):
    t = tenant(make_slice, "slice", "535")
    proc = t.run([SCRIPT, str(cudart(13)), "info"])
    assert proc.returncode == 1
    assert facts(proc.stdout)["error"] == "cudaGetDeviceCount 35 cudaErrorInsufficientDriver"
