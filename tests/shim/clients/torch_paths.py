"""A PyTorch tenant (torch 2.9.1 from PyPI, built on CUDA 12.8, with the nvidia-* wheels it links).

    python torch_paths.py PATH

Prints `key=value` facts for the test to judge; PyTorch's own exceptions are reported by type and
the first line of their message.
"""

from __future__ import annotations

import sys
import time

t0 = time.monotonic()
import torch  # noqa: E402

GIB = 1 << 30
print(f"import_s={time.monotonic() - t0:.1f}", flush=True)


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def to_the_edge() -> list[torch.Tensor]:
    print(f"free_at_start={torch.cuda.mem_get_info()[0]}")
    tensors = []
    while len(tensors) < 1024:
        try:
            tensors.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
        except Exception as exc:
            print(f"edge_blocks={len(tensors)}\nedge_error={first_line(exc)}")
            print(f"reserved_at_edge={torch.cuda.memory_reserved()}")
            return tensors
    print("edge_blocks=never refused")
    return tensors


def info() -> None:
    print(f"arch_flags={','.join(torch._C._cuda_getArchFlags().split())}", flush=True)  # as built
    print(f"available={int(torch.cuda.is_available())}\ntorch={torch.__version__}\ncuda={torch.version.cuda}")
    print(f"arch_list={','.join(torch.cuda.get_arch_list())}")
    props = torch.cuda.get_device_properties(0)
    print(f"name={props.name}\ntotal_global_mem={props.total_memory}\ncc={props.major}.{props.minor}")
    free, total = torch.cuda.mem_get_info()
    print(f"mem_free={free}\nmem_total={total}")


def edge() -> None:
    """Through the caching allocator (plain, or expandable segments: PYTORCH_CUDA_ALLOC_CONF)."""
    tensors = to_the_edge()
    del tensors
    torch.cuda.empty_cache()
    print(f"free_after={torch.cuda.mem_get_info()[0]}")


def caching() -> None:
    """The caching allocator keeps freed blocks; refused a new one it frees them and retries."""
    print(f"free_at_start={torch.cuda.mem_get_info()[0]}")
    a = torch.empty(6 * GIB, dtype=torch.uint8, device="cuda")
    del a
    print(f"reserved_held={torch.cuda.memory_reserved()}\nfree_while_held={torch.cuda.mem_get_info()[0]}")
    try:
        b = torch.empty(7 * GIB, dtype=torch.uint8, device="cuda")
        print(f"big_ok=1\nreserved_after_big={torch.cuda.memory_reserved()}")
    except Exception as exc:
        print(f"big_ok=0\nbig_error={first_line(exc)}")
        b = None
    try:
        c = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
        print("more_ok=1")
        del c
    except Exception as exc:
        print(f"more_ok=0\nmore_error={first_line(exc)}")
    del b
    torch.cuda.empty_cache()
    print(f"free_after={torch.cuda.mem_get_info()[0]}")


def graph() -> None:
    """A captured CUDA graph: its memory comes from a private pool of the caching allocator."""
    print(f"free_at_start={torch.cuda.mem_get_info()[0]}")
    x = torch.zeros(GIB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 2  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    print(
        f"replayed=1\nreserved={torch.cuda.memory_reserved()}\nfree_with_graph={torch.cuda.mem_get_info()[0]}"
    )
    del y, g, x
    torch.cuda.empty_cache()
    print(f"free_after={torch.cuda.mem_get_info()[0]}")


def hold() -> None:
    a = torch.empty(5 * GIB, dtype=torch.uint8, device="cuda")
    print(f"held={a.numel()}", flush=True)
    sys.stdin.read()


def second() -> None:
    for size in (5, 2):
        try:
            x = torch.empty(size * GIB, dtype=torch.uint8, device="cuda")
            print(f"second_{size}g=ok")
            del x
        except Exception as exc:
            print(f"second_{size}g={first_line(exc)}")
        torch.cuda.empty_cache()


PATHS = {"info": info, "edge": edge, "caching": caching, "graph": graph, "hold": hold, "second": second}

if __name__ == "__main__":
    PATHS[sys.argv[1]]()
