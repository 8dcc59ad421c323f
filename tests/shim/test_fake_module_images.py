"""cuModuleLoadFatBinary on the driver double takes what the driver takes there: any image
cuModuleLoadData takes (the driver looks at the image, not at the name of the call), which XLA relies
on: it loads every kernel it compiles, a plain cubin from ptxas, with cuModuleLoadFatBinary ("Failed
to load in-memory CUBIN" when that fails). Through ctypes, alone and under an 8 GiB slice, where a
module's variables are charged whichever call loaded it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_dev.gpusim import kernels
from shim.shim_helpers import GIB, env_of, values

CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_IMAGE = 0, 2, 200
PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .entry touch()
{
\tret;
}
"""
#: a module whose one variable is a 3 GiB __device__ array (ptxas writes a section's size in 32 bits)
BIG_PTX = PTX.replace(b".visible .entry", b".visible .global .align 8 .b8 big[3221225472];\n.visible .entry")
CLIENT = r"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
cu.cuCtxSetCurrent(ctx)
for path in sys.argv[1:]:
    image = ctypes.create_string_buffer(open(path, "rb").read() + b"\0")
    mod, fn, held = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    name = path.rsplit("/", 1)[-1]
    rc = cu.cuModuleLoadFatBinary(ctypes.byref(mod), image)
    print(f"{name}={rc}")
    if rc == 0:
        print(f"{name}_function={cu.cuModuleGetFunction(ctypes.byref(fn), mod, b'touch')}")
        print(f"{name}_then_6GiB={cu.cuMemAlloc_v2(ctypes.byref(held), ctypes.c_size_t(6 << 30))}")
        if held.value:
            cu.cuMemFree_v2(held)
        cu.cuModuleUnload(mod)
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("images")
    cubin = kernels.assemble(PTX, "sm_70")
    built = {
        "ptx": PTX,
        "cubin": cubin,
        "fatbin": kernels.fatbin([kernels.Entry(kernels.KIND_CUBIN, 70, cubin)]),
        "big-cubin": kernels.assemble(BIG_PTX, "sm_70"),
        "garbage": b"not a kernel image" * 8,
    }
    for name, data in built.items():
        (out / name).write_bytes(data)
    return [out / name for name in built]


@pytest.mark.parametrize("memory", [None, 8 * GIB], ids=["alone", "slice-8GiB"])
def test_cu_module_load_fat_binary_takes_a_cubin_ptx_or_fatbin(make_slice, images, memory):
    s = make_slice(memory_bytes=memory)
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, *map(str, images)], env=env_of(s, shim=memory is not None),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    v = values(proc.stdout)
    for kind in ("ptx", "cubin", "fatbin", "big-cubin"):
        assert (v[kind], v[f"{kind}_function"]) == ("0", "0"), (kind, proc.stdout)
    assert v["garbage"] == str(CUDA_ERROR_INVALID_IMAGE)
    # the 3 GiB variable of a cubin loaded this way is the slice's: 6 GiB more does not fit beside it
    assert v["cubin_then_6GiB"] == "0"
    assert v["big-cubin_then_6GiB"] == str(CUDA_ERROR_OUT_OF_MEMORY if memory else CUDA_SUCCESS)
