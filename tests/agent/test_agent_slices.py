"""The ResourceSlice builder: counters make over-commit of a card impossible, names and limits hold."""

from __future__ import annotations

import random
import re
from collections import defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice import constants
from gpuslice.agent.gpus import GpuInfo, semver
from gpuslice.agent.slices import (
    ANNOTATION_CONTENT_HASH,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    Package,
    build_specs,
    device_name,
    plan_publish,
    slice_name,
    with_generation,
)
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.resourceslice import parse_resource_slices
from support import V100, gpu

A100 = "NVIDIA A100-SXM4-40GB"
GIB = constants.GIB
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pkg(name: str, fraction: int, model: str = V100, compute: int | None = None) -> Package:
    return Package(name, GpuPackageSpec(gpuModel=model, fraction=fraction, computeShare=compute))


def all_devices(specs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for _, s in specs for d in s.get("devices", [])]


def all_counter_sets(specs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, int]]:
    out = {}
    for _, s in specs:
        for cs in s.get("sharedCounters", []):
            assert cs["name"] not in out, f"counter set {cs['name']} published twice"
            out[cs["name"]] = {k: int(v["value"]) for k, v in cs["counters"].items()}
    return out


def test_v100_with_8g_16g_32g_packages() -> None:
    packages = [pkg("v100-8g", 25), pkg("v100-16g", 50), pkg("v100-32g", 100), pkg("a100-10g", 25, A100)]
    specs = build_specs("node-a", [gpu(0), gpu(1)], packages)

    counters = all_counter_sets(specs)
    assert counters == {
        "gpu-0": {"memory": 32 * GIB, "compute": 100},
        "gpu-1": {"memory": 32 * GIB, "compute": 100},
    }
    devices = all_devices(specs)
    names = [d["name"] for d in devices]
    # 4 + 2 + 1 per card, nothing from the A100 package
    assert len(devices) == 14
    assert "gpu-0-v100-8g-3" in names and "gpu-1-v100-16g-1" in names and "gpu-0-v100-32g-0" in names
    eight = next(d for d in devices if d["name"] == "gpu-1-v100-8g-0")
    assert eight["attributes"]["package"] == {"string": "v100-8g"}
    assert eight["attributes"]["productName"] == {"string": V100}
    assert eight["attributes"]["uuid"] == {"string": gpu(1).uuid}
    assert eight["attributes"]["cudaComputeCapability"] == {"version": "7.0.0"}
    assert eight["attributes"]["driverVersion"] == {"version": "535.104.5"}
    assert eight["capacity"] == {"memory": {"value": str(8 * GIB)}}
    assert eight["consumesCounters"] == [
        {"counterSet": "gpu-1", "counters": {"memory": {"value": str(8 * GIB)}, "compute": {"value": "25"}}}
    ]
    for _, spec in specs:
        assert spec["driver"] == "gpuslice.io"
        assert spec["nodeName"] == "node-a"
        assert spec["pool"] == {"name": "node-a", "generation": 0, "resourceSliceCount": len(specs)}
        assert ("devices" in spec) != ("sharedCounters" in spec), (
            "a slice holds counters or devices, never both"
        )


def test_compute_share_overrides_fraction_in_the_counters() -> None:
    (_, _), (_, devices) = build_specs("n", [gpu(0)], [pkg("v100-8g-fast", 25, compute=50)])
    assert {d["consumesCounters"][0]["counters"]["compute"]["value"] for d in devices["devices"]} == {"50"}


def test_a_burst_package_reaches_the_prepared_slice_through_its_devices() -> None:
    burst = Package("v100-8g-burst", GpuPackageSpec(gpuModel=V100, fraction=25, computeBurst=True))
    specs = build_specs("n", [gpu(0)], [burst, pkg("v100-8g", 25)])
    parsed = parse_resource_slices([{"metadata": {"name": n}, "spec": spec} for n, spec in specs])
    flags = {d.package: d.compute_burst for s in parsed for d in s.devices}
    assert flags == {"v100-8g-burst": True, "v100-8g": False}


def test_node_without_matching_packages_still_publishes_its_cards() -> None:
    specs = build_specs("n", [gpu(0, A100, 40 * GIB)], [pkg("v100-8g", 25)])
    assert len(specs) == 1
    assert all_counter_sets(specs) == {"gpu-0": {"memory": 40 * GIB, "compute": 100}}


