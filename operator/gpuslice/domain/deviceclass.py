"""GpuPackage -> its DeviceClass: selects exactly that package's devices of DRA driver gpuslice.io,
and names the extended resource (`gpuslice.io/<package>` unless the package chose another or none)
that kube-scheduler serves from the class: a container's `resources.limits: {gpuslice.io/<package>: 1}`
gets a claim for one device of it, made by the scheduler for the pod."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpuslice import constants as c
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain.mig import package_profile
from gpuslice.domain.ownership import managed_labels, owner_reference


def device_selector_expression(package: str, spec: GpuPackageSpec) -> str:
    """CEL the scheduler evaluates per device.

    The agent publishes one partition device per package that fits a GPU, with attribute `package`;
    `productName` is checked too so a package whose gpuModel was changed never matches stale devices.
    A card in MIG mode publishes instead one device per MIG placement, with attribute `migProfile`
    and no `package`: a Hardware package selects those of its profile. Each side tests that its
    attribute exists first, because a selector that reads a device's missing attribute is a CEL
    runtime error, and kube-scheduler then fails the whole claim instead of skipping the device.
    """
    domain = c.DRIVER_NAME
    attrs = f'device.attributes["{domain}"]'
    profile = package_profile(spec)
    if spec.hardware:
        if profile is None:
            # no MIG profile of the model holds isolation.memory (the package's status says so):
            # the class selects nothing rather than anything
            return "false"
        return (
            f'device.driver == "{c.DRIVER_NAME}"'
            f' && "migProfile" in {attrs} && {attrs}.migProfile == {_cel_string(profile)}'
            f" && {attrs}.productName == {_cel_string(spec.gpu_model)}"
        )
    return (
        f'device.driver == "{c.DRIVER_NAME}"'
        f' && "package" in {attrs} && {attrs}.package == {_cel_string(package)}'
        f" && {attrs}.productName == {_cel_string(spec.gpu_model)}"
    )


def _cel_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def device_class(
    package: str, package_uid: str | None, spec: GpuPackageSpec, resource: str | None
) -> dict[str, Any]:
    """`resource`: the extended resource the class names (`pod_slices.resource_of`), None for none."""
    meta: dict[str, Any] = {
        "name": c.device_class_name(package),
        "labels": managed_labels(package=package),
    }
    if package_uid:
        meta["ownerReferences"] = [owner_reference(c.PACKAGE_KIND, package, package_uid)]
    expression = device_selector_expression(package, spec)
    class_spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    # Absent, not null, when turned off: a server-side apply without the field releases it.
    if resource is not None:
        class_spec["extendedResourceName"] = resource
    return {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "DeviceClass",
        "metadata": meta,
        "spec": class_spec,
    }


def fingerprint(class_spec: Mapping[str, Any]) -> str:
    """What of a DeviceClass's spec gpuslice sets (selector, extended resource name), as one string:
    the operator's index keeps this to tell a class someone edited from its own."""
    selectors = class_spec.get("selectors") or [{}]
    expression = str((selectors[0].get("cel") or {}).get("expression", ""))
    return json.dumps([expression, class_spec.get("extendedResourceName")])


def desired_fingerprint(package: str, spec: GpuPackageSpec, resource: str | None) -> str:
    return fingerprint(device_class(package, None, spec, resource)["spec"])
