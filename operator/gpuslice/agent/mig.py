"""Dynamic MIG at prepare: the allocated placement's GPU and compute instance made when kubelet
prepares the claim, destroyed when it unprepares it.

Dynamic rather than a static layout the platform sets: the card publishes every placement of every
profile sold, and kube-scheduler's counters pick a placement that does not overlap what is in use, so
one card serves whatever mix of 1g/2g/3g/4g/7g the pods ask for, and an instance exists only while a
pod holds it. A static layout would sell only the instances someone made in advance. The driver keeps
the instance's memory and SMs: no shim limit is needed, and the container gets only its MIG device's
nodes (its GPU and compute instance capability devices, not the card's CDI device: `cdi.build_mig_spec`).

Both calls are idempotent across an agent restart: `nvml.mig_create` returns the instance already at
the placement (a killed agent that made it but did not record it), and destroying finds the instance
by its placement when its UUID was never recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice import logs
from gpuslice.agent import cdi, nvml
from gpuslice.agent.checkpoint import PreparedDevice

log = logs.get(__name__)


class MigPrepareError(Exception):
    """The driver refused to make or remove the instance; the message goes back to kubelet."""


def create(device: PreparedDevice) -> tuple[nvml.MigInstance, int]:
    """The instance of `device`'s profile at its placement (made if not there) and its card's minor."""
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
            if device.mig_static:
                made = next(
                    (
                        i
                        for i in nvml.mig_instances(device.gpu_uuid)
                        if i.profile_id == profile.id and i.start == device.mig_start
                    ),
                    None,
                )
                if made is None:
                    raise MigPrepareError(
                        f"the static MIG layout of GPU {device.gpu_uuid} has no {device.mig_profile} "
                        f"instance at memory slice {device.mig_start} any more (removed since the agent "
                        "started?); restart the agent after changing the layout"
                    )
            else:
                made = nvml.mig_create(device.gpu_uuid, profile, device.mig_start)
            return made, nvml.minor_number(device.gpu_uuid)
    except (nvml.MigError, nvml.Error) as exc:
        raise MigPrepareError(
            f"creating MIG instance {device.mig_profile} at memory slice {device.mig_start} on GPU "
            f"{device.gpu_uuid}: {exc}"
        ) from exc


def destroy(device: PreparedDevice) -> None:
    """Remove the instance of `device`; nothing when it is gone. Raises MigPrepareError while a
    process still uses it (kubelet retries the unprepare). An instance of a static layout stays."""
    if device.mig_static:
        return
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


def proc_root() -> Path:
    return Path(os.environ.get(c.PROC_ROOT_ENV) or c.PROC_ROOT)


def nvidia_cdi_dirs() -> list[Path]:
    raw = os.environ.get(c.NVIDIA_CDI_DIRS_ENV)
    return [Path(d) for d in (raw.split(":") if raw else c.NVIDIA_CDI_DIRS) if d]


#: Parsed files by path, with the (mtime, size) they were read at: mig-minors and the toolkit's spec
#: change only when the driver or the toolkit is reinstalled, and parsing them took about 10 ms of
#: each prepare.
_PARSED: dict[Path, tuple[tuple[int, int], Any]] = {}
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parsed(path: Path, parse: Callable[[str], Any]) -> Any:
    st = path.stat()
    key = (st.st_mtime_ns, st.st_size)
    hit = _PARSED.get(path)
    if hit is None or hit[0] != key:
        hit = (key, parse(path.read_text()))
        _PARSED[path] = hit
    return hit[1]


def _spec_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return yaml.load(text, Loader=_YAML_LOADER)  # CSafeLoader or SafeLoader: safe


def toolkit_spec(dirs: list[Path]) -> dict[str, Any]:
    """The NVIDIA container toolkit's CDI spec (kind nvidia.com/gpu, JSON or YAML) in `dirs`."""
    for d in dirs:
        for path in sorted(d.glob("*")) if d.is_dir() else ():
            if path.suffix not in (".json", ".yaml", ".yml"):
                continue
            try:
                spec = _parsed(path, _spec_text)
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(spec, dict) and spec.get("kind") == cdi.NVIDIA_CDI_KIND:
                return spec
    raise MigPrepareError(
        f"no NVIDIA container toolkit CDI spec (kind {cdi.NVIDIA_CDI_KIND}) in "
        f"{', '.join(map(str, dirs))}: a MIG container would get no driver libraries; run "
        f"`nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml` or set {c.NVIDIA_CDI_DIRS_ENV}"
    )


def cdi_spec(claim_uid: str, instance: nvml.MigInstance, gpu_minor: int) -> dict[str, Any]:
    """The claim's CDI spec: only its MIG device (`cdi.build_mig_spec`), with the capability minors
    and the nvidia-caps major as this node's kernel module lists them."""
    proc = proc_root()
    try:
        minors = _parsed(proc / "driver" / "nvidia-caps" / "mig-minors", cdi.parse_mig_minors)
        major = cdi.char_major((proc / "devices").read_text(), cdi.MIG_CAPS_DEVICE)
    except OSError as exc:
        raise MigPrepareError(f"reading the NVIDIA capability devices under {proc}: {exc}") from exc
    if major is None:
        raise MigPrepareError(f"{proc}/devices lists no {cdi.MIG_CAPS_DEVICE} character device")
    try:
        return cdi.build_mig_spec(
            claim_uid,
            mig_uuid=instance.uuid,
            gpu_minor=gpu_minor,
            gi=instance.gpu_instance_id,
            ci=instance.compute_instance_id,
            minors=minors,
            caps_major=major,
            toolkit=toolkit_spec(nvidia_cdi_dirs()),
            card_uuid=instance.gpu_uuid,
        )
    except cdi.MigCdiError as exc:
        raise MigPrepareError(str(exc)) from exc
