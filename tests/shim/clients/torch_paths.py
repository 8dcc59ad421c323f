"""A PyTorch tenant (torch 2.9.1 from PyPI, built on CUDA 12.8, with the nvidia-* wheels it links).

    python torch_paths.py PATH     one path, then exit
    python torch_paths.py serve    one path per line read from stdin, each answered by its facts and
                                   the line `end=PATH`, until stdin closes

`import torch` is the cost (a 1 GB libtorch_cuda.so): `serve` pays it once for many paths. Each
path leaves the process as it found it (its tensors freed, the allocator's cache emptied, cuBLAS
workspaces cleared) and checks that. Prints `key=value` facts for the test to judge; PyTorch's own
exceptions are reported by type and the first line of their message.
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


def expandable_edge() -> None:
    """To the edge with expandable segments (the driver's VMM), switched on in this process."""
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        edge()
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def train() -> None:
    """A tiny training loop: Linear + AdamW for a few steps (cuBLAS handles and their workspaces,
    the caching allocator), then everything given back. The double runs no kernels: the loss is
    whatever the memory holds, so only memory and API results are judged."""
    print(f"free_at_start={torch.cuda.mem_get_info()[0]}")
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 16)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")
    y = torch.randn(256, 16, device="cuda")
    steps = 0
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
    torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
    )
    print(f"steps={steps}\nloss_is_float={int(isinstance(loss.item(), float))}")
    print(f"param_bytes={params}\nadam_state_bytes={state}")
    print(f"allocated={torch.cuda.memory_allocated()}\nreserved={torch.cuda.memory_reserved()}")
    print(f"max_allocated={torch.cuda.max_memory_allocated()}")
    summary = torch.cuda.memory_summary()
    print(f"summary_ooms={summary.split('CUDA OOMs:')[1].split()[0] if 'CUDA OOMs:' in summary else '?'}")
    print(f"free_while_training={torch.cuda.mem_get_info()[0]}")
    del model, opt, x, y, loss
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    print(f"allocated_after={torch.cuda.memory_allocated()}\nreserved_after={torch.cuda.memory_reserved()}")
    print(f"free_after={torch.cuda.mem_get_info()[0]}")


def fraction() -> None:
    """set_per_process_memory_fraction(0.5): the allocator's own cap is half of what the device shows
    (the slice under the shim), reported in memory_stats and enforced with its OutOfMemoryError."""
    free, total = torch.cuda.mem_get_info()
    print(f"free_at_start={free}\ntotal={total}")
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        held = []
        try:
            while len(held) < 1024:
                held.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
        except Exception as exc:
            print(f"fraction_blocks={len(held)}\nfraction_error={first_line(exc)}")
        stats = torch.cuda.memory_stats()
        print(f"ooms={stats.get('num_ooms', '?')}\nreserved_at_cap={torch.cuda.memory_reserved()}")
        summary = torch.cuda.memory_summary()
        print(f"summary_has_reserved={int('GPU reserved memory' in summary)}")
        del held
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
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


def serve() -> None:
    for line in sys.stdin:
        path = line.strip()
        try:
            PATHS[path]()
        except Exception as exc:  # the test sees it as a fact, the next path still runs
            print(f"path_error={first_line(exc)}")
            del exc  # its traceback holds the path's tensors
            torch._C._cuda_clearCublasWorkspaces()  # a failed GEMM's workspace is the allocator's too
            torch.cuda.empty_cache()
        print(f"end={path}", flush=True)


PATHS = {
    "info": info,
    "edge": edge,
    "expandable-edge": expandable_edge,
    "caching": caching,
    "graph": graph,
    "train": train,
    "fraction": fraction,
    "hold": hold,
    "second": second,
}

if __name__ == "__main__":
    serve() if sys.argv[1] == "serve" else PATHS[sys.argv[1]]()
