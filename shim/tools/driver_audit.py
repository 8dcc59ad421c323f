"""The driver double's audit: for every entry point its libcuda.so.1 exports, implemented or a stub, and why.

The names come from src/gs_procs.h (generated from NVIDIA's cuda.h and cudaTypedefs.h by
gen_procs.py: every name and versioned form a driver of the simulated version serves); whether
each is implemented comes from the built library: an unmodeled entry point is a weak alias of a
stub in fake/cuda_stubs.c (`nm -D` type W), an implemented one is a strong definition (type T).
A stub's reason comes from RULES, in order; a stub no rule explains is written as `unexplained`,
which tests/shim/test_driver_audit.py refuses, as it refuses a checked-in audit that differs from
what this script makes of the current build.

    python shim/tools/driver_audit.py --lib shim/build/fake/libcuda.so.1 > shim/fake/driver_audit.tsv
    python shim/tools/driver_audit.py --lib LIB --counts     # implemented / stub by reason

Columns (tab-separated): name, status (implemented | stub), group, reason. Groups of stubs:
legacy-abi (an entry point only programs built against an old CUDA call), graphics-interop,
not-on-v100 (a feature the simulated V100 lacks; `attr:NAME==V` is the device attribute the double
reports so software does not try, checked by the test), not-modeled (a driver feature with nothing
to simulate on a GPU-less double, said why), gap (a V100 driver answers it and the double does not
yet: the list of what is left to model).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: (pattern on the name without its _ptds/_ptsz suffix, group, reason); the first match wins.
RULES: list[tuple[str, str, str]] = [
    (r"cuParamSet\w*|cuLaunch|cuLaunchGrid\w*|cuFuncSetBlockShape|cuFuncSetSharedSize", "legacy-abi",
     "pre-CUDA 4.0 launch API (parameters set one by one), deprecated; the runtime never calls it"),
    (r"cuCtxAttach|cuCtxDetach|cuProfilerInitialize", "legacy-abi", "deprecated, no 12.x client calls it"),
    (r"cuLaunchCooperativeKernelMultiDevice", "legacy-abi", "deprecated since CUDA 11.3"),
    (r"cuTexRef\w*|cuSurfRef\w*|cuModuleGetTexRef|cuModuleGetSurfRef", "legacy-abi",
     "texture/surface references, deprecated (removed from the CUDA 12 runtime)"),
    (r"cuGraphInstantiate", "legacy-abi", "the 10.0 ABI; cuda.h maps the name to cuGraphInstantiateWithFlags"),
    (r"cu(GL|WGL|VDPAU)\w*|cuGraphics\w*|\w*EGL\w*", "graphics-interop", "OpenGL/EGL/VDPAU interop: no display stack"),
    (r"\w*ExternalSemaphore\w*|cuDeviceGetNvSciSyncAttributes", "graphics-interop",
     "Vulkan/D3D12/NvSci semaphores: no graphics API to import from"),
    (r"cuMulticast\w*", "not-on-v100", "NVLink SHARP multicast; attr:CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED==0"),
    (r"cuOccupancyMax\w*Cluster\w*", "not-on-v100", "thread block clusters; attr:CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH==0"),
    (r"cuTensorMap\w*", "not-on-v100", "Hopper TMA; attr:CU_DEVICE_ATTRIBUTE_TENSOR_MAP_ACCESS_SUPPORTED==0"),
    (r"cuMemBatchDecompressAsync", "not-on-v100",
     "hardware decompression; attr:CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_ALGORITHM_MASK==0"),
    (r"cuMemGetHandleForAddressRange", "not-on-v100", "dma-buf export; attr:CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED==0"),
    (r"cuGreenCtx\w*|cuCtxFromGreenCtx|cuStreamGetGreenCtx|cuDevResource\w*|cuDevSmResource\w*|cu(Ctx|Device)GetDevResource",
     "not-modeled", "green contexts (SM partitions): the double has no SMs to partition"),
    (r"cuCheckpoint\w*", "not-modeled", "process checkpoint/restore (cuda-checkpoint): no device state to save"),
    (r"cuCoredump\w*", "not-modeled", "GPU core dumps: no kernel executes, nothing to dump"),
    (r"cuLogs\w*", "not-modeled", "driver error log callbacks"),
    (r"cuDevice(Register|Unregister)AsyncNotification", "not-modeled", "budget-change notifications (WDDM/Tegra)"),
    # A V100 driver answers these; the double does not model them yet.
    (r"cuLink\w*", "gap", "JIT linker"),
    (r"cuMemcpy(3D|HtoA|AtoH|AtoD|DtoA|AtoA)\w*|cuMemcpy3DPeer\w*|cuMemcpy(3D)?BatchAsync\w*", "gap",
     "array and 3-D copies"),
    (r"cuGraph\w*BatchMemOp\w*", "gap", "batch memory operation graph nodes"),
    (r"cuGraph\w*|cuStreamBeginCaptureToGraph|cuStreamUpdateCaptureDependencies\w*", "gap",
     "graph node introspection, update and capture-to-graph"),
    (r"cuProfiler(Start|Stop)", "gap", "profiler control"),
    (r"cuModule(EnumerateFunctions|GetFunctionCount)|cuLibrary(EnumerateKernels|GetKernelCount)"
     r"|cu(Func|Kernel)GetParamInfo|cuKernelGetLibrary|cuLibraryGetUnifiedFunction", "gap", "module introspection"),
    (r"cuTexObject\w*|cuSurfObject\w*|cuArray\w*|cuMipmappedArray\w*|cuMemMapArrayAsync", "gap",
     "texture/surface objects and array descriptors (attr SPARSE_CUDA_ARRAY_SUPPORTED says 1)"),
    (r"cuMemPool(Export|Import)\w*", "gap", "pool IPC (attr MEMPOOL_SUPPORTED_HANDLE_TYPES says POSIX fd)"),
    (r"cuMem(GetAccess|RangeGetAttributes|GetAllocationPropertiesFromHandle|Discard\w*|PrefetchBatchAsync)"
     r"|cuExternalMemoryGetMapped\w*|cuMemcpyPeer\w*|cuDeviceSetGraphMemAttribute|cuCtx(Record|Wait)Event"
     r"|cuCtx(Enable|Disable)PeerAccess|cuDeviceGet(Host|P2P)AtomicCapabilities", "gap", "memory and context queries"),
]

_SUFFIX = re.compile(r"_(ptds|ptsz)$")


def proc_names(procs_h: Path) -> list[str]:
    """Every symbol gs_procs.h lists (the driver's entry points, versioned forms included)."""
    text = procs_h.read_text()
    names = re.findall(r"^\s*X\(\w+, \d+, (cu\w+)\)", text, re.M)
    for fn, ptsz in re.findall(r"^\s*XP\(\w+, \d+, (cu\w+), (cu\w+)\)", text, re.M):
        names += [fn, ptsz]
    return sorted(set(names))


def exported(lib: Path) -> dict[str, str]:
    """name -> nm type (T: implemented, W: the weak stub) of the library's defined dynamic symbols."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {parts[2]: parts[1] for parts in (line.split() for line in out.splitlines()) if len(parts) == 3}


def reason_of(name: str, names: set[str]) -> tuple[str, str]:
    base = _SUFFIX.sub("", name)
    if not re.search(r"_v\d+$", base) and f"{base}_v2" in names:
        return "legacy-abi", f"the ABI before {base}_v2; cuda.h maps the name to {base}_v2"
    for pattern, group, reason in RULES:
        if re.fullmatch(pattern, base):
            return group, reason
    return "unexplained", "a stub no rule explains: implement it or add a rule with its reason"


def audit(lib: Path, procs_h: Path) -> list[tuple[str, str, str, str]]:
    syms = exported(lib)
    names = proc_names(procs_h)
    missing = [n for n in names if n not in syms]
    if missing:
        raise SystemExit(f"{lib} does not export {', '.join(missing)}")
    rows = []
    every = set(names)
    for name in names:
        if syms[name] == "W":
            rows.append((name, "stub", *reason_of(name, every)))
        else:
            rows.append((name, "implemented", "", ""))
    return rows


def render(rows: list[tuple[str, str, str, str]]) -> str:
    head = "# GENERATED by shim/tools/driver_audit.py from src/gs_procs.h and the built fake/libcuda.so.1\n"
    return head + "".join("\t".join(r).rstrip("\t") + "\n" for r in rows)


def counts(rows: list[tuple[str, str, str, str]]) -> Counter[str]:
    return Counter("implemented" if r[1] == "implemented" else f"stub {r[2]}" for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", type=Path, default=_HERE.parent / "build/fake/libcuda.so.1")
    p.add_argument("--procs", type=Path, default=_HERE.parent / "src/gs_procs.h")
    p.add_argument("--counts", action="store_true", help="print implemented / stub-by-group counts")
    a = p.parse_args()
    rows = audit(a.lib, a.procs)
    if a.counts:
        for key, n in sorted(counts(rows).items()):
            print(f"{n:4d} {key}")
        print(f"{len(rows):4d} total")
    else:
        sys.stdout.write(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
