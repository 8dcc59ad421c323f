"""Links two PTX inputs with the driver's JIT linker, loads the result and lists its kernels, through
ctypes on whichever libcuda.so.1 the loader finds (the double, under the shim or not). Prints key=value
lines: each call's CUresult, what the module lists and the parameter layout the driver reports."""

from __future__ import annotations

import ctypes
import sys
import tempfile

HEAD = ".version 7.0\n.target sm_70\n.address_size 64\n"
PTX_A = HEAD + ".visible .entry first(\n\t.param .u64 first_p0\n)\n{\n\tret;\n}\n"
PTX_B = (
    HEAD + ".visible .entry second(\n\t.param .u64 second_p0,\n\t.param .u32 second_p1,\n"
    "\t.param .align 8 .b8 second_p2[24]\n)\n{\n\tret;\n}\n"
)
CU_JIT_INPUT_PTX = 1


def main() -> int:
    cu = ctypes.CDLL("libcuda.so.1")
    out: dict[str, object] = {}
    ctx = ctypes.c_void_p()
    out["init"] = cu.cuInit(0)
    out["ctx"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    out["profiler_start"] = cu.cuProfilerStart()
    out["profiler_stop"] = cu.cuProfilerStop()
    state = ctypes.c_void_p()
    out["link_create"] = cu.cuLinkCreate_v2(0, None, None, ctypes.byref(state))
    a = PTX_A.encode()
    out["link_add_data"] = cu.cuLinkAddData_v2(
        state, CU_JIT_INPUT_PTX, ctypes.c_char_p(a), ctypes.c_size_t(len(a) + 1), b"a.ptx", 0, None, None
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(PTX_B)
        f.flush()
        out["link_add_file"] = cu.cuLinkAddFile_v2(state, CU_JIT_INPUT_PTX, f.name.encode(), 0, None, None)
    image, size = ctypes.c_void_p(), ctypes.c_size_t()
    out["link_complete"] = cu.cuLinkComplete(state, ctypes.byref(image), ctypes.byref(size))
    mod = ctypes.c_void_p()
    out["module_load"] = cu.cuModuleLoadData(ctypes.byref(mod), image)
    lib = ctypes.c_void_p()
    out["library_load"] = cu.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0)
    out["link_destroy"] = cu.cuLinkDestroy(state)
    count = ctypes.c_uint()
    out["function_count_rc"] = cu.cuModuleGetFunctionCount(ctypes.byref(count), mod)
    out["function_count"] = count.value
    funcs = (ctypes.c_void_p * count.value)()
    out["enumerate"] = cu.cuModuleEnumerateFunctions(funcs, count.value, mod)
    names = []
    for fn in funcs:
        name = ctypes.c_char_p()
        cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(fn))
        names.append((name.value or b"").decode())
    out["functions"] = ",".join(names)
    fn = ctypes.c_void_p()
    out["get_function"] = cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"second")
    layout = []
    for i in range(4):
        off, sz = ctypes.c_size_t(), ctypes.c_size_t()
        rc = cu.cuFuncGetParamInfo(fn, ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(sz))
        layout.append(f"{rc}:{off.value}:{sz.value}" if rc == 0 else f"{rc}")
    out["params"] = ",".join(layout)
    out["launch"] = cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, None)
    out["sync"] = cu.cuCtxSynchronize()
    out["kernel_count_rc"] = cu.cuLibraryGetKernelCount(ctypes.byref(count), lib)
    out["kernel_count"] = count.value
    kernels = (ctypes.c_void_p * count.value)()
    out["enumerate_kernels"] = cu.cuLibraryEnumerateKernels(kernels, count.value, lib)
    off, sz = ctypes.c_size_t(), ctypes.c_size_t()
    rc = cu.cuKernelGetParamInfo(
        ctypes.c_void_p(kernels[0]), ctypes.c_size_t(0), ctypes.byref(off), ctypes.byref(sz)
    )
    out["kernel_param0"] = f"{rc}:{off.value}:{sz.value}"
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    out["mem_info"] = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    out["total"] = total.value
    for k, v in out.items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
