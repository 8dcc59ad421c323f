"""A Hardware (MIG) package: its spec rules and the DeviceClass that selects its profile's devices."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuslice.api.package import GpuPackageSpec, IsolationMode
from gpuslice.domain.deviceclass import device_class, device_selector_expression
from support import package_spec

A100 = "NVIDIA A100-SXM4-80GB"


def hardware(profile: str | None = "1g.10gb", fraction: int = 100) -> GpuPackageSpec:
    body: dict[str, object] = {"gpuModel": A100, "fraction": fraction, "isolation": {"mode": "Hardware"}}
    if profile is not None:
        body["migProfile"] = profile
    return GpuPackageSpec.model_validate(body)


def test_a_package_is_software_unless_it_says_hardware() -> None:
    spec = package_spec(25)
    assert spec.isolation.mode == IsolationMode.SOFTWARE and not spec.hardware and spec.mig_profile is None
    assert hardware().hardware and hardware().mig_profile == "1g.10gb"


@pytest.mark.parametrize(
    ("build", "expect"),
    [
        (lambda: hardware(profile=None), "migProfile or isolation.memory is required with isolation.mode"),
        (lambda: package_spec(25, A100, migProfile="1g.10gb"), "forbidden otherwise"),
        (lambda: hardware(fraction=50), "fraction must be 100"),
    ],
    ids=["hardware-without-profile", "software-with-profile", "hardware-with-a-fraction"],
)
def test_the_model_refuses_what_the_crd_refuses(build: object, expect: str) -> None:
    with pytest.raises(ValidationError, match=expect):
        build()  # type: ignore[operator]


def test_a_hardware_device_class_selects_its_profile_on_its_model_and_no_software_slice() -> None:
    expr = device_selector_expression("a100-1g", hardware("1g.10gb"))
    attrs = 'device.attributes["gpuslice.io"]'
    assert expr == (
        f'device.driver == "gpuslice.io" && "migProfile" in {attrs} && {attrs}.migProfile == "1g.10gb"'
        f' && {attrs}.productName == "{A100}"'
    )
    assert ".package" not in expr  # a MIG device has no package: it is any package's of its profile
    dc = device_class("a100-1g", "uid", hardware("3g.40gb"), "gpuslice.io/a100-1g")
    (selector,) = dc["spec"]["selectors"]
    assert '.migProfile == "3g.40gb"' in selector["cel"]["expression"]
    assert dc["spec"]["extendedResourceName"] == "gpuslice.io/a100-1g"


def test_a_software_device_class_never_reads_a_mig_devices_missing_package() -> None:
    # the existence test comes before the read: without it one MIG card on a node would fail every
    # claim of a software package of the same model with a CEL runtime error
    expr = device_selector_expression("a100-8g", package_spec(10, A100))
    guard, read = expr.index('"package" in device.attributes'), expr.index(".package ==")
    assert guard < read
