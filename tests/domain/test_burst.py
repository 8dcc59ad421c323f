"""Which share each burst slice of a card may use now."""

from __future__ import annotations

from gpuslice.domain.burst import SliceLoad, allowances


def test_alone_a_burst_slice_may_use_the_whole_card():
    card = [SliceLoad("b", 25, True, 90.0), SliceLoad("n1", 25, False, None), SliceLoad("n2", 25, False, 0.0)]
    assert allowances(card) == {"b": 100.0}


def test_a_running_neighbour_holds_every_burst_slice_to_its_share():
    card = [SliceLoad("b", 25, True, 90.0), SliceLoad("c", 50, True, 10.0), SliceLoad("n", 25, False, 3.0)]
    assert allowances(card) == {"b": 25.0, "c": 50.0}


def test_running_burst_slices_split_the_card_by_share_and_an_idle_one_keeps_its_share():
    card = [SliceLoad("b", 25, True, 40.0), SliceLoad("c", 50, True, 60.0), SliceLoad("d", 25, True, 0.0)]
    got = allowances(card)
    assert got["b"] == 100 * 25 / 75 and got["c"] == 100 * 50 / 75 and got["d"] == 25.0


def test_slices_without_burst_get_no_allowance():
    assert allowances([SliceLoad("n", 25, False, 90.0)]) == {}


def test_the_package_status_says_what_burst_promises():
    from gpuslice.api.package import GpuPackageSpec
    from gpuslice.domain.package_status import guarantees_for

    plain = guarantees_for(GpuPackageSpec(gpuModel="V100", fraction=25))
    burst = guarantees_for(GpuPackageSpec(gpuModel="V100", fraction=25, computeBurst=True))
    assert plain.compute == "Cooperative" and "idle" not in plain.summary
    assert burst.compute == "CooperativeBurst"
    assert "idle compute up to the whole card" in burst.summary and "within 2 s" in burst.summary
