"""The compatibility matrix's clients: NVIDIA's runtime and CuPy from their PyPI wheels, run on the
driver test double alone and under an 8 GiB slice of a simulated V100 (as `gpuslice-dev shim run
--memory 8Gi --simulate-gpus '1x Tesla V100-PCIE-32GB' -- ...` runs them).

Wheels are fetched once into ~/.cache/gpuslice/wheels (gpuslice_dev.wheels) and used unpacked from
there: nothing is installed into the test environment. Each client runs in its own process and
prints `key=value` facts (tests/shim/clients/); the tests judge them against the device the client
should see.

With GPUSLICE_MATRIX_REAL_GPU=1 (tests/gpu/run.sh) the same tests run on the machine's real GPU and
driver instead of the double: "double" then means the card without the shim.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuslice_dev.devcluster.images import probe_binary
from gpuslice_dev.gpusim import simulate
from gpuslice_dev.gpusim.build import ShimPaths
from gpuslice_dev.gpusim.runner import PreparedSlice
from gpuslice_dev.wheels import ensure_unpacked

GIB = 1 << 30
#: the most a client's loaded kernels' variables hold on the double (PyTorch's: under 1 KiB)
MODULE_VARIABLES_SLACK = 1 << 20
SLICE = 8 * GIB
CLIENTS = Path(__file__).resolve().parent / "clients"

CUDART12 = ("nvidia-cuda-runtime-cu12", "12.9.79")
CUDART13 = ("nvidia-cuda-runtime", "13.0.96")
CUPY = [("cupy-cuda12x", "14.2.0"), ("cuda-pathfinder", "1.3.4"), ("numpy", "2.3.5"), CUDART12]
#: What CuPy's kernels need beyond CUPY: NVRTC to compile them at run time, and cuBLAS (the one
#: PyTorch's wheels bring, so cached once) for cupy.dot.
CUPY_KERNELS = [("nvidia-cuda-nvrtc-cu12", "12.9.86"), ("nvidia-cublas-cu12", "12.8.4.1")]
#: PyTorch 2.9.1 (CUDA 12.8, still with Volta kernels) and what it needs to import and allocate: the
#: libraries libtorch_cuda.so links (cudart, cupti, cublas(Lt), cudnn, cufft, curand, cusparse(Lt),
#: nvJitLink, nccl, nvshmem, cufile) and the Python packages `import torch` imports. Left out as not
#: needed for that: triton, nvrtc, cusolver, nvtx, networkx's and jinja2's users (torch.compile).
TORCH = [
    ("torch", "2.9.1"),
    ("nvidia-cuda-runtime-cu12", "12.8.90"),
    ("nvidia-cuda-cupti-cu12", "12.8.90"),
    ("nvidia-cudnn-cu12", "9.10.2.21"),
    ("nvidia-cublas-cu12", "12.8.4.1"),
    ("nvidia-cufft-cu12", "11.3.3.83"),
    ("nvidia-curand-cu12", "10.3.9.90"),
    ("nvidia-cusparse-cu12", "12.5.8.93"),
    ("nvidia-cusparselt-cu12", "0.7.1"),
    ("nvidia-nccl-cu12", "2.27.5"),
    ("nvidia-nvshmem-cu12", "3.3.20"),
    ("nvidia-nvjitlink-cu12", "12.8.93"),
    ("nvidia-cufile-cu12", "1.13.1.3"),
    ("sympy", "1.14.0"),
    ("mpmath", "1.3.0"),
    ("typing-extensions", "4.15.0"),
    ("filelock", "3.20.0"),
    ("networkx", "3.5"),
    ("jinja2", "3.1.6"),
    ("markupsafe", "3.0.3"),
    ("fsspec", "2025.10.0"),
    ("numpy", "2.3.5"),
]
#: PyTorch 2.15 as PyPI serves it (CUDA 13.2; its libtorch_cuda.so carries sm_75 to sm_120 cubins and
#: no Volta code, no PTX) with the CUDA 13 libraries its libraries link (cuda-toolkit 13.2.2's pins,
#: cuDNN, cuSPARSELt, NCCL, NVSHMEM) and the same Python packages as TORCH. Left out as for TORCH:
#: triton, cusolver's users, nvtx, cuda-bindings (not imported by `import torch`).
TORCH215 = [
    ("torch", "2.15.0"),
    ("nvidia-cuda-runtime", "13.2.86"),
    ("nvidia-cuda-cupti", "13.2.86"),
    ("nvidia-cuda-nvrtc", "13.2.86"),
    ("nvidia-cublas", "13.4.1.3"),
    ("nvidia-cufft", "12.2.0.57"),
    ("nvidia-cufile", "1.17.1.22"),
    ("nvidia-cusparse", "12.7.10.12"),
    ("nvidia-nvjitlink", "13.2.86"),
    ("nvidia-cudnn-cu13", "9.26.0.51"),
    ("nvidia-cusparselt-cu13", "0.8.1"),
    ("nvidia-nccl-cu13", "2.30.7"),
    ("nvidia-nvshmem-cu13", "3.7.2"),
    *[(name, version) for name, version in TORCH if not name.startswith(("torch", "nvidia-"))],
]
#: An NVML monitor as `pip install nvitop` brings it: the tool, the NVML bindings it takes (the newest
#: it accepts) and psutil.
NVITOP = [("nvitop", "1.7.2"), ("nvidia-ml-py", "13.615.71"), ("psutil", "7.2.2")]
#: numba-cuda as `pip install numba-cuda` brings it (numba, llvmlite, NVIDIA's driver bindings and
#: cuda-core, the newest each accepts) and NVVM with libdevice from the nvcc 12.9 wheel, which it
#: compiles kernels with, and the runtime and NVRTC (NUMBA_CUDA_LIBS). No nvJitLink: numba-cuda
#: then links kernels and `link=` files with the driver's own linker (cuLinkCreate ...), through
#: cuda-core.
NUMBA_CUDA = [
    ("numba-cuda", "0.30.4"),
    ("numba", "0.68.1"),
    ("llvmlite", "0.50.0"),
    ("cuda-bindings", "12.9.10"),
    ("cuda-core", "1.2.2"),
    ("cuda-pathfinder", "1.9.1"),
    ("packaging", "26.4"),
    ("numpy", "2.3.5"),
]
NVCC12 = ("nvidia-cuda-nvcc-cu12", "12.9.86")
#: NVIDIA's driver-API bindings alone, as `pip install cuda-bindings==12.9.10` brings them (the
#: cuda-pathfinder they open libcuda.so.1 through); the same wheels numba-cuda's row caches.
CUDA_BINDINGS = [("cuda-bindings", "12.9.10"), ("cuda-pathfinder", "1.9.1")]
NUMBA_CUDA_LIBS = [CUDART12, ("nvidia-cuda-nvrtc-cu12", "12.9.86")]
#: JAX 0.10.2 as `pip install "jax[cuda12]"` brings it: jax, jaxlib, the CUDA 12 plugin and its PJRT
#: library (whose CUDA 12 build still carries sm_70 code), and the CUDA libraries of its `with-cuda`
#: extra at versions that meet its bounds, the ones PyTorch's and numba's rows cache where they do
#: (cuSOLVER is JAX's alone); ptxas from the nvcc wheel compiles its kernels.
JAX = [
    ("jax", "0.10.2"),
    ("jaxlib", "0.10.2"),
    ("jax-cuda12-plugin", "0.10.2"),
    ("jax-cuda12-pjrt", "0.10.2"),
    ("ml-dtypes", "0.5.4"),
    ("opt-einsum", "3.4.0"),
    ("scipy", "1.16.3"),
    ("numpy", "2.3.5"),
    CUDART12,
    ("nvidia-cuda-cupti-cu12", "12.8.90"),
    NVCC12,
    ("nvidia-cuda-nvrtc-cu12", "12.9.86"),
    ("nvidia-cublas-cu12", "12.8.4.1"),
    ("nvidia-cudnn-cu12", "9.10.2.21"),
    ("nvidia-cufft-cu12", "11.3.3.83"),
    ("nvidia-cusolver-cu12", "11.7.3.90"),
    ("nvidia-cusparse-cu12", "12.5.8.93"),
    ("nvidia-nccl-cu12", "2.27.5"),
    ("nvidia-nvjitlink-cu12", "12.8.93"),
    ("nvidia-nvshmem-cu12", "3.3.20"),
]
#: The simulated driver branch each runtime runs on: 535 (CUDA 12.2) for CUDA 12; 580 (CUDA 13.0), the
#: first that starts a CUDA 13 runtime, for CUDA 13.
DRIVER_FOR = {12: "535", 13: "580"}

MODES = ["double", "slice"]
REAL_GPU = os.environ.get("GPUSLICE_MATRIX_REAL_GPU") == "1"


@dataclass(frozen=True)
class RealGpu:
    name: str
    total: int
    cuda_driver_version: int


def real_gpu() -> RealGpu:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return RealGpu(
            name.decode() if isinstance(name, bytes) else str(name),
            int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
            int(pynvml.nvmlSystemGetCudaDriverVersion()),
        )
    finally:
        pynvml.nvmlShutdown()


def cudart(major: int) -> Path:
    if major == 12:
        return ensure_unpacked(*CUDART12) / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"
    return ensure_unpacked(*CUDART13) / "nvidia" / "cu13" / "lib" / "libcudart.so.13"


def cupy_pythonpath() -> str:
    return os.pathsep.join(str(ensure_unpacked(name, version)) for name, version in CUPY)


def cupy_kernels_env(t: Tenant) -> dict[str, str]:
    """CuPy with what compiling and running its kernels takes, as an image with the CUDA toolkit's
    runtime headers, NVRTC and cuBLAS installed has it: the headers under CUDA_PATH (cuda-pathfinder
    looks for them in site-packages, which unpacked wheels are not), the libraries on the loader's
    path ahead of the driver's."""
    libs = [
        str(d)
        for name, version in CUPY_KERNELS
        for d in (ensure_unpacked(name, version) / "nvidia").glob("*/lib")
    ]
    driver = t.env().get("LD_LIBRARY_PATH", "")
    return {
        "PYTHONPATH": cupy_pythonpath(),
        "CUDA_PATH": str(ensure_unpacked(*CUDART12) / "nvidia" / "cuda_runtime"),
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, driver] if driver else libs),
    }