def test_semver_normalises_nvidia_versions() -> None:
    assert semver("535.104.05") == "535.104.5"
    assert semver("7.0") == "7.0.0"
    assert semver("12") == "12.0.0"


def test_long_or_dotted_package_names_still_give_dns_labels() -> None:
    a = device_name(gpu(3), "gold.v100.tenant-a", 0)
    b = device_name(gpu(3), "gold.v100.tenant-b", 0)
    long = device_name(gpu(3), "x" * 200, 12)
    for name in (a, b, long):
        assert DNS_LABEL.match(name) and len(name) <= 63, name
    assert a != b


def test_long_node_names_give_valid_slice_names() -> None:
    node = ("n" * 60 + ".") * 4
    assert len(slice_name(node, "devices", 3)) <= 253
    assert slice_name(node, "devices", 3) != slice_name(node, "devices", 4)


package_names = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,70}[a-z0-9])?", fullmatch=True)
packages_st = st.lists(
    st.builds(
        pkg,
        package_names,
        st.integers(min_value=1, max_value=100),
        st.sampled_from([V100, A100]),
        st.one_of(st.none(), st.integers(min_value=1, max_value=100)),
    ),
    max_size=6,
    unique_by=lambda p: p.name,
)
gpus_st = st.lists(
    st.tuples(st.sampled_from([V100, A100]), st.sampled_from([16 * GIB, 32 * GIB, 40 * GIB, 1024**2 * 7])),
    min_size=0,
    max_size=12,
).map(lambda xs: [gpu(i, m, mem) for i, (m, mem) in enumerate(xs)])


@settings(max_examples=150, deadline=None)
@given(gpus=gpus_st, packages=packages_st, seed=st.integers())
def test_no_allocation_the_counters_allow_can_overfill_a_card(
    gpus: list[GpuInfo], packages: list[Package], seed: int
) -> None:
    """Allocate devices in random order the way kube-scheduler does (only if every counter the device
    consumes is still available) and check what each physical card ends up holding."""
    specs = build_specs("node", gpus, packages)
    counters = all_counter_sets(specs)
    remaining = {name: dict(values) for name, values in counters.items()}
    by_uuid = {g.uuid: g for g in gpus}
    devices = all_devices(specs)
    random.Random(seed).shuffle(devices)
    held_memory: dict[str, int] = defaultdict(int)
    held_compute: dict[str, int] = defaultdict(int)
    for device in devices:
        wants = [
            (c["counterSet"], k, int(v["value"]))
            for c in device["consumesCounters"]
            for k, v in c["counters"].items()
        ]
        if all(remaining[cs][k] >= amount for cs, k, amount in wants):
            for cs, k, amount in wants:
                remaining[cs][k] -= amount
            uuid = device["attributes"]["uuid"]["string"]
            held_memory[uuid] += int(device["capacity"]["memory"]["value"])
            held_compute[uuid] += int(device["attributes"]["computeShare"]["int"])
    for uuid, memory in held_memory.items():
        assert memory <= by_uuid[uuid].memory_bytes
        assert held_compute[uuid] <= 100


@settings(max_examples=150, deadline=None)
@given(gpus=gpus_st, packages=packages_st)
def test_names_unique_and_api_limits_respected(gpus: list[GpuInfo], packages: list[Package]) -> None:
    specs = build_specs("node", gpus, packages)
    slice_names = [name for name, _ in specs]
    assert len(set(slice_names)) == len(slice_names)
    devices = all_devices(specs)
    assert len({d["name"] for d in devices}) == len(devices)
    counter_sets = all_counter_sets(specs)
    assert set(counter_sets) == {f"gpu-{g.index}" for g in gpus}
    for _, spec in specs:
        assert len(spec.get("devices", [])) <= MAX_DEVICES_PER_SLICE
        assert len(spec.get("sharedCounters", [])) <= MAX_COUNTER_SETS_PER_SLICE
        assert spec["pool"]["resourceSliceCount"] == len(specs)
    for d in devices:
        assert DNS_LABEL.match(d["name"]) and len(d["name"]) <= 63
        assert len(d["attributes"]) + len(d["capacity"]) <= 32
        assert all(len(v.get("string", "")) <= 64 for v in d["attributes"].values())
        assert d["consumesCounters"][0]["counterSet"] in counter_sets
    # every matching (gpu, package) pair offers exactly 100 // fraction devices
    for g in gpus:
        for p in packages:
            if p.spec.gpu_model == g.product_name and p.spec.memory_bytes(g.memory_bytes) > 0:
                ours = [
                    d
                    for d in devices
                    if d["attributes"]["gpuIndex"]["int"] == g.index
                    and d["attributes"]["package"]["string"] == p.name
                ]
                assert len(ours) == 100 // p.spec.fraction


