"""A tenant of NVIDIA's driver-API Python bindings (`cuda-bindings` from its PyPI wheel), every path
in one process.

    python cuda_bindings_paths.py [PATH ...]

The bindings open libcuda.so.1 (cuda-pathfinder's `load_nvidia_dynamic_lib("cuda")`), take
`cuGetProcAddress_v2` from it with dlsym and ask it for every other entry point by its base name and
the CUDA version the bindings were generated for (`cuMemAlloc` at 3020 -> cuMemAlloc_v2; with
CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1, the per-thread-stream variants): the shim must hand
out its wrappers there. Prints `key=value` facts for the test to judge; a driver error is reported
by the name cuGetErrorName gives it (`oversize_error=CUDA_ERROR_OUT_OF_MEMORY`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import traceback
from collections.abc import Callable

from cuda.bindings import driver
from cuda.bindings._internal import driver as _loaded

GIB = 1 << 30


class DriverError(RuntimeError):
    pass


def name_of(err: driver.CUresult) -> str:
    rc, name = driver.cuGetErrorName(err)
    return name.decode() if rc == driver.CUresult.CUDA_SUCCESS else f"CUresult {int(err)}"


def ok(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DriverError(f"{what}: {name_of(err)}")
    return rest[0] if len(rest) == 1 else rest


def info() -> None:
    print(f"init={int(driver.cuInit(0)[0])}")
    print(f"driver_version={ok(driver.cuDriverGetVersion(), 'cuDriverGetVersion')}")
    print(f"count={ok(driver.cuDeviceGetCount(), 'cuDeviceGetCount')}")
    dev = ok(driver.cuDeviceGet(0), "cuDeviceGet")
    name = ok(driver.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\x00")[0].decode()
    print(f"name={name}")
    print(f"total_mem={ok(driver.cuDeviceTotalMem(dev), 'cuDeviceTotalMem')}")
    attr = driver.CUdevice_attribute
    major = ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
    minor = ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
    print(f"cc={major}.{minor}")
    ctx = ok(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    free, total = ok(driver.cuMemGetInfo(), "cuMemGetInfo")
    print(f"mem_free={free}\nmem_total={total}")


def _free() -> int:
    return ok(driver.cuMemGetInfo(), "cuMemGetInfo")[0]


def edge() -> None:
    """cuMemAlloc of 1 GiB until the driver (or the shim) refuses, then everything freed."""
    start = _free()
    held = []
    try:
        while True:
            err, ptr = driver.cuMemAlloc(GIB)
            if err != driver.CUresult.CUDA_SUCCESS:
                print(f"edge_error={name_of(err)}")
                break
            held.append(ptr)
        print(f"edge_blocks={len(held)}\nedge_free_at_edge={_free()}")
    finally:
        for ptr in held:
            ok(driver.cuMemFree(ptr), "cuMemFree")
    print(f"edge_start={start}\nedge_free_after={_free()}")


def oversize() -> None:
    """One allocation of 9 GiB: more than the slice, less than the card."""
    err, ptr = driver.cuMemAlloc(9 * GIB)
    if err == driver.CUresult.CUDA_SUCCESS:
        print("oversize=ok")
        ok(driver.cuMemFree(ptr), "cuMemFree")
    else:
        print(f"oversize_error={name_of(err)}")


def async_edge() -> None:
    """cuMemAllocAsync of 1 GiB on the default stream until refused (the `_ptsz` variant when the
    bindings were started with CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1)."""
    stream = driver.CUstream(0)
    start = _free()
    held = []
    try:
        while True:
            err, ptr = driver.cuMemAllocAsync(GIB, stream)
            if err != driver.CUresult.CUDA_SUCCESS:
                print(f"async_edge_error={name_of(err)}")
                break
            held.append(ptr)
        ok(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        print(f"async_edge_blocks={len(held)}")
    finally:
        for ptr in held:
            ok(driver.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")
        ok(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        dev = ok(driver.cuDeviceGet(0), "cuDeviceGet")
        pool = ok(driver.cuDeviceGetDefaultMemPool(dev), "cuDeviceGetDefaultMemPool")
        ok(driver.cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")
    print(f"async_edge_start={start}\nasync_edge_free_after={_free()}")


class DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_of(address: int) -> str:
    dl = ctypes.CDLL(None)
    dl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    found = DlInfo()
    if not address or not dl.dladdr(ctypes.c_void_p(address), ctypes.byref(found)):
        return "none"
    symbol = (found.dli_sname or b"?").decode()
    return f"{os.path.basename((found.dli_fname or b'?').decode())}:{symbol}"


def procaddress() -> None:
    """Which library's code (`file:symbol`) the bindings call for each entry point (the pointer
    cuGetProcAddress_v2 handed them when they started), and what their own cuGetProcAddress answers."""
    held = ["cuMemAlloc_v2", "cuMemGetInfo_v2", "cuDeviceTotalMem_v2", "cuMemAllocAsync"]
    held.append("cuGetProcAddress_v2")
    for name in held:
        print(f"lib_{name}={_library_of(_loaded._inspect_function_pointer('__' + name))}")
    ptds = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
    for flags, tag in ((0, "default"), (int(ptds), "ptds")):
        pfn, status = ok(driver.cuGetProcAddress(b"cuMemAllocAsync", 12090, flags), "cuGetProcAddress")
        print(f"asked_cuMemAllocAsync_{tag}={_library_of(int(pfn))} {status.name}")


def run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # reported as a fact; the test says which path failed and why
        print(f"{name}_error={type(exc).__name__}: {exc}")
        traceback.print_exc()


if __name__ == "__main__":
    paths: dict[str, Callable[[], None]] = {
        "info": info,
        "edge": edge,
        "oversize": oversize,
        "async_edge": async_edge,
        "procaddress": procaddress,
    }
    for name in sys.argv[1:] or list(paths):
        run(name, paths[name])
