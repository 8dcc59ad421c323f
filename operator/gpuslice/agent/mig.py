"""Dynamic MIG at prepare: the allocated placement's GPU and compute instance made when kubelet
prepares the claim, destroyed when it unprepares it.

Dynamic rather than a static layout the platform sets: the card publishes every placement of every
profile sold, and kube-scheduler's counters pick a placement that does not overlap what is in use, so
one card serves whatever mix of 1g/2g/3g/4g/7g the pods ask for, and an instance exists only while a
pod holds it. A static layout would sell only the instances someone made in advance. The driver keeps
the instance's memory and SMs: no shim limit is needed, the container sees only its MIG device.

Both calls are idempotent across an agent restart: `nvml.mig_create` returns the instance already at
the placement (a killed agent that made it but did not record it), and destroying finds the instance
by its placement when its UUID was never recorded.
"""

from __future__ import annotations

from typing import Any

from gpuslice import logs
from gpuslice.agent import nvml
from gpuslice.agent.checkpoint import PreparedDevice

log = logs.get(__name__)


class MigPrepareError(Exception):
    """The driver refused to make or remove the instance; the message goes back to kubelet."""


def create(device: PreparedDevice) -> str:
    """The MIG UUID of the instance of `device`'s profile at its placement, made if not there."""
    assert device.mig_profile is not None and device.mig_start is not None
    try:
        with nvml.session():
            profile = next(
                (p for p in nvml.mig_profiles(device.gpu_uuid) if p.name == device.mig_profile), None
            )
            if profile is None:
                raise MigPrepareError(
                    f"GPU {device.gpu_uuid} has no MIG profile {device.mig_profile} (is MIG mode still on?)"
                )
            return nvml.mig_create(device.gpu_uuid, profile, device.mig_start).uuid
    except (nvml.MigError, nvml.Error) as exc:
        raise MigPrepareError(
            f"creating MIG instance {device.mig_profile} at memory slice {device.mig_start} on GPU "
            f"{device.gpu_uuid}: {exc}"
        ) from exc


def destroy(device: PreparedDevice) -> None:
    """Remove the instance of `device`; nothing when it is gone. Raises MigPrepareError while a
    process still uses it (kubelet retries the unprepare)."""
    try:
        with nvml.session():
            uuid = device.mig_uuid
            if uuid is None:  # made by an agent killed before it recorded the UUID
                uuid = next(
                    (
                        i.uuid
                        for i in nvml.mig_instances(device.gpu_uuid)
                        if i.start == device.mig_start
                        and _profile_name(device.gpu_uuid, i.profile_id) == device.mig_profile
                    ),
                    None,
                )
            if uuid is not None and nvml.mig_destroy(device.gpu_uuid, uuid):
                return
    except (nvml.MigError, nvml.Error) as exc:
        raise MigPrepareError(
            f"destroying MIG instance {device.mig_uuid} on GPU {device.gpu_uuid}: {exc}"
        ) from exc


def _profile_name(gpu_uuid: str, profile_id: int) -> str | None:
    return next((p.name for p in nvml.mig_profiles(gpu_uuid) if p.id == profile_id), None)


def cdi_spec(claim_uid: str, kind: str, name: str, mig_uuid: str) -> dict[str, Any]:
    """The claim's CDI device: only the MIG device named to CUDA (and NVML), no shim, no limits file:
    the driver enforces the instance's memory."""
    return {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "devices": [
            {
                "name": name,
                "containerEdits": {
                    "env": [f"CUDA_VISIBLE_DEVICES={mig_uuid}", f"NVIDIA_VISIBLE_DEVICES={mig_uuid}"]
                },
            }
        ],
    }
