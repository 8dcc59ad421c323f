"""A JAX tenant (`jax[cuda12]` from its PyPI wheels), every path in one process: JAX's import and
its CUDA backend's start are the cost, and the backend's allocator is chosen once, from the
environment, when it starts (XLA_PYTHON_CLIENT_PREALLOCATE, _MEM_FRACTION, _ALLOCATOR).

    python jax_paths.py serve     # reads a path per line on stdin, answers its facts, then `end=PATH`

Prints `key=value` facts; JAX's own errors are reported by type and first line
(`edge_error=JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory ...`). Arrays are made on the
device by XLA kernels (compiled by ptxas, loaded, launched); the double does not execute them, so
no value is ever read back.
"""

from __future__ import annotations

import gc
import sys

import jax
import jax.numpy as jnp

GIB = 1 << 30


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def device() -> jax.Device:
    return jax.devices()[0]


def stats() -> dict[str, int]:
    return device().memory_stats() or {}


def info() -> None:
    d = device()
    print(f"platform={d.platform}\ncount={len(jax.devices())}\nname={d.device_kind}")
    print(f"cc={getattr(d, 'compute_capability', '?')}")
    for key, value in sorted(stats().items()):
        print(f"{key}={value}")


def gib_array(n: int) -> jax.Array:
    return jnp.zeros((n * GIB,), dtype=jnp.uint8).block_until_ready()


def fits() -> None:
    """An array of half JAX's limit, in whole GiB: made and given back; what JAX's pool then holds."""
    n = max(1, stats()["bytes_limit"] // 2 // GIB)
    x = gib_array(n)
    s = stats()
    print(f"fits={n}\nfits_in_use={s['bytes_in_use']}\nfits_pool={s.get('pool_bytes', 0)}")
    del x
    gc.collect()
    print(f"fits_in_use_after={stats()['bytes_in_use']}")


def edge() -> None:
    """1 GiB arrays until JAX refuses one, then all given back."""
    held = []
    try:
        while len(held) < 64:
            held.append(gib_array(1))
    except Exception as exc:  # JAX's own error, reported as it is
        print(f"edge_error={first_line(exc)}")
    s = stats()
    print(f"edge_blocks={len(held)}\nedge_in_use={s.get('bytes_in_use', 0)}")
    print(f"edge_pool={s.get('pool_bytes', 0)}")
    held.clear()
    gc.collect()
    print(f"edge_in_use_after={stats().get('bytes_in_use', 0)}")


PATHS = {"info": info, "fits": fits, "edge": edge}


def serve() -> None:
    for line in sys.stdin:
        path = line.strip()
        try:
            PATHS[path]()
        except Exception as exc:  # the test sees it as a fact, the next path still runs
            print(f"path_error={first_line(exc)}")
            del exc
        print(f"end={path}", flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1] == "serve" else PATHS[sys.argv[1]]()
