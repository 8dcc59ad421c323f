"""Capacity of Hardware (MIG) packages from what a card in MIG mode publishes: placements of the
package's profile on its model, free only where they still fit beside what is allocated."""

from __future__ import annotations

from gpuslice.agent.slices import Package, build_specs, with_generation
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import parse_resource_slices
from gpuslice.domain import mig
from gpuslice.domain.capacity import package_capacity
from gpuslice.domain.package_status import package_status
from gpuslice.domain.slice_status import Reason, SliceFacts, slice_status
from gpuslice.domain.views import claim_view, pod_view
from support import gpu

A100 = "NVIDIA A100-SXM4-80GB"
P1G = mig.MigProfile(19, "1g.10gb", 1, 7, 9728, 14, tuple((k, 1) for k in range(7)))
P3G = mig.MigProfile(9, "3g.40gb", 3, 2, 40192, 42, ((0, 4), (4, 4)))
P4G = mig.MigProfile(5, "4g.40gb", 4, 1, 40192, 56, ((0, 4),))


def hw(name: str, profile: str) -> Package:
    spec = {"gpuModel": A100, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": profile}
    return Package(name, GpuPackageSpec.model_validate(spec))


PACKAGES = [hw("a-1g", "1g.10gb"), hw("a-3g", "3g.40gb"), hw("a-4g", "4g.40gb")]


def slices(cards: int = 1):  # type: ignore[no-untyped-def]
    gpus = [
        gpu(k, A100, 80 * 1024**3).model_copy(update={"mig_profiles": (P1G, P3G, P4G)}) for k in range(cards)
    ]
    return parse_resource_slices(with_generation("n1", build_specs("n1", gpus, PACKAGES), 1))


def cap(profile: str, allocated: list[str], cards: int = 1):  # type: ignore[no-untyped-def]
    return package_capacity("x", slices(cards), [("n1", d) for d in allocated], (A100, profile))


def test_an_empty_card_offers_each_profile_as_often_as_it_fits() -> None:
    assert (cap("1g.10gb", []).total, cap("1g.10gb", []).free) == (7, 7)
    assert (cap("3g.40gb", []).total, cap("3g.40gb", []).free) == (2, 2)
    assert (cap("4g.40gb", []).free, cap("4g.40gb", []).gpus) == (1, 1)
    assert cap("1g.10gb", []).memory_per_slice_bytes == 9728 * 1024 * 1024
    # a software package of the model sells nothing on a card in MIG mode
    assert package_capacity("a-1g", slices(), []).total == 0


def test_a_1g_and_a_3g_side_by_side_leave_what_the_driver_could_still_make() -> None:
    taken = ["gpu-0-mig-1g-10gb-0", "gpu-0-mig-3g-40gb-4"]
    assert (cap("1g.10gb", taken).allocated, cap("1g.10gb", taken).free) == (1, 3)  # slices 1, 2, 3
    assert (cap("3g.40gb", taken).allocated, cap("3g.40gb", taken).free) == (1, 0)
    assert cap("4g.40gb", taken).free == 0


def test_scattered_1g_instances_leave_no_room_for_a_4g() -> None:
    # 1g at slices 0 and 4: four 1g slices and 5 compute slices are free, but no run of four
    taken = ["gpu-0-mig-1g-10gb-0", "gpu-0-mig-1g-10gb-4"]
    assert cap("4g.40gb", taken).free == 0 and cap("1g.10gb", taken).free == 5
    assert cap("4g.40gb", taken, cards=2).free == 1  # the other card still holds one


def test_a_hardware_package_status_says_its_instances_per_card_memory_and_dedicated_compute() -> None:
    (pkg,) = [p for p in PACKAGES if p.name == "a-1g"]
    status = package_status("a-1g", pkg.spec, 1, cap("1g.10gb", ["gpu-0-mig-1g-10gb-3"], cards=2), 0, True)
    assert status.slices_per_gpu == 7 and status.memory_per_slice == "9728Mi"
    assert status.capacity is not None and (status.capacity.slices_total, status.capacity.slices_free) == (
        14,
        13,
    )
    assert status.guarantees is not None and status.guarantees.compute == "Dedicated"
    # before any card publishes the profile, the count per card is not known
    assert package_status("a-1g", pkg.spec, 1, cap("1g.10gb", [], cards=0), 0, True).slices_per_gpu is None


def test_a_4g_slice_pending_on_scattered_1g_instances_says_why() -> None:
    taken = ["gpu-0-mig-1g-10gb-0", "gpu-0-mig-1g-10gb-4"]
    msg = "0/1 nodes are available: 1 cannot allocate all claims."
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}
    pod = pod_view({"metadata": {"namespace": "ns", "name": "p"}, "spec": {"resourceClaims": [
        {"name": "gpu", "resourceClaimName": "s"}], "containers": [{"name": "c"}]},
        "status": {"phase": "Pending", "conditions": [cond]}})  # fmt: skip
    claim = claim_view({"metadata": {"namespace": "ns", "name": "s"}, "spec": {}, "status": {}})
    facts = SliceFacts(namespace="ns", name="s", package="a-4g", template=False, generation=1,
                       package_found=True, gpu_model=A100, claims=[claim], pods=[pod], quotas=[],
                       workloads=[], capacity=cap("4g.40gb", taken), mig_profile="4g.40gb")  # fmt: skip
    st = slice_status(facts, "2026-12-07T09:00:00Z")
    assert st.phase == "Pending" and st.reason == Reason.GPUS_FULL
    assert "placements of MIG profile 4g.40gb" in st.message and "overlap MIG instances in use" in st.message
