"""An NVML monitoring tenant: nvitop (from PyPI, on nvidia-ml-py) reading GPU 0 as its own API does.

    python nvml_readers.py api

Prints `key=value` facts for the test to judge: the device's total, used and free memory, its
utilization, and the processes nvitop lists (pid:bytes), each read the way `nvitop` reads them for
its screen; then the compute, graphics and MPS lists through pynvml's unversioned calls. An NVML
error is reported by type and message, not raised.
"""

from __future__ import annotations

import sys


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def api() -> None:
    from nvitop import Device

    device = Device(0)
    print(f"name={device.name()}")
    print(f"memory_total={device.memory_total()}")
    print(f"memory_used={device.memory_used()}")
    print(f"memory_free={device.memory_free()}")
    print(f"gpu_utilization={device.gpu_utilization()}")
    try:
        procs = device.processes()
        print("processes=" + ",".join(f"{pid}:{p.gpu_memory()}" for pid, p in sorted(procs.items())))
        print("process_sm=" + ",".join(f"{pid}:{p.gpu_sm_utilization()}" for pid, p in sorted(procs.items())))
    except Exception as exc:
        print(f"processes_error={first_line(exc)}")
    # what gpustat and other scripts call straight through the bindings (unversioned: pynvml picks
    # the newest versioned entry point the library has)
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for kind in ("Compute", "Graphics", "MPSCompute"):
        try:
            procs = getattr(pynvml, f"nvmlDeviceGet{kind}RunningProcesses")(h)
            print(f"pynvml_{kind.lower()}=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
        except Exception as exc:
            print(f"pynvml_{kind.lower()}_error={first_line(exc)}")


def family() -> None:
    """The struct-versioned process calls (nvmlDeviceGetRunningProcessDetailList of each mode,
    nvmlDeviceGetProcessesUtilizationInfo), as pynvml makes them."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for mode, name in enumerate(("compute", "graphics", "mps")):
        try:
            procs = pynvml.nvmlDeviceGetRunningProcessDetailList(h, pynvml.nvmlProcessDetailList_v1, mode)
            print(f"detail_{name}=" + ",".join(f"{p.pid}:{p.usedGpuMemory}" for p in procs))
        except Exception as exc:
            print(f"detail_{name}_error={first_line(exc)}")
    try:
        samples = pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
        print("util_info=" + ",".join(f"{s.pid}:{s.smUtil}" for s in samples))
    except Exception as exc:
        print(f"util_info_error={first_line(exc)}")
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
        print("process_util=" + ",".join(f"{s.pid}:{s.smUtil}" for s in samples))
    except Exception as exc:
        print(f"process_util_error={first_line(exc)}")


PATHS = {"api": api, "family": family}

if __name__ == "__main__":
    PATHS[sys.argv[1]]()
