"""The NVIDIA container toolkit's part on a simulated node: its CDI spec, as `nvidia-ctk cdi generate`
writes it, over the driver test double.

One device per GPU, by index and by UUID (`nvidia.com/gpu=0`, `nvidia.com/gpu=GPU-...`) plus `all`;
each brings its `/dev/nvidia<minor>` node. Edits common to every device: the control device nodes,
the driver's user-space libraries mounted at the paths the loader searches (here the double's
`libcuda.so.1` and `libnvidia-ml.so.1`, where the real toolkit's hooks would make the same names),
`NVIDIA_VISIBLE_DEVICES=void` so an NVIDIA runtime hook inside the container does nothing more, and
what stands in for the kernel module: the node's GPU description and the double's host daemon socket
under `/run/nvidia-fake` (the double looks there, as the real driver needs no environment), mounted
read-only like everything the driver brings: the double's state is the daemon's (gpuslice-fake-driverd
owns it, clients map it read-only and change it only through requests on the socket, which a
read-only mount still lets them connect to), as the real driver's state is the kernel's.

Device nodes are real character devices (major 195, the NVIDIA driver's) made under the node's
directory: the runtime creates them in the container and allows them in its device cgroup exactly
as for a real card; opening one fails (no driver behind it), which the double never needs.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Final

from gpuslice.files import atomic_write
from gpuslice_dev.gpusim.simulate import FakeGpu

KIND: Final = "nvidia.com/gpu"
CDI_VERSION: Final = "0.6.0"
NVIDIA_MAJOR: Final = 195
#: where the double looks for its GPU description when GPUSLICE_FAKE_GPU_CONFIG is unset
CONTAINER_DRIVER_DIR: Final = "/run/nvidia-fake"
CONTAINER_LIB_DIR: Final = "/usr/lib/x86_64-linux-gnu"
SPEC_FILE: Final = "nvidia.com-gpu.json"


def _char_device(path: Path, minor: int, major: int = NVIDIA_MAJOR) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    want = os.makedev(major, minor)
    try:
        st = path.lstat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return path
        path.unlink()
    except FileNotFoundError:
        pass
    os.mknod(path, 0o666 | stat.S_IFCHR, want)
    return path


def _node(container: str, host: Path) -> dict[str, Any]:
    return {"path": container, "hostPath": str(host)}


def _mount(host: Path, container: str, options: list[str]) -> dict[str, Any]:
    return {"hostPath": str(host), "containerPath": container, "options": options}


def build_spec(
    gpus: list[FakeGpu], *, dev_dir: Path, driver_dir: Path, fake_cuda: Path, fake_nvml: Path
) -> dict[str, Any]:
    """The spec (pure, given where the device nodes and the double's files are on the host)."""
    per_gpu = [_node(f"/dev/nvidia{g.minor}", dev_dir / f"nvidia{g.minor}") for g in gpus]
    devices: list[dict[str, Any]] = []
    for g, node in zip(gpus, per_gpu, strict=True):
        for name in (str(g.index), g.uuid):
            devices.append({"name": name, "containerEdits": {"deviceNodes": [node]}})
    devices.append({"name": "all", "containerEdits": {"deviceNodes": per_gpu}})
    ro = ["ro", "nosuid", "nodev", "bind"]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [
                _node("/dev/nvidiactl", dev_dir / "nvidiactl"),
                _node("/dev/nvidia-uvm", dev_dir / "nvidia-uvm"),
                _node("/dev/nvidia-uvm-tools", dev_dir / "nvidia-uvm-tools"),
            ],
            "mounts": [
                _mount(fake_cuda, f"{CONTAINER_LIB_DIR}/libcuda.so.1", ro),
                _mount(fake_nvml, f"{CONTAINER_LIB_DIR}/libnvidia-ml.so.1", ro),
                # The kernel module's part: its state is the daemon's, no container writes it.
                _mount(driver_dir, CONTAINER_DRIVER_DIR, ["ro", "nosuid", "nodev", "noexec", "bind"]),
            ],
        },
    }


def write_spec(gpus: list[FakeGpu], *, gpu_dir: Path, driver_dir: Path, cdi_dir: Path) -> Path:
    """Make the device nodes under `<gpu_dir>/dev` and write the spec into `cdi_dir`."""
    from gpuslice_dev.gpusim.build import ensure_built

    built = ensure_built()
    dev_dir = gpu_dir / "dev"
    for g in gpus:
        _char_device(dev_dir / f"nvidia{g.minor}", g.minor)
    _char_device(dev_dir / "nvidiactl", 255)
    _char_device(dev_dir / "nvidia-uvm", 0, major=511)
    _char_device(dev_dir / "nvidia-uvm-tools", 1, major=511)
    spec = build_spec(
        gpus, dev_dir=dev_dir, driver_dir=driver_dir, fake_cuda=built.fake_cuda, fake_nvml=built.fake_nvml
    )
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = cdi_dir / SPEC_FILE
    atomic_write(path, json.dumps(spec, indent=2))
    return path
