"""Real compiled kernels with the time a GPU would take: CuPy RawKernels compiled by NVRTC, timed on
the driver test double by GPUSLICE_FAKE_KERNEL_TIME (the test sets it; on a real GPU the kernels
spin for about as long).

    python cupy_timed.py PATH

Prints `key=value` facts: seconds a launch and the stream's synchronization took, the device's
utilization as NVML reads it afterwards (its last second).
"""

from __future__ import annotations

import sys
import time

import cupy
import pynvml

#: Kernels that keep a GPU busy for the time they are given (a clock spin), so that the same
#: client means the same on a real card; the double does not execute them, it books the time the
#: test configured for each name.
SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void per_thread(float* y, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * y[i];
}
"""
#: a V100's clock is about 1.4 GHz: cycles for 200 ms there
CYCLES_200MS = 280_000_000


def _module() -> cupy.RawModule:
    return cupy.RawModule(code=SOURCE)


def _utilization() -> int:
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(0)).gpu)
    finally:
        pynvml.nvmlShutdown()


def _timed(launch) -> tuple[float, float]:
    stream = cupy.cuda.get_current_stream()
    t0 = time.monotonic()
    launch()
    t1 = time.monotonic()
    stream.synchronize()
    return t1 - t0, time.monotonic() - t1


def timed() -> None:
    """One 200 ms kernel, then five back to back; then a kernel timed per thread at two grids."""
    mod = _module()
    spin = mod.get_function("spin")
    spin((1,), (1,), (cupy.int64(CYCLES_200MS),))  # loaded and once run: what follows is timed
    cupy.cuda.get_current_stream().synchronize()
    time.sleep(1.1)  # the device idle for NVML's whole window
    print(f"idle_util={_utilization()}")
    launch, sync = _timed(lambda: spin((1,), (1,), (cupy.int64(CYCLES_200MS),)))
    print(f"one_launch_s={launch:.4f}\none_sync_s={sync:.4f}\none_util={_utilization()}")

    def five() -> None:
        for _ in range(5):
            spin((1,), (1,), (cupy.int64(CYCLES_200MS),))

    launch, sync = _timed(five)
    print(f"five_launch_s={launch:.4f}\nfive_sync_s={sync:.4f}\nfive_util={_utilization()}")

    per_thread = mod.get_function("per_thread")
    y = cupy.ones(1 << 20, dtype=cupy.float32)
    for blocks in (1024, 4096):
        n = blocks * 256
        launch, sync = _timed(lambda n=n, b=blocks: per_thread((b,), (256,), (y, cupy.int32(n))))
        print(f"grid{blocks}_s={launch + sync:.4f}")


def busy(seconds: float) -> None:
    """50 ms kernels, each waited for, launched for `seconds`; the share of the second half (after
    the throttle settled) they kept the device busy (their booked time over the wall time), and
    NVML's reading at the end."""
    spin = _module().get_function("spin")
    stream = cupy.cuda.get_current_stream()
    spin((1,), (1,), (cupy.int64(CYCLES_200MS // 4),))
    stream.synchronize()
    start = time.monotonic()
    half, launches = start + seconds / 2, 0
    while (t := time.monotonic()) < start + seconds:
        spin((1,), (1,), (cupy.int64(CYCLES_200MS // 4),))
        stream.synchronize()
        if t >= half:
            launches += 1
    wall = time.monotonic() - half
    print(f"launches={launches}\nbusy_fraction={launches * 0.05 / wall:.3f}\nend_util={_utilization()}")


PATHS = {"timed": timed, "busy": lambda: busy(float(sys.argv[2]))}

if __name__ == "__main__":
    PATHS[sys.argv[1]]()
