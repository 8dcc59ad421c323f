"""Stream memory operations (cuStreamWrite/WaitValue32/64_v2, cuStreamBatchMemOp_v2) through ctypes on
whichever libcuda.so.1 the loader finds, with the device attributes that say they work. key=value lines."""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
import time

ATTR_V1, ATTR_64, ATTR_NOR = (
    92,
    122,
    123,
)  # CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, ..._64_BIT_..., ..._NOR
GEQ, EQ = 0, 1
WAIT32, WRITE32, WAIT64, WRITE64 = 1, 2, 4, 5


def main() -> int:
    cu = ctypes.CDLL("libcuda.so.1")
    out: dict[str, object] = {}
    ctx = ctypes.c_void_p()
    out["init"] = cu.cuInit(0)
    out["ctx"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    v = ctypes.c_int()
    for name, attr in (("attr_v1", ATTR_V1), ("attr_64", ATTR_64), ("attr_nor", ATTR_NOR)):
        cu.cuDeviceGetAttribute(ctypes.byref(v), attr, 0)
        out[name] = v.value
    d = ctypes.c_uint64()
    out["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(64))
    stream = ctypes.c_void_p()
    out["stream"] = cu.cuStreamCreate(ctypes.byref(stream), 0)
    u64 = ctypes.c_uint64
    out["write32"] = cu.cuStreamWriteValue32_v2(stream, u64(d.value), ctypes.c_uint32(7), 0)
    out["write64"] = cu.cuStreamWriteValue64_v2(stream, u64(d.value + 8), u64(1 << 40), 0)
    host = (ctypes.c_uint32 * 4)()
    cu.cuStreamSynchronize(stream)
    cu.cuMemcpyDtoH_v2(host, u64(d.value), ctypes.c_size_t(16))
    out["read"] = f"{host[0]}:{host[2] | (host[3] << 32)}"
    out["wait_geq_now"] = cu.cuStreamWaitValue32_v2(stream, u64(d.value), ctypes.c_uint32(5), GEQ)

    def later() -> None:  # another thread releases the wait, as a host or peer would
        time.sleep(0.05)
        cu.cuCtxSetCurrent(ctx)
        cu.cuMemcpyHtoD_v2(u64(d.value + 8), ctypes.byref(u64(99)), ctypes.c_size_t(8))

    t = threading.Thread(target=later)
    start = time.monotonic()
    t.start()
    out["wait64_eq_released"] = cu.cuStreamWaitValue64_v2(stream, u64(d.value + 8), u64(99), EQ)
    out["waited_for_the_writer"] = int(time.monotonic() - start >= 0.04)
    t.join()
    ops = (ctypes.c_ubyte * (48 * 2))()
    for i, (op, flags) in enumerate(
        ((WRITE32, 0), (WAIT32, EQ))
    ):  # operation, address, value, flags (aligned)
        struct.pack_into("<i4xQQI", ops, 48 * i, op, d.value + 16, 3, flags)
    out["batch"] = cu.cuStreamBatchMemOp_v2(stream, 2, ops, 0)
    out["misaligned"] = cu.cuStreamWriteValue64_v2(stream, u64(d.value + 4), u64(1), 0)
    out["bad_flags"] = cu.cuStreamWaitValue32_v2(stream, u64(d.value), ctypes.c_uint32(1), 7)
    out["v1"] = cu.cuStreamWaitValue32(stream, u64(d.value), ctypes.c_uint32(1), GEQ)
    for k, val in out.items():
        print(f"{k}={val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
