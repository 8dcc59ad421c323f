"""Whether the agent may prepare an allocated device for a claim: the node's last word on a claim.

Admission keeps tenants to the documented claim form, but a claim for another DeviceClass whose
selector happens to match gpuslice devices (a class without a driver selector, `allocationMode: All`)
can still be allocated a gpuslice device by kube-scheduler. The agent prepares a device only when
the request that got it names that device's own DeviceClass (`<package>.gpuslice.io`) for exactly
one device, without admin access; anything else is refused, so the pod never starts with the device.
That holds for the claims kube-scheduler makes for a container's `resources.limits:
{gpuslice.io/<package>: 1}` too: one request `container-<i>-request-<j>` of the class, count 1.
(The namespace is admission's to check: gpuslice DeviceClasses are refused outside entitled
namespaces, for claims and for the extended resource names alike.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuslice import constants as c


def _request_class(claim: Mapping[str, Any], request: str) -> tuple[str | None, bool, int | None]:
    """(deviceClassName, adminAccess, count) of the request (or `request/subrequest`) named in a
    result; count None for allocationMode All."""
    name, _, sub = request.partition("/")
    for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        if r.get("name") != name:
            continue
        one = r.get("exactly") or {}
        if sub:
            one = next((s for s in r.get("firstAvailable") or [] if s.get("name") == sub), None) or {}
            if not one:
                return None, False, None
        count = int(one.get("count", 1)) if one.get("allocationMode", "ExactCount") == "ExactCount" else None
        return one.get("deviceClassName"), bool(one.get("adminAccess")) and not sub, count
    return None, False, None


def _result_admin_access(claim: Mapping[str, Any], request: str, device: str) -> bool:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
    return any(
        r.get("request") == request and r.get("device") == device and r.get("adminAccess")
        for r in results or []
    )


def refusal(
    claim: Mapping[str, Any], request: str, device: str, package: str | None, count: int = 1
) -> str | None:
    """Why `device` (published for `package`), allocated to `request` of the claim, must not be
    prepared; None when it may. `count`: the devices the request may take (the whole cards of a
    multi-GPU product allocated together; 1 otherwise)."""
    if package is None:
        return f"device {device} belongs to no gpuslice package"
    want = c.device_class_name(package)
    cls, admin, asked = _request_class(claim, request)
    if cls != want:
        return (
            f"request {request!r} asks for DeviceClass {cls!r}, but device {device} is a slice of "
            f"package {package} and is handed out only through DeviceClass {want}: create a GpuSlice "
            f"(spec.package: {package}) instead"
        )
    if admin or _result_admin_access(claim, request, device):
        return "adminAccess to gpuslice devices is not supported: a slice is for one workload"
    if asked != count:
        return (
            f"request {request!r} asks for {'all' if asked is None else asked} devices of {want}; a "
            f"request takes one slice (ExactCount, count 1): ask for a larger product, e.g. "
            f"resources.limits {{gpuslice.io/{package}: 1}} or a GpuSlice (spec.package: {package})"
        )
    return None


def package_of_request(claim: Mapping[str, Any], request: str) -> str | None:
    """The package whose DeviceClass the request names, or None. A MIG device belongs to every
    Hardware package of its profile and model, so its package is the one the claim asked through."""
    cls, _, _ = _request_class(claim, request)
    if cls is None or not cls.endswith(c.DEVICE_CLASS_SUFFIX):
        return None
    return cls.removesuffix(c.DEVICE_CLASS_SUFFIX) or None
