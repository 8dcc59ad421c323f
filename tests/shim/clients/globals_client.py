"""Loads a kernel image with module-scope variables (a file: PTX, cubin or fatbin) through ctypes on
whichever libcuda.so.1 the loader finds (the double, under the shim or not), as a driver-API client
does: finds each variable with cuModuleGetGlobal, reads its initial bytes, writes and reads back,
then unloads. Also as a library (cuLibraryLoadData / cuLibraryGetGlobal). Prints key=value lines."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

#: the variables the test's PTX declares, in the order printed
NAMES = ["counter", "table", "scale", "limits", "hidden", "wide"]


def twice(path: str) -> int:
    """Loads one image twice (a module each time, each with its own variables), then unloads both:
    what the device shows free after each step, and each call's CUresult."""
    image = ctypes.create_string_buffer(Path(path).read_bytes() + b"\0")
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    out: dict[str, object] = {"init": cu.cuInit(0), "ctx": cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)}
    cu.cuCtxSetCurrent(ctx)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    out["free_before"] = free.value
    mods = []
    for i in (1, 2):
        mod = ctypes.c_void_p()
        out[f"load{i}"] = cu.cuModuleLoadData(ctypes.byref(mod), image)
        cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        out[f"free_load{i}"] = free.value
        if out[f"load{i}"] == 0:
            mods.append(mod)
    lib = ctypes.c_void_p()
    out["library_load"] = cu.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0)
    out["unloads"] = ",".join(str(cu.cuModuleUnload(m)) for m in mods)
    if out["library_load"] == 0:
        out["library_unload"] = cu.cuLibraryUnload(lib)
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    out["free_end"] = free.value
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


def main() -> int:
    if sys.argv[2:] == ["twice"]:
        return twice(sys.argv[1])
    image = Path(sys.argv[1]).read_bytes() + b"\0"
    cu = ctypes.CDLL("libcuda.so.1")
    out: dict[str, object] = {}
    ctx = ctypes.c_void_p()
    out["init"] = cu.cuInit(0)
    out["ctx"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()

    def mem_free() -> int:
        cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value

    out["free_before"] = mem_free()
    mod = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(image, len(image))
    out["load"] = cu.cuModuleLoadData(ctypes.byref(mod), buf)
    out["free_loaded"] = mem_free()
    addrs = {}
    for name in NAMES:
        dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = cu.cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), mod, name.encode())
        out[f"{name}_rc"] = rc
        if rc != 0:
            continue
        out[f"{name}_size"] = size.value
        addrs[name] = dptr.value
        data = ctypes.create_string_buffer(size.value)
        cu.cuMemcpyDtoH_v2(data, ctypes.c_uint64(dptr.value), ctypes.c_size_t(size.value))
        out[f"{name}_init"] = data.raw.hex()
    out["distinct_addresses"] = int(len(set(addrs.values())) == len(addrs))
    size_only = ctypes.c_size_t()
    out["size_only"] = cu.cuModuleGetGlobal_v2(None, ctypes.byref(size_only), mod, b"table")
    out["size_only_size"] = size_only.value
    out["both_null"] = cu.cuModuleGetGlobal_v2(None, None, mod, b"table")
    out["unknown"] = cu.cuModuleGetGlobal_v2(ctypes.byref(ctypes.c_uint64()), None, mod, b"no_such_variable")
    out["kernel_name"] = cu.cuModuleGetGlobal_v2(ctypes.byref(ctypes.c_uint64()), None, mod, b"touch")
    if "counter" in addrs:
        at, four = ctypes.c_uint64(addrs["counter"]), ctypes.c_size_t(4)
        value, back = ctypes.c_uint32(0xC0FFEE), ctypes.c_uint32()
        out["write"] = cu.cuMemcpyHtoD_v2(at, ctypes.byref(value), four)
        out["read"] = cu.cuMemcpyDtoH_v2(ctypes.byref(back), at, four)
        out["read_back"] = hex(back.value)
        out["mem_free_global"] = cu.cuMemFree_v2(at)  # the driver's memory, not the client's to free
    fn = ctypes.c_void_p()
    out["get_function"] = cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"touch")
    out["unload"] = cu.cuModuleUnload(mod)
    out["free_unloaded"] = mem_free()
    lib = ctypes.c_void_p()
    out["library_load"] = cu.cuLibraryLoadData(ctypes.byref(lib), buf, None, None, 0, None, None, 0)
    dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    out["library_global"] = cu.cuLibraryGetGlobal(ctypes.byref(dptr), ctypes.byref(size), lib, b"table")
    out["library_global_size"] = size.value
    out["library_unknown"] = cu.cuLibraryGetGlobal(ctypes.byref(dptr), ctypes.byref(size), lib, b"no_such")
    out["library_loaded_free"] = mem_free()
    out["library_unload"] = cu.cuLibraryUnload(lib)
    out["free_end"] = mem_free()
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
