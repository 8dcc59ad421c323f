"""Work-conserving compute on the driver double: n slices of share 25 on one simulated card, the
first a burst slice, with the node agent's measurement and allowance loop (what
UtilizationFeedback.step does: NVML per-process samples through the double's host-side daemon, then
gpuslice.domain.burst.allowances written into each burst slice's utilization file).

Used by tests/shim/test_shim_burst.py (which asserts) and bench/compute_burst.py (which prints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslice.shim.region import REGION_FILE, create_utilization_file, utilization_file_for
from gpuslice_dev.gpusim.build import ShimPaths, ensure_built
from gpuslice_dev.gpusim.runner import PreparedSlice, prepare
from gpuslice_dev.gpusim.simulate import FAKE_GPU_CONFIG_ENV, start_fake_driverd

SHARE = 25
AGENT_INTERVAL_S = 0.5  # UtilizationFeedback.interval

AGENT_LOOP = """
import json, sys, time
from pathlib import Path
import pynvml
from gpuslice.agent.nvml import UtilizationMeter
from gpuslice.agent.utilization import write_slice_utilization
from gpuslice.domain import burst
from gpuslice.shim.region import write_allowance
uuid, slices, every = sys.argv[1], json.loads(sys.argv[3]), float(sys.argv[4])
log = open(sys.argv[2], "a", buffering=1)
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
    time.sleep(every)
"""


@dataclass
class Card:
    slices: list[PreparedSlice]
    built: ShimPaths
    log: Path

    def env(self, i: int, shim: bool = True) -> dict[str, str]:
        env = {**os.environ, **self.slices[i].env}
        if not shim:
            env.pop("LD_PRELOAD", None)
        return env

    def launch(self, i: int, seconds: float, kernel_us: int) -> subprocess.Popen[str]:
        """The probe launching kernel_us kernels for `seconds` in slice i (synchronizing after each)."""
        probe = self.built.tests_dir / "cuda_probe"
        return subprocess.Popen(
            [str(probe), "launch", str(seconds), str(kernel_us), "kernel"],
            env=self.env(i),
            stdout=subprocess.PIPE,
            text=True,
        )

    def decisions(self) -> list[dict[str, Any]]:
        """The agent loop's records: time, each slice's utilization, each burst slice's allowance."""
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def busy(p: subprocess.Popen[str]) -> float:
    """The fraction of the card a finished probe's second half used (its kernels' nominal time)."""
    out, _ = p.communicate(timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"probe exited {p.returncode}")
    fields = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return float(fields["nominal_busy_fraction"])


@contextmanager
def card(
    n: int, workdir: Path | None = None, burst: bool = True, built: ShimPaths | None = None
) -> Iterator[Card]:
    """n slices of share 25 on one simulated card (the first bursts when `burst`), the double's
    daemon and the agent loop running."""
    built = built or ensure_built()
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuslice-burst-"))
    slices = [
        prepare(
            memory_bytes=4 << 30,
            compute_share=SHARE,
            simulate_gpus="1x Tesla V100-PCIE-32GB",
            seed="burst-node",
            workdir=root / f"slice{i}",
            built=built,
        )
        for i in range(n)
    ]
    shared = slices[0].env[FAKE_GPU_CONFIG_ENV]
    for s in slices[1:]:
        s.env[FAKE_GPU_CONFIG_ENV] = shared  # one card: the first slice's double
    log = root / "agent.log"
    spec = [
        {
            "uid": f"slice{i}",
            "share": SHARE,
            "burst": burst and i == 0,
            "region": str(s.usage_dir / REGION_FILE),
            "util": str(create_utilization_file(utilization_file_for(s.config_path))),
        }
        for i, s in enumerate(slices)
    ]
    c = Card(slices, built, log)
    daemon = start_fake_driverd(shared)
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            AGENT_LOOP,
            slices[0].config.gpu_uuid,
            str(log),
            json.dumps(spec),
            str(AGENT_INTERVAL_S),
        ],
        env=c.env(0, shim=False),
    )
    try:
        yield c
    finally:
        for p in (agent, daemon):
            p.kill()
            p.wait(timeout=30)


@dataclass(frozen=True)
class FallBack:
    neighbour: float  # fraction of the card the neighbour used from 2 s to 4 s after it started
    burst_before: float  # percent the burst slice used (agent's figures) in the 2 s before
    burst_after: float  # percent the burst slice used from 2 s to 4 s after
    allowed_before: list[float]
    allowed_after: list[float]


def fall_back(c: Card, kernel_us: int = 10000) -> FallBack:
    """The burst slice (slice 0) runs alone for 5 s, then slice 1 runs for 4 s (its probe measures its
    second half: 2 s to 4 s after it started)."""
    hog = c.launch(0, 14, kernel_us)
    try:
        time.sleep(5)
        started = time.time()
        neighbour = busy(c.launch(1, 4, kernel_us))
    finally:
        hog.kill()
        hog.wait(timeout=30)
    d = c.decisions()
    before = [x for x in d if started - 2 <= x["t"] < started]
    after = [x for x in d if started + 2 <= x["t"] <= started + 4]
    if not before or not after:
        raise RuntimeError("the agent loop recorded nothing around the neighbour's start")

    def mean(xs: list[dict[str, Any]]) -> float:
        return sum(x["util"].get("slice0", 0) for x in xs) / len(xs)

    return FallBack(
        neighbour=neighbour,
        burst_before=mean(before),
        burst_after=mean(after),
        allowed_before=[x["allowed"]["slice0"] for x in before],
        allowed_after=[x["allowed"]["slice0"] for x in after],
    )
