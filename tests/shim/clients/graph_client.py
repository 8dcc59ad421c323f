"""Graph calls through ctypes on whichever libcuda.so.1 the loader finds: the generic node API, edges,
child graphs, clones, capture into an existing graph and kernel node updates. key=value lines.

    python graph_client.py

Two kernels, `fast` and `slow`, come from a PTX module; the test times them with
GPUSLICE_FAKE_KERNEL_TIME, so a graph's launch takes the time of the kernels it holds.
"""

from __future__ import annotations

import ctypes as C
import time

PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry fast() { ret; }
.visible .entry slow() { ret; }
"""
NODE_KERNEL, NODE_EMPTY = 0, 5
u64 = C.c_uint64
cu = C.CDLL("libcuda.so.1")


class KernelParams(C.Structure):  # CUDA_KERNEL_NODE_PARAMS (v2)
    _fields_ = [
        ("func", C.c_void_p),
        *((n, C.c_uint) for n in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ")),
        ("sharedMemBytes", C.c_uint),
        ("kernelParams", C.c_void_p),
        ("extra", C.c_void_p),
        ("kern", C.c_void_p),
        ("ctx", C.c_void_p),
    ]


class KernelParamsV3(C.Structure):  # CUDA_KERNEL_NODE_PARAMS_v3, in CUgraphNodeParams
    _fields_ = KernelParams._fields_


class MemsetParams(C.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [
        ("dst", u64),
        ("pitch", C.c_size_t),
        ("value", C.c_uint),
        ("elementSize", C.c_uint),
        ("width", C.c_size_t),
        ("height", C.c_size_t),
    ]


class NodeUnion(C.Union):
    _fields_ = [("reserved1", C.c_longlong * 29), ("kernel", KernelParamsV3)]


class NodeParams(C.Structure):  # CUgraphNodeParams
    _anonymous_ = ("u",)
    _fields_ = [("type", C.c_int), ("reserved0", C.c_int * 3), ("u", NodeUnion), ("reserved2", C.c_longlong)]


def kernel(fn: C.c_void_p) -> KernelParams:
    return KernelParams(func=fn, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=1, blockDimY=1, blockDimZ=1)


def timed_launch(ex: C.c_void_p, stream: C.c_void_p) -> tuple[int, float]:
    start = time.monotonic()
    rc = cu.cuGraphLaunch(ex, stream)
    cu.cuStreamSynchronize(stream)
    return rc, (time.monotonic() - start) * 1000


def read_u32(d: int) -> int:
    host = C.c_uint32()
    cu.cuMemcpyDtoH_v2(C.byref(host), u64(d), C.c_size_t(4))
    return host.value


def main() -> None:
    out: dict[str, object] = {}
    ctx, mod, fast, slow, stream = (C.c_void_p() for _ in range(5))
    d = u64()
    out["init"] = cu.cuInit(0)
    out["ctx"] = cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    out["module"] = cu.cuModuleLoadData(C.byref(mod), C.c_char_p(PTX))
    cu.cuModuleGetFunction(C.byref(fast), mod, b"fast")
    cu.cuModuleGetFunction(C.byref(slow), mod, b"slow")
    out["stream"] = cu.cuStreamCreate(C.byref(stream), 0)
    out["alloc"] = cu.cuMemAlloc_v2(C.byref(d), C.c_size_t(64))

    # The generic node API adds a kernel node; an edge makes the second node no root.
    g, a, b, ex = C.c_void_p(), C.c_void_p(), C.c_void_p(), C.c_void_p()
    cu.cuGraphCreate(C.byref(g), 0)
    p = NodeParams(type=NODE_KERNEL)
    p.kernel = KernelParamsV3(*(getattr(kernel(fast), f) for f, _ in KernelParams._fields_))
    out["add_node_kernel"] = cu.cuGraphAddNode_v2(C.byref(a), g, None, None, C.c_size_t(0), C.byref(p))
    empty_params = NodeParams(type=NODE_EMPTY)
    out["add_node_empty"] = cu.cuGraphAddNode_v2(
        C.byref(b), g, None, None, C.c_size_t(0), C.byref(empty_params)
    )
    roots, n = (C.c_void_p * 4)(), C.c_size_t(4)
    cu.cuGraphGetRootNodes(g, roots, C.byref(n))
    out["roots_before_edge"] = n.value
    out["add_dependency"] = cu.cuGraphAddDependencies_v2(g, C.byref(a), C.byref(b), None, C.c_size_t(1))
    n = C.c_size_t(4)
    cu.cuGraphGetRootNodes(g, roots, C.byref(n))
    out["roots_after_edge"] = n.value
    out["root_is_the_kernel"] = int(roots[0] == a.value)
    stranger = C.c_void_p(1)
    out["edge_to_a_stranger"] = cu.cuGraphAddDependencies_v2(
        g, C.byref(a), C.byref(stranger), None, C.c_size_t(1)
    )

    # An executable graph's kernel node takes another kernel: its launches take that one's time; the
    # graph it came from keeps the first.
    out["instantiate"] = cu.cuGraphInstantiateWithFlags(C.byref(ex), g, C.c_ulonglong(0))
    out["fast_rc"], out["fast_ms"] = timed_launch(ex, stream)
    out["exec_set_params"] = cu.cuGraphExecKernelNodeSetParams_v2(ex, a, C.byref(kernel(slow)))
    out["slow_rc"], out["slow_ms"] = timed_launch(ex, stream)
    ex2 = C.c_void_p()
    cu.cuGraphInstantiateWithFlags(C.byref(ex2), g, C.c_ulonglong(0))
    out["fresh_rc"], out["fresh_ms"] = timed_launch(ex2, stream)
    out["exec_set_params_foreign_node"] = cu.cuGraphExecKernelNodeSetParams_v2(ex, b, C.byref(kernel(slow)))

    # A clone replays its original's fill, the original destroyed.
    g2, m, clone, ex3 = C.c_void_p(), C.c_void_p(), C.c_void_p(), C.c_void_p()
    cu.cuGraphCreate(C.byref(g2), 0)
    fill = MemsetParams(dst=d.value, pitch=0, value=5, elementSize=4, width=4, height=1)
    out["memset_node"] = cu.cuGraphAddMemsetNode(C.byref(m), g2, None, C.c_size_t(0), C.byref(fill), ctx)
    out["clone"] = cu.cuGraphClone(C.byref(clone), g2)
    cu.cuGraphDestroy(g2)
    cu.cuGraphInstantiateWithFlags(C.byref(ex3), clone, C.c_ulonglong(0))
    cu.cuMemsetD32_v2(d, 0, C.c_size_t(4))
    out["clone_launch"] = cu.cuGraphLaunch(ex3, stream)
    cu.cuStreamSynchronize(stream)
    out["clone_filled"] = read_u32(d.value)

    # A child graph (cloned in) brings its kernel's time; capture into an existing graph adds to it.
    parent, child, k, c, empty, ex4 = (C.c_void_p() for _ in range(6))
    cu.cuGraphCreate(C.byref(parent), 0)
    cu.cuGraphCreate(C.byref(child), 0)
    cu.cuGraphAddKernelNode_v2(C.byref(k), child, None, C.c_size_t(0), C.byref(kernel(slow)))
    out["child_node"] = cu.cuGraphAddChildGraphNode(C.byref(c), parent, None, C.c_size_t(0), child)
    inner = C.c_void_p()
    out["child_get_graph"] = cu.cuGraphChildGraphNodeGetGraph(c, C.byref(inner))
    out["child_is_a_copy"] = int(bool(inner.value) and inner.value != child.value)
    cu.cuGraphAddEmptyNode(C.byref(empty), parent, C.byref(c), C.c_size_t(1))
    out["capture_to_graph"] = cu.cuStreamBeginCaptureToGraph(
        stream, parent, C.byref(empty), None, C.c_size_t(1), 0
    )
    cu.cuMemsetD32Async(d, 9, C.c_size_t(4), stream)
    got = C.c_void_p()
    out["end_capture"] = cu.cuStreamEndCapture(stream, C.byref(got))
    out["capture_gave_the_same_graph"] = int(got.value == parent.value)
    nodes = C.c_size_t(0)
    cu.cuGraphGetNodes(parent, None, C.byref(nodes))
    out["parent_nodes"] = nodes.value
    out["parent_instantiate"] = cu.cuGraphInstantiateWithFlags(C.byref(ex4), parent, C.c_ulonglong(0))
    cu.cuMemsetD32_v2(d, 0, C.c_size_t(4))
    out["parent_rc"], out["parent_ms"] = timed_launch(ex4, stream)
    out["captured_fill"] = read_u32(d.value)
    for key, value in out.items():
        print(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}")


if __name__ == "__main__":
    main()
