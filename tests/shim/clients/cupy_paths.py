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


PATHS = {
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
