"""A driver-API client that opens its own copy of the driver in a fresh link-map namespace, as an
in-process bypass would: dlmopen(LM_ID_NEWLM, "libcuda.so.1"), then every entry point by dlsym on
that handle. Prints each call's CUresult (`cuInit=0`), what cuMemGetInfo_v2 shows, and which
library each pointer it got leads into (`lib_cuInit=libcuda.so.1`)."""

from __future__ import annotations

import ctypes
import os

LM_ID_NEWLM, RTLD_NOW = -1, 2
GIB = 1 << 30


class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]  # fmt: skip


libc = ctypes.CDLL(None)
libc.dlmopen.restype, libc.dlmopen.argtypes = ctypes.c_void_p, [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
libc.dlerror.restype = ctypes.c_char_p


def main() -> None:
    handle = libc.dlmopen(LM_ID_NEWLM, b"libcuda.so.1", RTLD_NOW)
    print(f"dlmopen={'ok' if handle else libc.dlerror().decode()}")
    ptr = ctypes.c_void_p

    def call(name: str, *args: object, types: tuple = ()) -> int:
        address = libc.dlsym(handle, name.encode())
        found = DlInfo()
        libc.dladdr(address, ctypes.byref(found))
        print(f"lib_{name}={os.path.basename(found.fname.decode()) if found.fname else 'none'}")
        return ctypes.CFUNCTYPE(ctypes.c_int, *types)(address)(*args)

    dev, ctx, mem = ctypes.c_int(), ptr(), ptr()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    print(f"cuInit={call('cuInit', 0, types=(ctypes.c_uint,))}")
    print(f"cuDeviceGet={call('cuDeviceGet', ctypes.byref(dev), 0, types=(ptr, ctypes.c_int))}")
    created = call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev, types=(ptr, ctypes.c_uint, ctypes.c_int))
    print(f"cuCtxCreate_v2={created}")
    info = call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total), types=(ptr, ptr))
    print(f"cuMemGetInfo_v2={info}")
    print(f"free={free.value}\ntotal={total.value}")
    sizes = (ptr, ctypes.c_size_t)
    print(f"alloc_9GiB={call('cuMemAlloc_v2', ctypes.byref(mem), ctypes.c_size_t(9 * GIB), types=sizes)}")
    print(f"alloc_1GiB={call('cuMemAlloc_v2', ctypes.byref(mem), ctypes.c_size_t(GIB), types=sizes)}")
    print(f"cuCtxDestroy_v2={call('cuCtxDestroy_v2', ctx, types=(ptr,))}")


if __name__ == "__main__":
    main()
