"""GpuPackage -> its DeviceClass: selects exactly that package's devices of DRA driver gpuslice.io."""

from __future__ import annotations

from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.ownership import managed_labels, owner_reference


def device_selector_expression(package: str, spec: GpuPackageSpec) -> str:
    """CEL the scheduler evaluates per device.

    The agent publishes one partition device per package that fits a GPU, with attribute `package`;
    `productName` is checked too so a package whose gpuModel was changed never matches stale devices.
    """
    domain = c.DRIVER_NAME
    return (
        f'device.driver == "{c.DRIVER_NAME}"'
        f' && device.attributes["{domain}"].package == {_cel_string(package)}'
        f' && device.attributes["{domain}"].productName == {_cel_string(spec.gpu_model)}'
    )


def _cel_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def device_class(package: str, package_uid: str | None, spec: GpuPackageSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": c.device_class_name(package),
        "labels": managed_labels(package=package),
    }
    if package_uid:
        meta["ownerReferences"] = [owner_reference(c.PACKAGE_KIND, package, package_uid)]
    return {
        "apiVersion": f"{c.DRA_GROUP}/{c.DRA_VERSION}",
        "kind": "DeviceClass",
        "metadata": meta,
        "spec": {"selectors": [{"cel": {"expression": device_selector_expression(package, spec)}}]},
    }
