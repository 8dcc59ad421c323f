"""Compatibility matrix: PyTorch 2.9.1 (PyPI, CUDA 12.8, Volta kernels included) on the driver test
double alone and under an 8 GiB slice of a simulated V100 (shim/README.md, "Real CUDA software").

Opt-in (GPUSLICE_TEST_TORCH=1; tests/gpu/run.sh sets it): its wheels are 3.4 GB to download and
6.5 GB unpacked, and importing torch maps a 1 GB libtorch_cuda.so, too much for the default suite on
a 2-core machine. The wheels are cached in ~/.cache/gpuslice/wheels like the other clients'.
"""

from __future__ import annotations

import os

import pytest

from shim.matrix import CLIENTS, GIB, MODES, Holder, Tenant, explain, facts, tenant, torch_env

SCRIPT = str(CLIENTS / "torch_paths.py")

pytestmark = pytest.mark.skipif(
    os.environ.get("GPUSLICE_TEST_TORCH") != "1",
    reason="PyTorch matrix is opt-in (GPUSLICE_TEST_TORCH=1): 3.4 GB of wheels, 1 GB library per process",
)


def test_built_with_volta_kernels(make_slice):
    """torch 2.9.1 from PyPI carries sm_70 code, so a V100 (the simulated model) can run it."""
    t = tenant(make_slice, "double")
    proc = t.run([SCRIPT, "info"], extra_env=torch_env(t), timeout=600)
    assert "sm_70" in facts(proc.stdout)["arch_flags"].split(","), explain(proc)


def _run(t: Tenant, path: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    proc = t.run([SCRIPT, path], extra_env={**torch_env(t), **(extra or {})}, timeout=600)
    assert proc.returncode == 0, explain(proc)
    return facts(proc.stdout)


def _oom(f: dict[str, str], key: str, t: Tenant) -> None:
    assert f[key].startswith("OutOfMemoryError: CUDA out of memory."), f[key]
    assert f"GPU 0 has a total capacity of {t.total / GIB:.2f} GiB" in f[key], f[key]


@pytest.mark.parametrize("mode", MODES)
def test_device_shows_the_slice(make_slice, mode):
    t = tenant(make_slice, mode)
    f = _run(t, "info")
    assert f["available"] == "1"
    assert "sm_70" in f["arch_list"].split(",")  # Volta: the simulated V100 can run it
    assert (f["name"], f["cc"]) == (t.name, "7.0") or t.real
    assert int(f["total_global_mem"]) == t.total
    assert int(f["mem_total"]) == t.total


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"], ids=["caching", "expandable-segments"])
@pytest.mark.parametrize("mode", MODES)
def test_allocation_to_the_edge_then_torch_oom(make_slice, mode, conf):
    t = tenant(make_slice, mode)
    f = _run(t, "edge", {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else None)
    room = t.available(int(f["free_at_start"]))
    # Filled to the edge: what the allocator holds fits, and the next 1 GiB did not. (Expandable
    # segments keep a few MiB mapped beyond the tensors, so their last whole GiB may not fit.)
    reserved = int(f["reserved_at_edge"])
    assert int(f["edge_blocks"]) * GIB <= reserved <= room < reserved + GIB
    _oom(f, "edge_error", t)
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("mode", MODES)
def test_caching_allocator_frees_its_cache_and_retries(make_slice, mode):
    t = tenant(make_slice, mode)
    f = _run(t, "caching")
    room = t.available(int(f["free_at_start"]))
    assert int(f["reserved_held"]) == 6 * GIB
    assert int(f["free_while_held"]) == room - 6 * GIB
    assert f["big_ok"] == "1", f.get("big_error")
    if room >= 9 * GIB:
        assert f["more_ok"] == "1"
    else:
        _oom(f, "more_error", t)
    assert int(f["free_after"]) == room


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_capture_and_replay(make_slice, mode):
    t = tenant(make_slice, mode)
    f = _run(t, "graph")
    assert f["replayed"] == "1"
    assert int(f["free_with_graph"]) <= int(f["free_at_start"]) - GIB
    assert int(f["free_after"]) == t.available(int(f["free_at_start"]))


def test_two_processes_share_the_slice(make_slice):
    t = tenant(make_slice, "slice")
    with Holder(t, [SCRIPT, "hold"], f"held={5 * GIB}", extra_env=torch_env(t)):
        f = _run(t, "second")
    _oom(f, "second_5g", t)
    assert f["second_2g"] == "ok"