def numba_cuda_env(t: Tenant) -> dict[str, str]:
    """numba-cuda's unpacked wheels on PYTHONPATH; the CUDA toolkit it finds NVVM and libdevice in
    (`CUDA_HOME/nvvm/...`, as an image with the toolkit installed has them): the nvcc wheel's; and
    the runtime it asks its version and NVRTC it asks the architectures (12.9, as its `cu12` extra
    brings them) on the loader's path ahead of the driver's."""
    libs = [str(d) for wheel in NUMBA_CUDA_LIBS for d in (ensure_unpacked(*wheel) / "nvidia").glob("*/lib")]
    driver = t.env().get("LD_LIBRARY_PATH", "")
    return {
        "PYTHONPATH": os.pathsep.join(str(ensure_unpacked(name, version)) for name, version in NUMBA_CUDA),
        "CUDA_HOME": str(ensure_unpacked(*NVCC12) / "nvidia" / "cuda_nvcc"),
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, driver] if driver else libs),
    }


def site_packages(wheels: list[tuple[str, str]], dest: Path) -> Path:
    """`dest` laid out as site-packages is after `pip install` of `wheels`: each wheel's top-level
    entries linked in, and the `nvidia` package that several NVIDIA wheels share (some with an
    `__init__.py`, so it is not a namespace package across separate PYTHONPATH entries) merged."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in wheels:
        for entry in ensure_unpacked(name, version).iterdir():
            if entry.name.startswith(".") or entry.name.endswith(".dist-info"):
                continue
            target = dest / entry.name
            if entry.is_dir() and entry.name == "nvidia":
                target.mkdir(exist_ok=True)
                for sub in entry.iterdir():
                    if not (target / sub.name).exists():
                        (target / sub.name).symlink_to(sub)
            elif not target.exists():
                target.symlink_to(entry)
    return dest


def jax_env(t: Tenant, site: Path) -> dict[str, str]:
    """JAX's wheels as site-packages has them after `pip install "jax[cuda12]"` (the plugin finds
    ptxas, libdevice and its CUDA libraries in the `nvidia.*` packages there), and those libraries on
    the loader's path ahead of the driver's: the links in `site` hide the RUNPATHs ($ORIGIN/../../
    nvjitlink/lib) that find one wheel's library from another's in a real site-packages."""
    libs = sorted(str(d) for d in (site / "nvidia").glob("*/lib"))
    driver = t.env().get("LD_LIBRARY_PATH", "")
    return {"PYTHONPATH": str(site), "LD_LIBRARY_PATH": os.pathsep.join([*libs, driver] if driver else libs)}


def nvitop_pythonpath() -> str:
    return os.pathsep.join(str(ensure_unpacked(name, version)) for name, version in NVITOP)


def torch_env(t: Tenant, wheels: list[tuple[str, str]] = TORCH) -> dict[str, str]:
    """PYTHONPATH of the unpacked wheels, and their libraries on the loader's path (as an image with
    the CUDA libraries installed has them), ahead of the driver's."""
    roots = [ensure_unpacked(name, version) for name, version in wheels]
    libs = sorted(str(d) for root in roots for d in (root / "nvidia").glob("*/lib"))
    driver = t.env().get("LD_LIBRARY_PATH", "")
    return {
        "PYTHONPATH": os.pathsep.join(map(str, roots)),
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, driver] if driver else libs),
    }


