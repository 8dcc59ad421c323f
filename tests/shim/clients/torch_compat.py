"""A PyTorch tenant's first GPU work, as a new user's script does it: import, look at the device,
put a tensor on it and compute with it. Run with any PyTorch wheel (2.9.1 built on CUDA 12.8, 2.15
on CUDA 13.2). Prints `key=value` facts; PyTorch's own exception by type and first line.

The double runs no kernels: what is judged is whether the runtime and the driver accept the
kernels for the device (a build without the device's architecture fails at its first kernel with
"no kernel image is available for execution on the device"), not computed values.
"""

from __future__ import annotations

import time

t0 = time.monotonic()
import torch  # noqa: E402

print(f"import_s={time.monotonic() - t0:.2f}", flush=True)


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


print(f"torch={torch.__version__}\ncuda={torch.version.cuda}")
print(f"arch_list={','.join(torch.cuda.get_arch_list())}")
print(f"available={int(torch.cuda.is_available())}", flush=True)
props = torch.cuda.get_device_properties(0)
print(f"name={props.name}\ncc={props.major}.{props.minor}", flush=True)
t1 = time.monotonic()
try:
    x = torch.ones(1024, device="cuda")  # the context, then a fill kernel
    y = x * 2 + 1  # an elementwise kernel
    torch.cuda.synchronize()
    print("kernels_ok=1")
except Exception as exc:  # torch.AcceleratorError (2.8+) or RuntimeError
    print(f"kernels_ok=0\nkernel_error={first_line(exc)}")
print(f"first_kernels_s={time.monotonic() - t1:.3f}", flush=True)
