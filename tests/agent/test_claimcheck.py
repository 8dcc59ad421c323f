"""The agent's own check of an allocated claim before it prepares a gpuslice device."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice.agent.claimcheck import refusal
from gpuslice.domain.claims import documented_claim_spec

DEV = "gpu-0-v100-8g-0"


def claim(spec: dict[str, Any], admin_result: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": "gpuslice.io", "pool": "n", "device": DEV}
    if admin_result:
        result["adminAccess"] = True
    return {"spec": spec, "status": {"allocation": {"devices": {"results": [result]}}}}


def test_the_documented_form_of_the_devices_own_class_is_prepared() -> None:
    assert refusal(claim(documented_claim_spec("v100-8g")), "gpu", DEV, "v100-8g") is None


@pytest.mark.parametrize(
    ("spec", "request_name", "expect"),
    [
        # another class whose selector matched gpuslice devices
        (
            {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any.example.com"}}]}},
            "gpu",
            "'any.example.com'",
        ),
        # allocationMode All through another class
        (
            {
                "devices": {
                    "requests": [
                        {
                            "name": "all",
                            "exactly": {"deviceClassName": "x.example.com", "allocationMode": "All"},
                        }
                    ]
                }
            },
            "all",
            "'x.example.com'",
        ),
        # the class of another, larger package
        (documented_claim_spec("v100-32g"), "gpu", "v100-32g.gpuslice.io"),
        # a firstAvailable subrequest of another class
        (
            {
                "devices": {
                    "requests": [
                        {"name": "gpu", "firstAvailable": [{"name": "a", "deviceClassName": "x.example.com"}]}
                    ]
                }
            },
            "gpu/a",
            "'x.example.com'",
        ),
        # a request the spec does not have
        (documented_claim_spec("v100-8g"), "other", "None"),
    ],
    ids=["other-class", "allocation-mode-all", "other-package", "first-available", "unknown-request"],
)
def test_devices_reached_through_any_other_class_are_refused(
    spec: dict[str, Any], request_name: str, expect: str
) -> None:
    why = refusal(claim(spec), request_name, DEV, "v100-8g")
    assert why is not None and expect in why and "v100-8g.gpuslice.io" in why and "GpuSlice" in why


def test_admin_access_is_refused_in_the_request_or_the_result() -> None:
    spec = documented_claim_spec("v100-8g")
    assert "adminAccess" in (refusal(claim(spec, admin_result=True), "gpu", DEV, "v100-8g") or "")
    spec["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    assert "adminAccess" in (refusal(claim(spec), "gpu", DEV, "v100-8g") or "")


def test_a_device_of_no_package_is_refused() -> None:
    assert "no gpuslice package" in (refusal(claim(documented_claim_spec("v100-8g")), "gpu", DEV, None) or "")


def scheduler_claim(count: int = 1, cls: str = "v100-8g.gpuslice.io") -> dict[str, Any]:
    """The claim kube-scheduler makes for a container's `gpuslice.io/v100-8g: <count>`."""
    request = {"deviceClassName": cls, "allocationMode": "ExactCount", "count": count}
    out = claim({"devices": {"requests": [{"name": "container-0-request-0", "exactly": request}]}})
    out["status"]["allocation"]["devices"]["results"][0]["request"] = "container-0-request-0"
    out["metadata"] = {"annotations": {"resource.kubernetes.io/extended-resource-claim": "true"}}
    return out


def test_the_schedulers_claim_for_a_product_in_resources_limits_is_prepared() -> None:
    assert refusal(scheduler_claim(), "container-0-request-0", DEV, "v100-8g") is None


def test_a_request_for_more_than_one_slice_is_refused_whatever_made_it() -> None:
    why = refusal(scheduler_claim(count=2), "container-0-request-0", DEV, "v100-8g") or ""
    assert "count 1" in why and "gpuslice.io/v100-8g: 1" in why
    spec = documented_claim_spec("v100-8g")
    spec["devices"]["requests"][0]["exactly"]["count"] = 3
    assert "count 1" in (refusal(claim(spec), "gpu", DEV, "v100-8g") or "")


def test_the_schedulers_claim_for_another_class_is_refused() -> None:
    why = refusal(scheduler_claim(cls="deviceclass-any.example.com"), "container-0-request-0", DEV, "v100-8g")
    assert why is not None and "v100-8g.gpuslice.io" in why
