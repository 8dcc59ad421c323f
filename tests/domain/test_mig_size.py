"""A Hardware package sized by memory (spec.isolation.memory): the smallest MIG profile of its card
model that holds the size, what the package's status and DeviceClass then say, and the refusal when no
profile of the model holds it."""

from __future__ import annotations

import pytest

from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import parse_resource_slices
from gpuslice.domain import mig
from gpuslice.domain.capacity import package_capacity
from gpuslice.domain.deviceclass import device_selector_expression
from gpuslice.domain.package_status import package_status
from support import gpu

A100_40 = "NVIDIA A100-SXM4-40GB"
A100_80 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
GiB = 1024**3


@pytest.mark.parametrize(
    ("model", "memory", "profile"),
    [
        (A100_40, 4 * GiB, "1g.5gb"),
        (A100_40, 5 * GiB, "1g.10gb"),  # 1g.5gb is 4.75 GiB; 1g.10gb before 2g.10gb (fewer SMs)
        (A100_40, 39 * GiB, "7g.40gb"),
        (A100_80, 9 * GiB, "1g.10gb"),
        (A100_80, 10 * GiB, "1g.20gb"),  # 1g.10gb holds 9.50 GiB, not 10
        (A100_80, 39 * GiB, "3g.40gb"),  # 3g before 4g.40gb: same memory, fewer compute slices
        (A100_80, 79 * GiB, "7g.80gb"),
        (H100, 19 * GiB, "1g.20gb"),
        (H100, 20 * GiB, "3g.40gb"),  # 1g.20gb / 2g.20gb hold 19.62 GiB
    ],
)
def test_the_smallest_profile_that_holds_the_memory_is_chosen(model: str, memory: int, profile: str) -> None:
    choice = mig.profile_for_memory(model, memory)
    assert choice.profile is not None and choice.profile.name == profile
    assert profile in choice.message and model in choice.message


def test_no_profile_holds_more_than_the_card_and_an_unknown_model_has_no_table() -> None:
    too_big = mig.profile_for_memory(A100_40, 41 * GiB)
    assert too_big.profile is None
    assert too_big.message == (
        f"isolation.memory 41.00 GiB (41984 MiB) is more than any MIG instance of {A100_40} holds: "
        "the largest, 7g.40gb, has 39.25 GiB (40192 MiB)"
    )
    unknown = mig.profile_for_memory("Tesla V100-SXM2-32GB", GiB)
    assert unknown.profile is None and "name the profile in spec.migProfile" in unknown.message


def sized(memory: str, model: str = A100_80) -> GpuPackageSpec:
    spec = {"gpuModel": model, "fraction": 100, "isolation": {"mode": "Hardware", "memory": memory}}
    return GpuPackageSpec.model_validate(spec)


def test_a_sized_package_sells_its_profile_through_the_class_capacity_and_status() -> None:
    spec = sized("9Gi")
    assert mig.package_profile(spec) == "1g.10gb" and spec.mig_profile is None
    assert '.migProfile == "1g.10gb"' in device_selector_expression("a100-9g", spec)
    # the card's agent publishes that profile's placements, and the capacity counts them
    p1g = mig.MigProfile(19, "1g.10gb", 1, 7, 9728, 14, tuple((k, 1) for k in range(7)))
    card = gpu(0, A100_80, 80 * GiB).model_copy(update={"mig_profiles": (p1g,)})
    published = parse_resource_slices(
        with_generation("n1", build_specs("n1", [card], [Package("a100-9g", spec)]), 1)
    )
    capacity = package_capacity("a100-9g", published, [], (A100_80, "1g.10gb"))
    assert (capacity.total, capacity.free) == (7, 7)
    status = package_status("a100-9g", spec, 1, capacity, 0, True)
    assert status.mig_profile == "1g.10gb" and status.memory_per_slice == "9728Mi"
    (ready,) = [x for x in status.conditions if x.type == "Ready"]
    assert ready.status == "True" and "maps to 1g.10gb" in ready.message


def test_a_size_no_profile_holds_stalls_the_package_with_the_reason_and_selects_nothing() -> None:
    spec = sized("100Gi")
    assert mig.package_profile(spec) is None
    assert device_selector_expression("a100-huge", spec) == "false"
    capacity = package_capacity("a100-huge", [], [], None)
    status = package_status("a100-huge", spec, 3, capacity, 0, True)
    by_type = {x.type: x for x in status.conditions}
    assert by_type["Ready"].status == "False" and by_type["Stalled"].status == "True"
    assert by_type["Stalled"].reason == "NoMigProfileHoldsMemory"
    assert "more than any MIG instance of NVIDIA A100-SXM4-80GB holds" in by_type["Stalled"].message
    assert status.mig_profile is None


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        ({"isolation": {"mode": "Hardware", "memory": "9Gi"}, "migProfile": "1g.10gb"}, "not both"),
        ({"isolation": {"memory": "9Gi"}}, "forbidden otherwise"),
        ({"isolation": {"mode": "Hardware", "memory": "9GB"}}, "not a whole number"),
    ],
    ids=["both", "software", "not-a-quantity"],
)
def test_the_model_refuses_what_the_crd_refuses(body: dict[str, object], expect: str) -> None:
    with pytest.raises(ValueError, match=expect):
        GpuPackageSpec.model_validate({"gpuModel": A100_80, "fraction": 100, **body})