@dataclass
class Tenant:
    """Where a client runs: the double alone (`shim=False`) or under the slice; what it should see."""

    prepared: PreparedSlice
    shim: bool
    total: int  # the memory the client must see: the slice's, or the whole card's
    name: str
    real: bool = False  # a real GPU: other processes and contexts may hold some of its memory
    #: what the client's command line starts with (container_dev(): /dev as a slice container has it)
    prefix: tuple[str, ...] = ()

    def available(self, free_at_start: int) -> int:
        """What the client can allocate: everything it is shown on the double, what is free on a card."""
        return free_at_start if self.real else self.total

    def given_back(self, free_after: int, free_at_start: int) -> bool:
        """Whether a path gave back what it took. The driver keeps a loaded module's variables
        (__device__, __constant__) in device memory until the module is unloaded, and frameworks never
        unload their kernels: on the double (which charges them to the card as a driver does, and the
        shim to the slice) they may stay, up to MODULE_VARIABLES_SLACK."""
        room = self.available(free_at_start)
        if self.real:
            return free_after == room
        return room - MODULE_VARIABLES_SLACK <= free_after <= room

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.prepared.env, **(extra or {})}
        if not self.shim:
            env.pop("LD_PRELOAD", None)
        return env

    def run(self, argv: list[str], *, extra_env: dict[str, str] | None = None, timeout: float = 180):
        return subprocess.run(
            [*self.prefix, sys.executable, *argv],
            env=self.env(extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def popen(self, argv: list[str], *, extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*self.prefix, sys.executable, *argv],
            env=self.env(extra_env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def tenant(make_slice, mode: str, driver: str = "535") -> Tenant:
    """A V100 on the simulated `driver` branch, whole (mode "double") or an 8 GiB slice of it."""
    shim = mode == "slice"
    if REAL_GPU:
        gpu = real_gpu()
        needs = simulate.driver_versions(driver)[1]
        if gpu.cuda_driver_version < needs:
            pytest.skip(f"the GPU's driver serves CUDA {gpu.cuda_driver_version}; this client needs {needs}")
        prepared = make_slice(memory_bytes=SLICE, simulate_gpus=None)
        return Tenant(prepared, shim, SLICE if shim else gpu.total, gpu.name, real=True)
    prepared = make_slice(memory_bytes=SLICE, driver=driver)
    gpus = prepared.fake_gpus
    assert gpus
    return Tenant(prepared, shim, SLICE if shim else gpus[0].memory_bytes, gpus[0].name)


#: Mounts /dev anew in a private mount namespace: an overlay of the host's /dev with the files of
#: $1 (the NVIDIA device nodes) on top, the host's mounts under /dev (shm, pts, mqueue) bound back.
_CONTAINER_DEV = r"""set -e
keep=$1/host-dev; mkdir -p "$keep" "$1/work"
mount --rbind /dev "$keep"
mount -t overlay gpuslice-dev -o "lowerdir=/dev,upperdir=$1/nodes,workdir=$1/work" /dev
awk '$2 ~ "^/dev/." {print $2}' /proc/self/mounts | while read -r m; do
    rest=${m#/dev/}
    case $rest in */*) continue ;; esac
    [ -d "/dev/$rest" ] && mount --rbind "$keep/$rest" "/dev/$rest"
done
shift; exec "$@"
"""


def container_dev(t: Tenant, workdir: Path) -> Tenant:
    """`t` with its clients started where /dev has NVIDIA's device nodes, as in a slice container
    (`/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia<minor>` of its card): some frameworks look
    for them before they load the driver (JAX starts its CUDA backend only if /dev/nvidia0 or
    /dev/nvidiactl exists). The double then shows the process only the cards whose node it can
    reach, as the driver does. A real GPU's host has its nodes already."""
    if t.real:
        return t
    gpus = t.prepared.fake_gpus or []
    nodes = workdir / "nodes"
    nodes.mkdir(parents=True, exist_ok=True)
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{g.minor}" for g in gpus)]:
        (nodes / name).touch()
    unshare = ("unshare", "--mount", "--propagation", "private")
    return dataclasses.replace(t, prefix=(*unshare, "sh", "-c", _CONTAINER_DEV, "sh", str(workdir)))


def facts(out: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line.split("=")[0]
    )


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


class Probe:
    """gpuslice-probe `hold SIZE 0` (or `burn SECONDS`) in the tenant, until closed."""

    def __init__(self, t: Tenant, built: ShimPaths, *args: str, ready: str | None) -> None:
        self.proc = subprocess.Popen(
            [str(probe_binary(built)), *args],
            env=t.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if ready is not None:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline().strip()
            assert line.startswith(ready), (line, self.proc.stderr.read() if self.proc.stderr else "")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Server:
    """One long-lived client process (`SCRIPT serve`) answering many paths: for a client whose
    import is the cost (PyTorch). `ask(path)` sends the path and returns its facts."""

    def __init__(self, t: Tenant, argv: list[str], *, extra_env: dict[str, str] | None = None) -> None:
        self.tenant = t
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [*t.prefix, sys.executable, *argv, "serve"],
            env=t.env(extra_env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.transcript: list[str] = []

    def ask(self, path: str) -> dict[str, str]:
        self.send(path)
        return self.receive(path)

    def send(self, path: str) -> None:
        """Starts `path` without waiting for it (receive() reads its facts): several clients can
        then run a path at once."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()

    def receive(self, path: str) -> dict[str, str]:
        assert self.proc.stdout is not None
        out: list[str] = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the client exited during {path!r}: {self.explain(out)}")
            if line.strip() == f"end={path}":
                break
            out.append(line)
        self.transcript += out
        f = facts("".join(out))
        assert "path_error" not in f, f"{path}: {f['path_error']}\n{self.explain(out)}"
        return f

    def explain(self, out: list[str] | None = None) -> str:
        self.stderr.seek(0)
        return (
            f"--- stdout\n{''.join(out or self.transcript)[-3000:]}\n--- stderr\n{self.stderr.read()[-3000:]}"
        )

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


class Holder:
    """A client process that allocates, prints the fact `ready`, and holds until closed."""

    def __init__(
        self, t: Tenant, argv: list[str], ready: str, extra_env: dict[str, str] | None = None
    ) -> None:
        self.proc = t.popen(argv, extra_env=extra_env)
        self.ready = ready

    def __enter__(self) -> Holder:
        assert self.proc.stdout is not None
        key = self.ready.split("=", 1)[0] + "="
        line = "-"
        while line and not line.startswith(key):  # facts printed before (torch's import time)
            line = self.proc.stdout.readline().strip()
        if line != self.ready:
            self.__exit__()
            raise AssertionError(
                f"the holding process said {line!r}, not {self.ready!r}: {self.stderr[-3000:]}"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr = self.proc.stderr.read() if self.proc.stderr else ""

    stderr = ""
