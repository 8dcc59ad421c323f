"""Work-conserving compute on the driver double: a burst slice uses its idle card, and gives the
card back once a neighbour runs. Slices share one simulated card; the agent's measurement and
allowance loop runs as the node agent runs it (NVML per-process samples through the double's
host-side daemon, one allowance per burst slice)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gpuslice.shim.region import REGION_FILE, create_utilization_file, utilization_file_for
from gpuslice_dev.gpusim.simulate import FAKE_GPU_CONFIG_ENV, start_fake_driverd
from shim.shim_helpers import GIB, env_of, probe, values

LIMIT = 4 * GIB

#: the agent's loop (UtilizationFeedback.step) for slices of one card, logging what it decided
AGENT_LOOP = """
import json, sys, time
from pathlib import Path
import pynvml
from gpuslice.agent.nvml import UtilizationMeter
from gpuslice.agent.utilization import write_slice_utilization
from gpuslice.domain import burst
from gpuslice.shim.region import write_allowance
uuid, log, slices = sys.argv[1], open(sys.argv[2], "a", buffering=1), json.loads(sys.argv[3])
pynvml.nvmlInit()
meters = {s["uid"]: UtilizationMeter(uuid) for s in slices}
last = {}
while True:
    for s in slices:
        if Path(s["region"]).exists():
            p = write_slice_utilization(meters[s["uid"]], Path(s["region"]), Path(s["util"]))
            if p is not None:
                last[s["uid"]] = p
    loads = [burst.SliceLoad(s["uid"], s["share"], s["burst"], last.get(s["uid"])) for s in slices]
    allowed = burst.allowances(loads)
    for s in slices:
        if s["uid"] in allowed:
            write_allowance(Path(s["util"]), allowed[s["uid"]])
    log.write(json.dumps({"t": time.time(), "util": last, "allowed": allowed}) + "\\n")
    time.sleep(0.5)
"""


def _card(make_slice, n: int, burst_first: bool = True):
    """n slices of share 25 on one simulated card (the first bursts), and the agent loop for them."""
    slices = [make_slice(memory_bytes=LIMIT, compute_share=25) for _ in range(n)]
    shared = slices[0].env[FAKE_GPU_CONFIG_ENV]
    for s in slices[1:]:
        s.env[FAKE_GPU_CONFIG_ENV] = shared  # one card: the first slice's double
    daemon = start_fake_driverd(shared)
    log = slices[0].workdir / "agent.log"
    spec = [
        {
            "uid": f"slice{i}",
            "share": 25,
            "burst": burst_first and i == 0,
            "region": str(s.usage_dir / REGION_FILE),
            "util": str(create_utilization_file(utilization_file_for(s.config_path))),
        }
        for i, s in enumerate(slices)
    ]
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_LOOP, slices[0].config.gpu_uuid, str(log), json.dumps(spec)],
        env=env_of(slices[0], shim=False),
    )
    return slices, daemon, agent, log


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def _launch(s, built, seconds: float, kernel_us: int) -> subprocess.Popen:
    return subprocess.Popen(
        [str(probe(built)), "launch", str(seconds), str(kernel_us), "kernel"],
        env=env_of(s),
        stdout=subprocess.PIPE,
        text=True,
    )


def _busy(p: subprocess.Popen) -> float:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0
    return float(values(out)["nominal_busy_fraction"])


@pytest.mark.parametrize("n", [2, 4])
def test_a_burst_slice_alone_uses_the_card(make_slice, built, n):
    slices, daemon, agent, _ = _card(make_slice, n)
    try:
        # 20 ms kernels: see test_shim_compute.test_share_100_never_throttles
        busy = _busy(_launch(slices[0], built, 6, 20000))
    finally:
        _stop(agent, daemon)
    assert busy >= 0.90, f"a burst slice of share 25 alone on a card of {n} slices used {busy:.2f}"


def test_without_burst_the_share_stays_a_ceiling(make_slice, built):
    """The same card and agent, the package not bursting: the slice stays at its share."""
    slices, daemon, agent, _ = _card(make_slice, 2, burst_first=False)
    try:
        busy = _busy(_launch(slices[0], built, 6, 10000))
    finally:
        _stop(agent, daemon)
    assert 0.15 <= busy <= 0.35, f"busy {busy:.2f} with share 25 and no burst"


@pytest.mark.parametrize("n", [2, 4])
def test_a_neighbour_gets_its_share_within_2_s(make_slice, built, n):
    """While the burst slice uses the whole card, a neighbour starts: from 2 s on it gets 25 % +-5
    points, and the burst slice is back at its share."""
    slices, daemon, agent, log = _card(make_slice, n)
    try:
        hog = _launch(slices[0], built, 14, 10000)
        time.sleep(5)  # the burst slice has the card
        started = time.time()
        # the probe measures its second half: from 2 s after its start to 4 s
        neighbour = _busy(_launch(slices[1], built, 4, 10000))
        hog.kill()
        hog.wait(timeout=30)
    finally:
        _stop(agent, daemon)
    decisions = [json.loads(line) for line in log.read_text().splitlines()]
    before = [d for d in decisions if started - 2 <= d["t"] < started]
    after = [d for d in decisions if started + 2 <= d["t"] <= started + 4]
    assert before and after
    assert all(d["allowed"]["slice0"] == 100 for d in before), before
    assert all(d["allowed"]["slice0"] == 25 for d in after), after
    # the agent's figures (half-second samples) over the same window as the neighbour's
    burst_after = sum(d["util"]["slice0"] for d in after) / len(after)
    print(f"burst n={n}: neighbour {neighbour:.3f} of the card from 2 s to 4 s, burst slice {burst_after:.1f} %")
    assert 0.20 <= neighbour <= 0.30, f"neighbour got {neighbour:.2f} of the card with {n} slices"
    assert burst_after <= 30, f"burst slice did not fall back to its 25 %: {burst_after:.1f} % from 2 s to 4 s"
