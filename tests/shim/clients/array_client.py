"""Copies into and out of CUDA arrays (3-D, 2-D and 1-D) through ctypes on whichever libcuda.so.1 the
loader finds, and reads the device's free memory around them. Prints key=value lines."""

from __future__ import annotations

import ctypes
import sys

c_size = ctypes.c_size_t
FLOAT = 0x20  # CU_AD_FORMAT_FLOAT
HOST, DEVICE, ARRAY = 1, 2, 3  # CUmemorytype


class Desc3D(ctypes.Structure):
    _fields_ = [("Width", c_size), ("Height", c_size), ("Depth", c_size), ("Format", ctypes.c_int),
                ("NumChannels", ctypes.c_uint), ("Flags", ctypes.c_uint)]  # fmt: skip


def _side(prefix: str) -> list[tuple[str, object]]:
    types = [
        ("XInBytes", c_size), ("Y", c_size), ("Z", c_size), ("LOD", c_size), ("MemoryType", ctypes.c_int),
        ("Host", ctypes.c_void_p), ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p),
        ("Reserved", ctypes.c_void_p), ("Pitch", c_size), ("Height", c_size),
    ]  # fmt: skip
    return [(prefix + name, t) for name, t in types]


class Copy3D(ctypes.Structure):
    _fields_ = [*_side("src"), *_side("dst"), ("WidthInBytes", c_size), ("Height", c_size), ("Depth", c_size)]


class Copy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", c_size), ("srcY", c_size), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", c_size), ("dstXInBytes", c_size), ("dstY", c_size), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", c_size),
        ("WidthInBytes", c_size), ("Height", c_size),
    ]  # fmt: skip


