"""Pure CDI spec for one prepared claim: what the container runtime injects into a slice's containers.

The spec bind-mounts (all read-only except the usage region):
- a file naming the shim over `/etc/ld.so.preload`, so the dynamic loader injects libgpuslice.so into
  every process even when the tenant unsets LD_PRELOAD;
- the shim library itself;
- the slice's limits file at the fixed path the shim reads (never environment variables);
- the slice's utilization file next to it (the agent's measurement, from host PIDs, which the shim's
  throttle steers on; read-only, so a tenant cannot fake it);
- the slice's usage region, shared by all processes of the slice: the file alone, read-write, at
  `<usage_dir>/usage.bin`; not its host directory, so the tenant can neither replace the file (with a
  FIFO or a link the root agent would open) nor add files beside it on the host's storage (what it
  writes next to it goes to the container's own writable layer, counted in its ephemeral storage).
The NVIDIA device of the card is not described here: the agent returns its CDI id
(`nvidia.com/gpu=<uuid>`, from the NVIDIA container toolkit's spec) next to ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from gpuslice import constants as c
from gpuslice.shim.region import REGION_FILE, utilization_file_for

CDI_VERSION: Final = "0.6.0"
CDI_KIND: Final = f"{c.CDI_VENDOR}/{c.CDI_CLASS}"
NVIDIA_CDI_KIND: Final = "nvidia.com/gpu"


def cdi_device_name(claim_uid: str) -> str:
    """One CDI device per claim; claim UIDs are unique and valid CDI device names."""
    return claim_uid


def cdi_device_id(claim_uid: str) -> str:
    return f"{CDI_KIND}={cdi_device_name(claim_uid)}"


def nvidia_device_id(gpu_uuid: str) -> str:
    return f"{NVIDIA_CDI_KIND}={gpu_uuid}"


def spec_file_name(claim_uid: str) -> str:
    return f"{c.CDI_VENDOR}-{c.CDI_CLASS}-{claim_uid}.json"


def _ro(host: Path | str, container: str) -> dict[str, Any]:
    return {"hostPath": str(host), "containerPath": container, "options": ["ro", "nosuid", "nodev", "bind"]}


def build_spec(
    claim_uid: str, *, preload_file: Path, shim_library: Path, limits_file: Path, usage_dir: Path
) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {
                "name": cdi_device_name(claim_uid),
                "containerEdits": {
                    "mounts": [
                        _ro(preload_file, c.CONTAINER_LD_SO_PRELOAD),
                        _ro(shim_library, c.CONTAINER_SHIM_PATH),
                        _ro(limits_file, c.CONTAINER_CONFIG_PATH),
                        _ro(
                            utilization_file_for(limits_file),
                            str(utilization_file_for(c.CONTAINER_CONFIG_PATH)),
                        ),
                        {
                            "hostPath": str(usage_dir / REGION_FILE),
                            "containerPath": f"{c.CONTAINER_USAGE_DIR}/{REGION_FILE}",
                            "options": ["rw", "nosuid", "nodev", "noexec", "bind"],
                        },
                    ],
                },
            }
        ],
    }


# ---------------------------------------------------------------- MIG
# A MIG claim's container gets its instance and nothing more, as NVIDIA's own tooling hands out a MIG
# device (nvidia-container-toolkit's dgpu MIG discoverer, k8s-dra-driver-gpu's GetDevNodesForMigDevice):
# the parent card's /dev/nvidia<minor>, the control devices, and the two capability devices of its
# GPU instance and compute instance, /dev/nvidia-caps/nvidia-cap<minor>, whose minors the kernel
# module lists in /proc/driver/nvidia-caps/mig-minors. Opening a MIG instance takes both of its
# capabilities, so a container without another instance's cap devices cannot use that instance; the
# card's own CDI device is not handed out (nor `config`/`monitor`, which make and watch instances).

MIG_CAPS_DEVICE: Final = "nvidia-caps"
CONTAINER_CAPS_DIR: Final = "/dev/nvidia-caps"
#: the NVIDIA driver's fixed major (nvidia-frontend): /dev/nvidia<minor>, /dev/nvidiactl (255)
NVIDIA_MAJOR: Final = 195
#: the card-independent device nodes of the toolkit's spec a MIG container keeps
CONTROL_NODES: Final = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


class MigCdiError(Exception):
    """What the node does not show that a MIG claim's CDI spec needs."""


