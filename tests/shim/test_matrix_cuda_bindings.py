"""Compatibility matrix: NVIDIA's driver-API Python bindings (`cuda-bindings` 12.9.10 from PyPI, with
the `cuda-pathfinder` 1.9.1 they load libcuda.so.1 through) on the driver test double alone and under
an 8 GiB slice of a simulated V100 on the 535 driver (shim/README.md, "Real CUDA software").

The bindings never link the driver: at their first call they dlopen libcuda.so.1, take
`cuGetProcAddress_v2` from it with dlsym, and ask it for every other entry point by base name and the
CUDA version they were generated against (`cuMemAlloc` at 3020, `cuMemAllocAsync` at 11020), with
`CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` when CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1
(cuda/bindings/_internal/driver_linux.pyx, `_init_driver`). So the shim is reached only through
what its cuGetProcAddress hands out, and the tests check where each pointer the bindings hold leads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import prepare
from gpuslice_dev.wheels import ensure_unpacked
from shim.matrix import CLIENTS, CUDA_BINDINGS, GIB, MODES, Tenant, explain, facts, tenant

pytestmark = pytest.mark.slow(seconds=5)
SCRIPT = str(CLIENTS / "cuda_bindings_paths.py")
PTDS = {"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"}
STREAMS = ["default-stream", "per-thread-stream"]
OOM = "CUDA_ERROR_OUT_OF_MEMORY"


def _run(t: Tenant, extra: dict[str, str] | None = None) -> dict[str, str]:
    path = ":".join(str(ensure_unpacked(name, version)) for name, version in CUDA_BINDINGS)
    proc = t.run([SCRIPT], extra_env={"PYTHONPATH": path, **(extra or {})})
    assert proc.returncode == 0, explain(proc)
    f = facts(proc.stdout)
    errors = {k: v for k, v in f.items() if k.endswith("_error") and not v.startswith("CUDA_ERROR_")}
    assert not errors, f"{errors}\n{explain(proc)}"
    f["_explain"] = explain(proc)
    return f


@pytest.fixture(scope="module")
def runs(
    built: ShimPaths, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, str], tuple[Tenant, dict[str, str]]]]:
    """Every path, once per mode and per default-stream setting of the bindings."""

    def factory(**kwargs: object) -> object:
        kwargs.setdefault("simulate_gpus", "1x Tesla V100-PCIE-32GB")
        kwargs.setdefault("seed", "test-node")
        return prepare(workdir=tmp_path_factory.mktemp("bindings"), built=built, **kwargs)  # type: ignore[arg-type]

    out = {}
    for mode in MODES:
        t = tenant(factory, mode)
        out[mode, STREAMS[0]] = (t, _run(t))
        out[mode, STREAMS[1]] = (t, _run(t, PTDS))
    yield out


@pytest.mark.parametrize("mode", MODES)
def test_device_name_total_and_memory_info(runs, mode):
    t, f = runs[mode, STREAMS[0]]
    assert (f["init"], f["count"]) == ("0", "1"), f["_explain"]
    assert f["name"] == t.name
    assert f["cc"] == "7.0" or t.real
    assert int(f["total_mem"]) == int(f["mem_total"]) == t.total
    assert int(f["mem_free"]) <= t.total if t.real else int(f["mem_free"]) == t.total


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("mode", MODES)
def test_allocation_to_the_edge_then_out_of_memory(runs, mode, stream):
    """cuMemAlloc and cuMemAllocAsync of 1 GiB until the driver's CUDA_ERROR_OUT_OF_MEMORY: 32 alone,
    8 under the slice; a single 9 GiB cuMemAlloc fits the card, not the slice; all given back."""
    t, f = runs[mode, stream]
    room = t.available(int(f["edge_start"]))
    assert (int(f["edge_blocks"]), f["edge_error"]) == (room // GIB, OOM), f["_explain"]
    assert int(f["edge_free_at_edge"]) == room % GIB or t.real
    assert int(f["edge_free_after"]) == int(f["edge_start"])
    async_room = t.available(int(f["async_edge_start"]))
    assert (int(f["async_edge_blocks"]), f["async_edge_error"]) == (async_room // GIB, OOM)
    assert int(f["async_edge_free_after"]) == int(f["async_edge_start"])
    if room >= 10 * GIB:
        assert f["oversize"] == "ok"
    else:
        assert f["oversize_error"] == OOM


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("mode", MODES)
def test_every_pointer_the_bindings_hold_is_what_cu_get_proc_address_handed_out(runs, mode, stream):
    """Under the slice each entry point the bindings call is the shim's wrapper of the variant the
    driver serves for their request (the `_ptsz` one in per-thread-stream mode); alone, code in the
    driver."""
    t, f = runs[mode, stream]
    asynchronous = "cuMemAllocAsync_ptsz" if stream == STREAMS[1] else "cuMemAllocAsync"
    want = {
        "cuMemAlloc_v2": "cuMemAlloc_v2",
        "cuMemGetInfo_v2": "cuMemGetInfo_v2",
        "cuDeviceTotalMem_v2": "cuDeviceTotalMem_v2",
        "cuMemAllocAsync": asynchronous,
        "cuGetProcAddress_v2": "cuGetProcAddress_v2",
    }
    held = {name: f[f"lib_{name}"] for name in want}
    asked = [f["asked_cuMemAllocAsync_default"], f["asked_cuMemAllocAsync_ptds"]]
    if t.shim:
        assert held == {name: f"libgpuslice.so:{symbol}" for name, symbol in want.items()}
        assert asked == [
            "libgpuslice.so:cuMemAllocAsync CU_GET_PROC_ADDRESS_SUCCESS",
            "libgpuslice.so:cuMemAllocAsync_ptsz CU_GET_PROC_ADDRESS_SUCCESS",
        ]
    else:  # the driver (and the double) hands out its internal functions, not its exported names
        assert all(v.startswith("libcuda.so") for v in held.values()), held
        assert all(v.startswith("libcuda.so") for v in asked), asked
        assert all(v.endswith(" CU_GET_PROC_ADDRESS_SUCCESS") for v in asked), asked
