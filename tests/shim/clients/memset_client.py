"""A buffer written, then zero-filled with cuMemsetD8/D32 (and Async), through ctypes on whichever
libcuda.so.1 the loader finds: what it reads back and how much host memory the process holds
(VmRSS) after each step. key=value lines."""

from __future__ import annotations

import ctypes
import sys

MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    size = int(sys.argv[1])
    cu = ctypes.CDLL("libcuda.so.1")
    u64, size_t = ctypes.c_uint64, ctypes.c_size_t
    ctx = ctypes.c_void_p()
    out: dict[str, object] = {"init": cu.cuInit(0), "ctx": cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)}
    cu.cuCtxSetCurrent(ctx)
    d = u64()
    out["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(d), size_t(size))
    base = rss()
    out["memset_ff"] = cu.cuMemsetD8_v2(u64(d.value), ctypes.c_ubyte(0xFF), size_t(size))
    out["rss_written"] = rss() - base
    # zero all but the first and last 3 bytes (edges inside a page), then the rest with D32
    out["memset_0"] = cu.cuMemsetD8_v2(u64(d.value + 3), ctypes.c_ubyte(0), size_t(size - 6))
    out["rss_zeroed"] = rss() - base
    edges = (ctypes.c_ubyte * 8)()
    cu.cuMemcpyDtoH_v2(edges, u64(d.value), size_t(4))
    cu.cuMemcpyDtoH_v2(ctypes.byref(edges, 4), u64(d.value + size - 4), size_t(4))
    out["edges"] = bytes(edges).hex()
    probe = (ctypes.c_ubyte * 4096)()
    cu.cuMemcpyDtoH_v2(probe, u64(d.value + size // 2), size_t(4096))
    out["middle_zero"] = int(not any(probe))
    out["memset32_0"] = cu.cuMemsetD32Async(u64(d.value), ctypes.c_uint(0), size_t(size // 4), None)
    cu.cuCtxSynchronize()
    cu.cuMemcpyDtoH_v2(edges, u64(d.value + size - 8), size_t(8))
    out["tail_after_d32"] = bytes(edges).hex()
    out["free"] = cu.cuMemFree_v2(u64(d.value))
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
