"""A CuPy tenant (cupy-cuda12x from its PyPI wheel on NVIDIA's runtime).

    python cupy_paths.py PATH

Prints `key=value` facts for the test to judge; CuPy's own exceptions are reported by type and
message (`edge_error=OutOfMemoryError: Out of memory allocating ...`).
"""

from __future__ import annotations

import sys

import cupy
from cupy.cuda import memory, runtime

GIB = 1 << 30


def to_the_edge() -> list[object]:
    print(f"free_at_start={runtime.memGetInfo()[0]}")
    arrays = []
    while len(arrays) < 1024:
        try:
            arrays.append(cupy.empty(GIB, dtype=cupy.uint8))
        except Exception as exc:  # CuPy's own error, reported as it is
            print(f"edge_blocks={len(arrays)}\nedge_error={type(exc).__name__}: {exc}")
            return arrays
    print("edge_blocks=never refused")
    return arrays


def info() -> None:
    props = runtime.getDeviceProperties(0)
    print(f"name={props['name'].decode()}\ntotal_global_mem={props['totalGlobalMem']}")
    free, total = runtime.memGetInfo()
    print(f"mem_free={free}\nmem_total={total}\ncupy={cupy.__version__}")


def edge() -> None:
    """CuPy's default pool: what a tenant gets without configuring anything."""
    arrays = to_the_edge()
    del arrays
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"free_after={runtime.memGetInfo()[0]}")


def no_pool() -> None:
    """No pool: every array is one cudaMalloc, a refusal is the runtime's error as CuPy raises it."""
    cupy.cuda.set_allocator(None)
    arrays = to_the_edge()
    del arrays
    print(f"free_after={runtime.memGetInfo()[0]}")


def caching() -> None:
    """CuPy's default pool keeps freed blocks; on a refusal it frees them and retries."""
    pool = cupy.get_default_memory_pool()
    print(f"free_at_start={runtime.memGetInfo()[0]}")
    a = cupy.empty(6 * GIB, dtype=cupy.uint8)
    del a
    print(f"pool_held={pool.total_bytes()}\nfree_while_held={runtime.memGetInfo()[0]}")
    try:
        b = cupy.empty(7 * GIB, dtype=cupy.uint8)  # the held 6 GiB block cannot serve it
        print(f"big_ok=1\npool_after_big={pool.total_bytes()}")
    except Exception as exc:
        print(f"big_ok=0\nbig_error={type(exc).__name__}: {exc}")
        b = None
    try:
        c = cupy.empty(2 * GIB, dtype=cupy.uint8)
        print("more_ok=1")
        del c
    except Exception as exc:
        print(f"more_ok=0\nmore_error={type(exc).__name__}: {exc}")
    del b
    pool.free_all_blocks()
    print(f"free_after={runtime.memGetInfo()[0]}")


def async_pool() -> None:
    """Stream-ordered allocation (cudaMallocFromPoolAsync) through CuPy's MemoryAsyncPool."""
    pool = memory.MemoryAsyncPool()
    cupy.cuda.set_allocator(pool.malloc)
    arrays = to_the_edge()
    del arrays
    cupy.cuda.Device(0).synchronize()
    print(f"free_after_sync={runtime.memGetInfo()[0]}")  # the pool may keep what was freed
    pool.free_all_blocks()  # trims the pool
    print(f"free_after={runtime.memGetInfo()[0]}")


def managed() -> None:
    """Managed memory through a pool of its own, as CuPy documents it."""
    pool = memory.MemoryPool(memory.malloc_managed)
    cupy.cuda.set_allocator(pool.malloc)
    arrays = to_the_edge()
    del arrays
    pool.free_all_blocks()
    print(f"free_after={runtime.memGetInfo()[0]}")


def hold() -> None:
    a = cupy.empty(5 * GIB, dtype=cupy.uint8)
    print(f"held={a.nbytes}", flush=True)
    sys.stdin.read()


def second() -> None:
    for size in (5, 2):
        try:
            x = cupy.empty(size * GIB, dtype=cupy.uint8)
            print(f"second_{size}g=ok")
            del x
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception as exc:
            print(f"second_{size}g={type(exc).__name__}: {exc}")


def kernels(names: tuple[str, ...] = ("elementwise", "raw")) -> None:
    """Real kernels: an elementwise expression and a RawKernel, both compiled by NVRTC at run time
    (CUPY_CACHE_DIR empty: nothing cached) and loaded as modules, then launched. The double runs no
    kernels: loading, launching and memory are judged, not the values."""
    print(f"free_at_start={runtime.memGetInfo()[0]}")
    x = cupy.arange(1 << 20, dtype=cupy.float32)  # 4 MiB
    for name in names:
        try:
            y = _launch(name, x)
            cupy.cuda.Device().synchronize()
            print(f"{name}=ok\n{name}_shape={'x'.join(map(str, y.shape))}")
            del y
        except Exception as exc:
            print(f"{name}={type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    print(f"nvrtc_version={'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
    print(f"cached_kernels={sum(1 for _ in __import__('pathlib').Path(_cache_dir()).rglob('*.cubin'))}")
    del x
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"free_after={runtime.memGetInfo()[0]}")


def dot() -> None:
    """cupy.dot of two 1024 x 1024 float32 matrices: through cuBLAS (its handle, its workspace)."""
    kernels(("dot",))


def _launch(name: str, x: cupy.ndarray) -> cupy.ndarray:
    if name == "elementwise":
        return x * 2 + 1
    if name == "raw":
        return _raw(x)
    return cupy.dot(x.reshape(1024, 1024), x.reshape(1024, 1024))


def _cache_dir() -> str:
    import os

    return os.environ["CUPY_CACHE_DIR"]


def _raw(x: cupy.ndarray) -> cupy.ndarray:
    kernel = cupy.RawKernel(
        r"""
extern "C" __global__ void scale(const float* x, float* y, float a, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}""",
        "scale",
    )
    y = cupy.empty_like(x)
    n = x.size
    kernel(((n + 255) // 256,), (256,), (x, y, cupy.float32(3), cupy.int32(n)))
    return y


PATHS = {
    "kernels": kernels,
    "dot": dot,
    "info": info,
    "edge": edge,
    "no-pool": no_pool,
    "caching": caching,
    "async-pool": async_pool,
    "managed": managed,
    "hold": hold,
    "second": second,
}

if __name__ == "__main__":
    PATHS[sys.argv[1]]()
