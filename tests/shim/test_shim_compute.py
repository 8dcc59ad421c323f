"""Cooperative compute share: launches are steered toward the share, never at 100."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from gpuslice.shim.region import read_usage, write_utilization
from shim.shim_helpers import GIB, env_of, probe, run, values

LIMIT = 8 * GIB


@pytest.mark.parametrize("kind", ["kernel", "ex", "coop", "graph"])
def test_share_25_is_reached_in_steady_state(make_slice, built, kind):
    s = make_slice(memory_bytes=LIMIT, compute_share=25)
    result = run(s, [probe(built), "launch", "5", "1000", kind])
    assert result.returncode == 0, result.stderr
    busy = float(values(result.stdout)["busy_fraction"])
    assert 0.15 <= busy <= 0.35, f"{kind}: busy {busy:.2f} with share 25"
    snap = read_usage(s.usage_dir)
    assert snap.throttled_seconds_total > 1.0
    assert snap.shim_utilization_percent is not None


def test_share_100_never_throttles(make_slice, built):
    s = make_slice(memory_bytes=LIMIT, compute_share=100)
    result = run(s, [probe(built), "launch", "2", "1000", "kernel"])
    busy = float(values(result.stdout)["busy_fraction"])
    assert busy > 0.8
    snap = read_usage(s.usage_dir)
    assert snap.throttled_seconds_total == 0
    assert snap.throttle_delay_ns == 0


def test_the_agents_utilization_figure_drives_the_throttle(make_slice, built):
    """The agent's figure wins over the shim's own NVML reading: while the agent reports 5 %, a process
    keeping the GPU busy is left alone even at share 20."""
    s = make_slice(memory_bytes=LIMIT, compute_share=20)
    proc = subprocess.Popen(
        [str(probe(built)), "launch", "3", "1000", "kernel"], env=env_of(s), stdout=subprocess.PIPE, text=True
    )
    stop = threading.Event()

    def agent() -> None:
        while not stop.is_set():
            write_utilization(s.usage_dir, 5.0)
            time.sleep(0.1)

    t = threading.Thread(target=agent)
    t.start()
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 0
    assert float(values(out)["busy_fraction"]) > 0.8
    snap = read_usage(s.usage_dir)
    assert snap.shim_utilization_percent == 5.0
    assert snap.throttle_delay_ns == 0


def test_write_utilization_validates_and_needs_a_region(tmp_path):
    assert write_utilization(tmp_path, 50.0) is False
    with pytest.raises(ValueError, match=r"0\.\.100"):
        write_utilization(tmp_path, 150.0)