def test_one_package_fills_a_card_exactly() -> None:
    """Counters are not stricter than the product: four 8g slices fit on a 32 GiB card together."""
    specs = build_specs("n", [gpu(0)], [pkg("v100-8g", 25)])
    memory = sum(int(d["consumesCounters"][0]["counters"]["memory"]["value"]) for d in all_devices(specs))
    compute = sum(int(d["consumesCounters"][0]["counters"]["compute"]["value"]) for d in all_devices(specs))
    assert (memory, compute) == (32 * GIB, 100)


def published(node: str, specs: list[tuple[str, dict[str, Any]]], generation: int) -> list[dict[str, Any]]:
    return with_generation(node, specs, generation)


def test_republish_plan_bumps_generation_only_on_change() -> None:
    first = build_specs("n", [gpu(0)], [pkg("v100-8g", 25)])
    plan = plan_publish("n", first, existing=[])
    assert {s["spec"]["pool"]["generation"] for s in plan.apply} == {1}
    assert plan.delete == []

    # the same content read back: nothing to do (an agent restart does not churn the pool)
    assert plan_publish("n", first, existing=plan.apply).empty

    # a package added: everything re-applied under generation 2
    second = build_specs("n", [gpu(0)], [pkg("v100-8g", 25), pkg("v100-16g", 50)])
    plan2 = plan_publish("n", second, existing=plan.apply)
    assert {s["spec"]["pool"]["generation"] for s in plan2.apply} == {2}
    assert all(s["metadata"]["annotations"][ANNOTATION_CONTENT_HASH] for s in plan2.apply)

    # packages gone and 200 devices' worth of slices shrink back: stale slices are deleted
    many = build_specs("n", [gpu(i) for i in range(4)], [pkg("v100-1g", 1)])
    assert sum(1 for name, _ in many if "-devices-" in name) == 7  # 400 devices / 64
    plan3 = plan_publish("n", first, existing=published("n", many, 5))
    assert {s["spec"]["pool"]["generation"] for s in plan3.apply} == {6}
    assert plan3.delete == [f"n-gpuslice-devices-{i}" for i in range(1, 7)]


def test_a_node_without_gpus_deletes_what_it_had_published() -> None:
    before = published("n", build_specs("n", [gpu(0)], [pkg("v100-8g", 25)]), 1)
    plan = plan_publish("n", [], existing=before)
    assert plan.apply == []
    assert plan.delete == sorted(s["metadata"]["name"] for s in before)


def test_an_unhealthy_cards_devices_carry_its_taint_and_a_change_republishes() -> None:
    packages = [pkg("v100-8g", 25)]
    cards = [gpu(0), gpu(1)]
    taint = {"key": "gpuslice.io/gpu-unhealthy", "value": "xid-79", "effect": "NoExecute",
             "timeAdded": "2026-12-05T00:00:00Z"}  # fmt: skip
    healthy = build_specs("node-a", cards, packages)
    tainted = build_specs("node-a", cards, packages, {cards[0].uuid: [taint]})
    by_card = defaultdict(list)
    for d in all_devices(tainted):
        by_card[d["attributes"]["gpuIndex"]["int"]].append(d.get("taints"))
    assert by_card[0] == [[taint]] * 4
    assert by_card[1] == [None] * 4
    assert all_counter_sets(tainted) == all_counter_sets(healthy), "the card's counters stay published"
    published = with_generation("node-a", healthy, 1)
    assert not plan_publish("node-a", tainted, published).empty, "a taint is a republish"
    assert plan_publish("node-a", healthy, published).empty
