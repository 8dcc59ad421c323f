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