def main() -> int:
    big = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    cu = ctypes.CDLL("libcuda.so.1")
    out: dict[str, object] = {}
    ctx = ctypes.c_void_p()
    out["init"] = cu.cuInit(0)
    out["ctx"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    free, total = c_size(), c_size()

    def free_now() -> int:
        cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value

    # a 64 x 32 x 8 array of floats: rows of 256 bytes
    arr = ctypes.c_void_p()
    out["array_create"] = cu.cuArray3DCreate_v2(
        ctypes.byref(arr), ctypes.byref(Desc3D(64, 32, 8, FLOAT, 1, 0))
    )
    box = (ctypes.c_ubyte * (128 * 4 * 3))(*[(i * 7 + 3) % 251 for i in range(128 * 4 * 3)])
    back = (ctypes.c_ubyte * len(box))()
    before = free_now()
    up = Copy3D(srcMemoryType=HOST, srcHost=ctypes.addressof(box), srcPitch=128, srcHeight=4,
                dstXInBytes=64, dstY=5, dstZ=2, dstMemoryType=ARRAY, dstArray=arr,
                WidthInBytes=128, Height=4, Depth=3)  # fmt: skip
    out["copy3d_in"] = cu.cuMemcpy3D_v2(ctypes.byref(up))
    down = Copy3D(srcXInBytes=64, srcY=5, srcZ=2, srcMemoryType=ARRAY, srcArray=arr,
                  dstMemoryType=HOST, dstHost=ctypes.addressof(back), dstPitch=128, dstHeight=4,
                  WidthInBytes=128, Height=4, Depth=3)  # fmt: skip
    out["copy3d_out"] = cu.cuMemcpy3D_v2(ctypes.byref(down))
    out["roundtrip"] = int(bytes(back) == bytes(box))
    out["free_unchanged"] = int(free_now() == before)
    # one slice past the array's depth (8) is refused, nothing written
    over = Copy3D(srcMemoryType=HOST, srcHost=ctypes.addressof(box), srcPitch=128, srcHeight=4,
                  dstZ=6, dstMemoryType=ARRAY, dstArray=arr, WidthInBytes=128, Height=4, Depth=3)  # fmt: skip
    out["copy3d_outside"] = cu.cuMemcpy3D_v2(ctypes.byref(over))
    wide = Copy3D(srcMemoryType=HOST, srcHost=ctypes.addressof(box), srcPitch=512, srcHeight=1,
                  dstMemoryType=ARRAY, dstArray=arr, WidthInBytes=257, Height=1, Depth=1)  # fmt: skip
    out["copy3d_too_wide"] = cu.cuMemcpy3D_v2(ctypes.byref(wide))
    # 1-D: host -> array -> device -> host, and array -> array
    dptr = ctypes.c_uint64()
    out["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(dptr), c_size(4096))
    line = (ctypes.c_ubyte * 1024)(*[i % 256 for i in range(1024)])
    got = (ctypes.c_ubyte * 1024)()
    out["htoa"] = cu.cuMemcpyHtoA_v2(arr, c_size(4096), line, c_size(1024))
    out["atod"] = cu.cuMemcpyAtoD_v2(dptr, arr, c_size(4096), c_size(1024))
    out["dtoh"] = cu.cuMemcpyDtoH_v2(got, dptr, c_size(1024))
    out["linear_roundtrip"] = int(bytes(got) == bytes(line))
    arr2 = ctypes.c_void_p()
    cu.cuArray3DCreate_v2(ctypes.byref(arr2), ctypes.byref(Desc3D(256, 0, 0, FLOAT, 1, 0)))
    out["atoa"] = cu.cuMemcpyAtoA_v2(arr2, c_size(0), arr, c_size(4096), c_size(1024))
    got2 = (ctypes.c_ubyte * 1024)()
    out["atoh"] = cu.cuMemcpyAtoH_v2(got2, arr2, c_size(0), c_size(1024))
    out["array_roundtrip"] = int(bytes(got2) == bytes(line))
    out["atoh_past_end"] = cu.cuMemcpyAtoH_v2(got2, arr2, c_size(512), c_size(1024))
    # 2-D: two full rows into slice 0 at row 10, read back as the array's bytes in order
    rows = (ctypes.c_ubyte * 512)(*[(i * 13) % 256 for i in range(512)])
    flat = (ctypes.c_ubyte * 512)()
    two = Copy2D(srcMemoryType=HOST, srcHost=ctypes.addressof(rows), srcPitch=256,
                 dstY=10, dstMemoryType=ARRAY, dstArray=arr, WidthInBytes=256, Height=2)  # fmt: skip
    out["copy2d_in"] = cu.cuMemcpy2D_v2(ctypes.byref(two))
    cu.cuMemcpyAtoH_v2(flat, arr, c_size(10 * 256), c_size(512))
    out["copy2d_roundtrip"] = int(bytes(flat) == bytes(rows))
    if big:  # arrays charge the slice: `big` bytes of floats, 1024-wide rows, 1024 rows per slice
        huge = ctypes.c_void_p()
        before = free_now()
        out["big_create"] = cu.cuArray3DCreate_v2(
            ctypes.byref(huge), ctypes.byref(Desc3D(1024, 1024, big // (4 << 20), FLOAT, 1, 0))
        )
        out["big_charged"] = before - free_now()
        corner = (ctypes.c_ubyte * 4096)(*([0xAB] * 4096))
        last = Copy3D(srcMemoryType=HOST, srcHost=ctypes.addressof(corner), srcPitch=4096, srcHeight=1,
                      dstY=1023, dstZ=big // (4 << 20) - 1, dstMemoryType=ARRAY, dstArray=huge,
                      WidthInBytes=4096, Height=1, Depth=1)  # fmt: skip
        after_create = free_now()
        out["big_copy_last_row"] = cu.cuMemcpy3D_v2(ctypes.byref(last))
        out["big_copy_free_unchanged"] = int(free_now() == after_create)
        second = ctypes.c_void_p()
        out["second_big_create"] = cu.cuArray3DCreate_v2(
            ctypes.byref(second), ctypes.byref(Desc3D(1024, 1024, big // (4 << 20), FLOAT, 1, 0))
        )
        out["big_destroy"] = cu.cuArrayDestroy(huge)
        out["big_returned"] = int(free_now() == before)
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
