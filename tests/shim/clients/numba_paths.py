"""A numba-cuda tenant (numba-cuda from its PyPI wheel, NVVM and libdevice from the nvcc wheel,
NVIDIA's driver bindings), every path in one process (numba's import and first compile are the cost).

    python numba_paths.py LINKED_PTX

Prints `key=value` facts for the test to judge; numba's own exceptions are reported by type and
message (`oversize_error=CudaAPIError: ...`). Kernels are compiled, linked, loaded and launched;
the double does not execute them, so their results are never read back as facts.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import sys
import traceback
from collections.abc import Callable

# What the wheel's `_numba_cuda_redirector.pth` does at start-up when it is installed into
# site-packages (numba.cuda is then numba-cuda's, not numba's own deprecated target); the unpacked
# wheels on PYTHONPATH are not a site directory, so the client does it.
import _numba_cuda_redirector  # noqa: F401
import numpy as np
from numba import cuda

GIB = 1 << 30


def info() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = cuda.detect()
    text = out.getvalue()
    print(f"detect={ok}\ndetect_supported={'1/1 devices are supported' in text}")
    devices = [line for line in text.splitlines() if line.startswith("id ")]  # "id 0    NAME   [SUPPORTED]"
    names = [line.split(None, 2)[2].split("[")[0].strip() for line in devices]
    print(f"detect_names={','.join(names)}\nimplementation={cuda.implementation}")
    free, total = cuda.current_context().get_memory_info()
    cc = ".".join(map(str, cuda.get_current_device().compute_capability))
    print(f"mem_free={free}\nmem_total={total}\ncc={cc}")


def arrays() -> None:
    ctx = cuda.current_context()
    start = ctx.get_memory_info()[0]
    a = cuda.device_array(GIB, dtype=np.uint8)
    print(f"one_gib_free={ctx.get_memory_info()[0]}\none_gib_start={start}")
    try:
        b = cuda.device_array(9 * GIB, dtype=np.uint8)
        print(f"oversize=ok {b.size}")
        del b
    except Exception as exc:  # numba's own error, reported as it is
        print(f"oversize_error={type(exc).__name__}: {exc}")
    del a
    _flush()
    print(f"arrays_free_after={ctx.get_memory_info()[0]}")


def _flush() -> None:
    """numba frees device memory lazily (a queue flushed past a count or size): flush it now."""
    gc.collect()
    cuda.current_context().memory_manager.deallocations.clear()


def jit() -> None:
    @cuda.jit
    def double_it(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = 2 * x[i]

    x = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
    double_it[(1 << 20) // 256, 256](x)
    cuda.synchronize()
    print(f"jit=ok\njit_ptx_version={_ptx_version(double_it)}")


def _ptx_version(dispatcher) -> str:
    ptx = next(iter(dispatcher.inspect_asm().values()))
    return next(line.split()[1] for line in ptx.splitlines() if line.startswith(".version"))


def link(ptx_file: str) -> None:
    """A kernel calling a device function from an external PTX file, linked at run time (`link=`)."""
    twice = cuda.declare_device("twice", "int32(int32)", link=[ptx_file])

    @cuda.jit
    def call_twice(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = twice(x[i])

    x = cuda.to_device(np.arange(4096, dtype=np.int32))
    call_twice[16, 256](x)
    cuda.synchronize()
    print("link=ok")


def bindings_link(ptx_file: str) -> None:
    """The driver's JIT linker through NVIDIA's bindings, as a launch wrapper drives it: a kernel's PTX
    (numba-compiled, calling the external function) and the external PTX file, linked, loaded, launched."""
    from cuda.bindings import driver

    def ok(result, what: str):
        err, *rest = result if isinstance(result, tuple) else (result,)
        print(f"{what}={int(err)}")
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return rest[0] if len(rest) == 1 else rest

    twice = cuda.declare_device("twice", "int32(int32)")

    def call_twice(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = twice(x[i])

    ptx, _ = cuda.compile_ptx_for_current_device(call_twice, "void(int32[::1])")
    name = next(line.split()[2].split("(")[0] for line in ptx.splitlines() if ".entry" in line)
    cuda.current_context()  # numba's primary context current on this thread
    state = ok(driver.cuLinkCreate(0, [], []), "cu_link_create")
    data = ptx.encode()
    ptx_input = driver.CUjitInputType.CU_JIT_INPUT_PTX
    added = driver.cuLinkAddData(state, ptx_input, data, len(data) + 1, b"kernel.ptx", 0, [], [])
    ok(added, "cu_link_add_data")
    ok(driver.cuLinkAddFile(state, ptx_input, ptx_file.encode(), 0, [], []), "cu_link_add_file")
    image, size = ok(driver.cuLinkComplete(state), "cu_link_complete")
    module = ok(driver.cuModuleLoadData(image), "cu_module_load_data")
    ok(driver.cuLinkDestroy(state), "cu_link_destroy")
    fn = ok(driver.cuModuleGetFunction(module, name.encode()), "cu_module_get_function")
    x = cuda.to_device(np.arange(4096, dtype=np.int32))
    # numba's kernel ABI spells an array argument out: meminfo, parent, nitems, itemsize, data,
    # shape, strides
    data_ptr = ctypes.c_void_p(x.device_ctypes_pointer.value)
    values = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_ssize_t(x.size), ctypes.c_ssize_t(4), data_ptr,
              ctypes.c_ssize_t(x.size), ctypes.c_ssize_t(4)]  # fmt: skip
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    ok(driver.cuLaunchKernel(fn, 16, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(params), 0), "cu_launch_kernel")
    ok(driver.cuCtxSynchronize(), "cu_ctx_synchronize")
    ok(driver.cuModuleUnload(module), "cu_module_unload")
    print(f"linked_size_positive={size > 0}")


def run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # reported as a fact; the test says which path failed and why
        print(f"{name}_error={type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        traceback.print_exc()


if __name__ == "__main__":
    ptx_file = sys.argv[1]
    paths: dict[str, Callable[[], None]] = {
        "info": info,
        "arrays": arrays,
        "jit": jit,
        "link": lambda: link(ptx_file),
        "bindings_link": lambda: bindings_link(ptx_file),
    }
    only = sys.argv[2:] or list(paths)
    for name in only:
        run(name, paths[name])
    _flush()
    print(f"free_after={cuda.current_context().get_memory_info()[0]}")