def parse_mig_minors(text: str) -> dict[str, int]:
    """`gpu<N>/gi<G>/access 3`-lines (and `config 1`, `monitor 2`) -> minor by capability path;
    lines of another form are skipped, as the toolkit's parser does."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def char_major(proc_devices: str, name: str) -> int | None:
    """The major of character device `name` in /proc/devices (its "Character devices:" part)."""
    in_chars = False
    for line in proc_devices.splitlines():
        if line.strip().endswith(":"):
            in_chars = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if in_chars and len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


def gi_cap(gpu_minor: int, gi: int) -> str:
    return f"gpu{gpu_minor}/gi{gi}/access"


def ci_cap(gpu_minor: int, gi: int, ci: int) -> str:
    return f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"


def _char_node(path: str, major: int, minor: int) -> dict[str, Any]:
    # type, major and minor given: the runtime makes the node in the container without one on the host
    return {"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666}


def mig_device_nodes(
    gpu_minor: int, gi: int, ci: int, *, minors: dict[str, int], caps_major: int
) -> list[dict[str, Any]]:
    """The instance's two capability devices (GPU instance, then compute instance)."""
    nodes = []
    for cap in (gi_cap(gpu_minor, gi), ci_cap(gpu_minor, gi, ci)):
        if cap not in minors:
            raise MigCdiError(f"/proc/driver/nvidia-caps/mig-minors lists no {cap}")
        nodes.append(_char_node(f"{CONTAINER_CAPS_DIR}/nvidia-cap{minors[cap]}", caps_major, minors[cap]))
    return nodes


def build_mig_spec(
    claim_uid: str,
    *,
    mig_uuid: str,
    gpu_minor: int,
    gi: int,
    ci: int,
    minors: dict[str, int],
    caps_major: int,
    toolkit: dict[str, Any],
    card_uuid: str,
) -> dict[str, Any]:
    """The claim's one CDI device: the MIG device named to CUDA and NVML, its device nodes, and of
    the NVIDIA toolkit's spec (`toolkit`, kind nvidia.com/gpu) only what is not a device: the
    driver's libraries and hooks, and the control nodes. No shim and no limits: the driver keeps the
    instance's memory and SMs."""
    common = dict(toolkit.get("containerEdits") or {})
    control = [n for n in common.get("deviceNodes") or () if n.get("path") in CONTROL_NODES]
    card_path = f"/dev/nvidia{gpu_minor}"
    card = next(
        (
            n
            for d in toolkit.get("devices") or ()
            if d.get("name") == card_uuid
            for n in (d.get("containerEdits") or {}).get("deviceNodes") or ()
            if n.get("path") == card_path
        ),
        _char_node(card_path, NVIDIA_MAJOR, gpu_minor),
    )
    edits: dict[str, Any] = {
        "env": [
            *(e for e in common.get("env") or () if not e.startswith("NVIDIA_VISIBLE_DEVICES=")),
            f"CUDA_VISIBLE_DEVICES={mig_uuid}",
            f"NVIDIA_VISIBLE_DEVICES={mig_uuid}",
        ],
        "deviceNodes": [
            card,
            *control,
            *mig_device_nodes(gpu_minor, gi, ci, minors=minors, caps_major=caps_major),
        ],
    }
    for key in ("mounts", "hooks"):
        if common.get(key):
            edits[key] = list(common[key])
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{"name": cdi_device_name(claim_uid), "containerEdits": edits}],
    }
