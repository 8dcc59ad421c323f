"""Work-conserving compute on the driver double: a burst slice uses its idle card, and gives the
card back once a neighbour runs. The slices share one simulated card; the agent's measurement and
allowance loop runs as the node agent runs it (gpuslice_dev.gpusim.burst)."""

from __future__ import annotations

import pytest

from gpuslice_dev.gpusim import burst


@pytest.mark.parametrize("n", [2, 4])
def test_a_burst_slice_alone_uses_the_card(built, tmp_path, n):
    with burst.card(n, tmp_path, built=built) as c:
        # 20 ms kernels: see test_shim_compute.test_share_100_never_throttles
        used = burst.busy(c.launch(0, 6, 20000))
    assert used >= 0.90, f"a burst slice of share 25 alone on a card of {n} slices used {used:.2f}"


def test_without_burst_the_share_stays_a_ceiling(built, tmp_path):
    """The same card and agent, the package not bursting: the slice stays at its share."""
    with burst.card(2, tmp_path, burst=False, built=built) as c:
        used = burst.busy(c.launch(0, 6, 10000))
    assert 0.15 <= used <= 0.35, f"busy {used:.2f} with share 25 and no burst"


@pytest.mark.parametrize("n", [2, 4])
def test_a_neighbour_gets_its_share_within_2_s(built, tmp_path, n):
    """While the burst slice uses the whole card, a neighbour starts: from 2 s on it gets 25 % +-5
    points, and the burst slice is back at its share."""
    with burst.card(n, tmp_path, built=built) as c:
        f = burst.fall_back(c)
    print(f"burst n={n}: {f}")
    assert all(a == 100 for a in f.allowed_before), f.allowed_before
    assert all(a == 25 for a in f.allowed_after), f.allowed_after
    # a precondition (the >= 90 % figure is test_a_burst_slice_alone_uses_the_card's): well above its
    # share, on a shared and loaded test machine
    assert f.burst_before >= 50, f"the burst slice did not have the card before: {f.burst_before:.1f} %"
    assert 0.20 <= f.neighbour <= 0.30, f"neighbour got {f.neighbour:.2f} of the card with {n} slices"
    # the agent's figures (half-second samples, lagging) over the same window as the neighbour's: back
    # near its share, not at the card it had
    assert f.burst_after <= 35, (
        f"burst slice did not fall back to its 25 %: {f.burst_after:.1f} % from 2 s to 4 s"
    )
