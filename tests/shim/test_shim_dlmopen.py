"""A second copy of the driver in one process: dlmopen(LM_ID_NEWLM, "libcuda.so.1") and every entry
point by dlsym on that handle (tests/shim/clients/dlmopen_client.py), on the driver double alone and
under an 8 GiB slice.

The double serves such a copy as the driver does: each copy has its own state (its globals are the
library's own, not the process's), so alone the copy initializes, creates a context and allocates
on its own. Under the shim, dlsym is the shim's: it hands out its wrappers, which call the driver it
enforces over, for the names it wraps, and the copy's own functions for the others; the copy's
cuInit and cuDeviceGet then initialized the copy while cuCtxCreate_v2 went to the shim's driver,
never initialized (CUDA_ERROR_NOT_INITIALIZED), on a real driver as on the double. The shim now
answers every entry point of another driver copy from its own driver: one driver, enforced.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shim.shim_helpers import GIB, env_of, values

CLIENT = Path(__file__).parent / "clients" / "dlmopen_client.py"
CALLS = ["cuInit", "cuDeviceGet", "cuCtxCreate_v2", "cuMemGetInfo_v2", "cuCtxDestroy_v2"]


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_a_driver_copy_opened_with_dlmopen_works_and_under_a_slice_is_the_slice(make_slice, memory):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, str(CLIENT)], env=env_of(s, shim=memory is not None),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    assert v["dlmopen"] == "ok"
    assert {c: v[c] for c in CALLS} == dict.fromkeys(CALLS, "0"), proc.stdout
    if memory is None:
        assert (int(v["total"]), v["alloc_9GiB"], v["alloc_1GiB"]) == (32 * GIB, "0", "0")
    else:  # the slice's 8 GiB, its edge, every call through the shim's wrappers or its own driver
        assert (int(v["total"]), v["alloc_9GiB"], v["alloc_1GiB"]) == (memory, "2", "0")
        assert v["lib_cuMemAlloc_v2"] == v["lib_cuCtxCreate_v2"] == "libgpuslice.so"
