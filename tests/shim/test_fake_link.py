"""The double's JIT linker, profiler control and module listing, called through ctypes as a client of the
driver API calls them, on the double alone and under an 8 GiB slice (kernels are not executed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "link_client.py"


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_linked_ptx_loads_lists_its_kernels_and_their_parameters(make_slice, memory):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT)], env=env_of(s, shim=memory is not None), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    calls = [
        "init", "ctx", "profiler_start", "profiler_stop", "link_create", "link_add_data", "link_add_file",
        "link_complete", "module_load", "library_load", "link_destroy", "function_count_rc", "enumerate",
        "get_function", "launch", "sync", "kernel_count_rc", "enumerate_kernels", "mem_info",
    ]  # fmt: skip
    assert {c: v[c] for c in calls} == dict.fromkeys(calls, "0"), proc.stdout
    assert v["function_count"] == "2" and v["functions"] == "first,second"
    assert v["kernel_count"] == "2"
    # .u64 at 0, .u32 at 8, 24 bytes aligned to 8 at 16; a fourth parameter is CUDA_ERROR_INVALID_VALUE
    assert v["params"] == "0:0:8,0:8:4,0:16:24,1"
    assert v["kernel_param0"] == "0:0:8"
    if memory is not None:
        assert int(v["total"]) == memory  # the slice, as the shim reports it
