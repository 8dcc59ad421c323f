"""Package capacity from published ResourceSlices and allocated claims, with shared card counters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice import constants as c
from gpuslice.api.resourceclaim import allocated_devices
from gpuslice.api.resourceslice import parse_resource_slice as summarize_resource_slice
from gpuslice.domain.capacity import package_capacity
from support import allocated_claim, published


def _slices(*nodes: tuple[str, int]) -> list:
    out = []
    for node, gpus in nodes:
        out += [summarize_resource_slice(s) for s in published(node, gpus)]
    return [s for s in out if s is not None]


def _device(slices: list, package: str, gpu_index: int, k: int, node: str = "n0") -> tuple[str, str]:
    for s in slices:
        for d in s.devices:
            if (
                d.pool == node
                and d.package == package
                and d.name.startswith(f"gpu-{gpu_index}-")
                and d.name.endswith(f"-{k}")
            ):
                return (d.pool, d.name)
    raise AssertionError("no such device")


def test_empty_cluster_offers_nothing() -> None:
    cap = package_capacity("v100-8g", [], [])
    assert (cap.gpus, cap.total, cap.allocated, cap.free, cap.memory_per_slice_bytes) == (0, 0, 0, 0, None)


def test_two_nodes_of_two_v100_offer_four_slices_each_of_8g() -> None:
    slices = _slices(("n0", 2), ("n1", 2))
    cap = package_capacity("v100-8g", slices, [])
    assert (cap.gpus, cap.total, cap.allocated, cap.free) == (4, 16, 0, 16)
    assert cap.memory_per_slice_bytes == 8 * c.GIB
    big = package_capacity("v100-32g", slices, [])
    assert (big.gpus, big.total, big.free, big.memory_per_slice_bytes) == (4, 4, 4, 32 * c.GIB)


def test_a_whole_card_slice_of_another_package_leaves_no_room_on_that_card() -> None:
    slices = _slices(("n0", 1))
    taken = [_device(slices, "v100-32g", 0, 0)]
    cap = package_capacity("v100-8g", slices, taken)
    assert (cap.total, cap.allocated, cap.free) == (4, 0, 0)


def test_mixed_packages_share_the_card_memory() -> None:
    slices = _slices(("n0", 1))
    taken = [_device(slices, "v100-16g", 0, 0), _device(slices, "v100-8g", 0, 0)]
    assert package_capacity("v100-8g", slices, taken).free == 1  # 32 - 16 - 8 = 8 GiB left
    assert package_capacity("v100-16g", slices, taken).free == 0


def test_only_the_newest_pool_generation_counts() -> None:
    old = [summarize_resource_slice(s) for s in published("n0", 4, generation=1)]
    new = [summarize_resource_slice(s) for s in published("n0", 1, generation=2)]
    cap = package_capacity("v100-8g", [s for s in old + new if s], [])
    assert (cap.gpus, cap.total) == (1, 4)


def test_slices_of_other_drivers_are_ignored() -> None:
    other = {
        "metadata": {"name": "x"},
        "spec": {"driver": "gpu.nvidia.com", "pool": {"name": "n0", "generation": 1}},
    }
    assert summarize_resource_slice(other) is None


def test_allocated_devices_reads_only_gpuslice_results() -> None:
    claim = allocated_claim("ns", "c", "n0", "gpu-0-v100-8g-0")
    claim["status"]["allocation"]["devices"]["results"].append(
        {"driver": "other.io", "pool": "p", "device": "d"}
    )
    assert allocated_devices(claim) == [("n0", "gpu-0-v100-8g-0")]


@settings(max_examples=60, deadline=None)
@given(
    gpus=st.integers(1, 3),
    picks=st.lists(
        st.tuples(st.sampled_from(["v100-8g", "v100-16g", "v100-32g"]), st.integers(0, 2)), max_size=10
    ),
    package=st.sampled_from(["v100-8g", "v100-16g", "v100-32g"]),
)
def test_free_is_exactly_how_many_more_fit(gpus: int, picks: list[tuple[str, int]], package: str) -> None:
    """Allocate devices like kube-scheduler would (never over a card's counters); then `free` more
    devices of the package fit and not one more."""
    slices = _slices(("n0", gpus))
    devices = {(d.pool, d.name): d for s in slices for d in s.devices}
    room = {f"gpu-{i}": 32 * c.GIB for i in range(gpus)}
    taken: list[tuple[str, str]] = []

    def try_take(pkg: str, card: int | None) -> bool:
        for key, d in sorted(devices.items()):
            if d.package != pkg or key in taken or (card is not None and d.counter_set != f"gpu-{card}"):
                continue
            if d.consumes["memory"] <= room[d.counter_set]:
                room[d.counter_set] -= d.consumes["memory"]
                taken.append(key)
                return True
        return False

    for pkg, card in picks:
        if card < gpus:
            try_take(pkg, card)
    before = package_capacity(package, slices, taken)
    assert before.allocated + before.free <= before.total
    placed = 0
    while try_take(package, None):
        placed += 1
    assert placed == before.free
    assert package_capacity(package, slices, taken).free == 0
