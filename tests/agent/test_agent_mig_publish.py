"""A card in MIG mode in the node's ResourceSlices: its placements as devices on its MIG counter set,
only for the profiles Hardware packages sell, and no software slice of it."""

from __future__ import annotations

import itertools
from typing import Any

from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.slices import Package, build_specs
from gpuslice.api.package import GpuPackageSpec
from gpuslice.domain import mig
from support import gpu

A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1024**3
# The driver's A100-SXM4-80GB profiles (shim/fake/mig_profiles.h, as NVML reports them).
P1G = mig.MigProfile(19, "1g.10gb", 1, 7, 9728, 14, tuple((k, 1) for k in range(7)))
P3G = mig.MigProfile(9, "3g.40gb", 3, 2, 40192, 42, ((0, 4), (4, 4)))
P4G = mig.MigProfile(5, "4g.40gb", 4, 1, 40192, 56, ((0, 4),))


def mig_card(index: int) -> GpuInfo:
    return gpu(index, A100, 80 * GIB).model_copy(update={"mig_profiles": (P1G, P3G, P4G)})


def hw(name: str, profile: str) -> Package:
    spec = GpuPackageSpec.model_validate(
        {"gpuModel": A100, "fraction": 100, "isolation": {"mode": "Hardware"}, "migProfile": profile}
    )
    return Package(name, spec)


def sw(name: str, fraction: int) -> Package:
    return Package(name, GpuPackageSpec.model_validate({"gpuModel": A100, "fraction": fraction}))


def devices(specs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for _, s in specs for d in s.get("devices", [])]


def counter_sets(specs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {cs["name"]: cs for _, s in specs for cs in s.get("sharedCounters", [])}


def test_a_mig_card_offers_the_placements_of_the_sold_profiles_and_no_software_slice() -> None:
    packages = [hw("a-1g", "1g.10gb"), hw("a-3g", "3g.40gb"), sw("a-half", 50)]
    specs = build_specs("n1", [mig_card(0), gpu(1, A100, 80 * GIB)], packages)
    devs = devices(specs)
    on0 = [d for d in devs if d["attributes"]["gpuIndex"]["int"] == 0]
    on1 = [d for d in devs if d["attributes"]["gpuIndex"]["int"] == 1]
    # card 0 (MIG mode): 7 placements of 1g.10gb, 2 of 3g.40gb; 4g.40gb is sold by no package
    assert sorted(d["attributes"]["migProfile"]["string"] for d in on0) == ["1g.10gb"] * 7 + ["3g.40gb"] * 2
    assert all("package" not in d["attributes"] for d in on0)
    # card 1 (MIG mode off): only the software package, two halves, none of the MIG profiles
    assert [d["attributes"]["package"]["string"] for d in on1] == ["a-half", "a-half"]
    sets = counter_sets(specs)
    assert set(sets) == {mig.counter_set_name(0), "gpu-1"}  # no whole-card counters for card 0
    assert all(d["consumesCounters"][0]["counterSet"] == mig.counter_set_name(0) for d in on0)
    one = next(d for d in on0 if d["attributes"]["migProfile"]["string"] == "1g.10gb")
    assert one["capacity"]["memory"]["value"] == str(9728 * 1024 * 1024)
    assert on0[0]["attributes"]["uuid"]["string"] == mig_card(0).uuid


def test_the_published_counters_admit_exactly_the_instances_the_driver_can_hold_at_once() -> None:
    specs = build_specs("n1", [mig_card(0)], [hw("a-1g", "1g.10gb"), hw("a-3g", "3g.40gb")])
    (cs,) = counter_sets(specs).values()
    limit = {k: int(v["value"]) for k, v in cs["counters"].items()}

    def admitted(chosen: tuple[dict[str, Any], ...]) -> bool:
        used: dict[str, int] = {}
        for d in chosen:
            for k, v in d["consumesCounters"][0]["counters"].items():
                used[k] = used.get(k, 0) + int(v["value"])
        return all(v <= limit[k] for k, v in used.items())

    devs = devices(specs)
    byname = {d["name"]: d for d in devs}
    start = {d["name"]: d["attributes"]["migPlacementStart"]["int"] for d in devs}
    size = {d["name"]: d["attributes"]["migPlacementSize"]["int"] for d in devs}
    slices = {d["name"]: int(d["consumesCounters"][0]["counters"]["compute-slices"]["value"]) for d in devs}
    for n in (2, 3):
        for combo in itertools.combinations(sorted(byname), n):
            spans = [set(range(start[x], start[x] + size[x])) for x in combo]
            disjoint = sum(map(len, spans)) == len(set().union(*spans))
            fits = disjoint and sum(slices[x] for x in combo) <= 7
            assert admitted(tuple(byname[x] for x in combo)) == fits, combo
    # the brief's case: a 1g.10gb and a 3g.40gb side by side on one card
    one = next(d for d in devs if d["attributes"]["migProfile"]["string"] == "1g.10gb")
    three = next(
        d
        for d in devs
        if d["attributes"]["migPlacementStart"]["int"] == 4
        and d["attributes"]["migPlacementSize"]["int"] == 4
    )
    assert admitted((one, three))


def test_a_card_whose_driver_lacks_the_profile_offers_nothing_for_it() -> None:
    specs = build_specs("n1", [mig_card(0)], [hw("a-2g", "2g.20gb")])
    assert devices(specs) == []
    assert set(counter_sets(specs)) == {mig.counter_set_name(0)}
