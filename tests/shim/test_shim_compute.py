"""Cooperative compute share: launches are steered toward the share, never at 100."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from gpuslice.shim.region import (
    OFFSET_AGENT_UTILIZATION,
    REGION_FILE,
    create_utilization_file,
    read_usage,
    utilization_file_for,
    write_allowance,
    write_utilization,
)
from gpuslice_dev.gpusim.simulate import start_fake_driverd
from shim.shim_helpers import GIB, env_of, probe, run, values

LIMIT = 8 * GIB


def _launch_beside(s, built, launch: list[str], write: Callable[[], None], every: float) -> str:
    """The probe's `launch *launch` in slice `s` while a thread calls `write` every `every` seconds
    (another writer of what the shim reads); its output, once it exited 0."""
    proc = subprocess.Popen(
        [str(probe(built)), "launch", *launch], env=env_of(s), stdout=subprocess.PIPE, text=True
    )
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            write()
            time.sleep(every)

    t = threading.Thread(target=writer)
    t.start()
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 0
    return out


@pytest.mark.parametrize("kind", ["kernel", "ex", "coop", "graph"])
def test_share_25_is_reached_in_steady_state(make_slice, built, kind):
    s = make_slice(memory_bytes=LIMIT, compute_share=25)
    # 10 ms kernels: on a loaded host each launch's wake-up (the double's kernel is a sleep) can take
    # milliseconds, which with 1 ms kernels alone would hold the GPU near 25 % and leave the throttle
    # nothing to do; the kernel must dominate for the throttle's part to be measured
    result = run(s, [probe(built), "launch", "5", "10000", kind])
    assert result.returncode == 0, result.stderr
    busy = float(values(result.stdout)["busy_fraction"])
    assert 0.15 <= busy <= 0.35, f"{kind}: busy {busy:.2f} with share 25"
    snap = read_usage(s.usage_dir)
    assert snap.throttled_seconds_total > 1.0
    assert snap.shim_utilization_percent is not None


def test_share_100_never_throttles(make_slice, built):
    s = make_slice(memory_bytes=LIMIT, compute_share=100)
    # 20 ms kernels: the host's wake-up after each (the double's kernel is a sleep), a fraction of a
    # millisecond on a loaded machine, stays a few percent of the time instead of counting as throttling
    result = run(s, [probe(built), "launch", "2", "20000", "kernel"])
    busy = float(values(result.stdout)["busy_fraction"])
    assert busy > 0.8
    snap = read_usage(s.usage_dir)
    assert snap.throttled_seconds_total == 0
    assert snap.throttle_delay_ns == 0


def test_the_agents_utilization_figure_drives_the_throttle(make_slice, built):
    """The agent's figure wins over the shim's own NVML reading: while the agent reports 5 %, a process
    keeping the GPU busy is left alone even at share 20."""
    s = make_slice(memory_bytes=LIMIT, compute_share=20)
    util = create_utilization_file(utilization_file_for(s.config_path))
    # 20 ms kernels: see test_share_100_never_throttles
    out = _launch_beside(s, built, ["3", "20000", "kernel"], lambda: write_utilization(util, 5.0), 0.1)
    assert float(values(out)["busy_fraction"]) > 0.8
    snap = read_usage(s.usage_dir)
    assert snap.shim_utilization_percent == 5.0
    assert snap.throttle_delay_ns == 0


def test_a_figure_written_into_the_usage_region_is_not_trusted(make_slice, built):
    """Every process of a slice can write its usage region: a tenant writing "5 %" into the word the
    agent once used must not switch its throttle off."""
    s = make_slice(memory_bytes=LIMIT, compute_share=20)
    region = s.usage_dir / REGION_FILE

    def tenant() -> None:
        if region.exists() and region.stat().st_size >= 4096:
            with open(region, "r+b") as f:
                f.seek(OFFSET_AGENT_UTILIZATION)
                f.write(((int(time.time() * 1000) << 16) | 500).to_bytes(8, "little"))

    out = _launch_beside(s, built, ["4", "1000", "kernel"], tenant, 0.05)
    assert float(values(out)["busy_fraction"]) < 0.35


def test_write_utilization_validates_and_needs_the_file(tmp_path):
    assert write_utilization(tmp_path / "utilization", 50.0) is False
    (tmp_path / "other").write_bytes(bytes(16))
    assert write_utilization(tmp_path / "other", 50.0) is False, "not a utilization file"
    path = create_utilization_file(tmp_path / "utilization")
    assert write_utilization(path, 50.0) is True
    with pytest.raises(ValueError, match=r"0\.\.100"):
        write_utilization(path, 150.0)


AGENT_LOOP = """
import sys, time
from pathlib import Path
import pynvml
from gpuslice.agent.nvml import UtilizationMeter
from gpuslice.agent.utilization import write_slice_utilization
uuid, region, util = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
pynvml.nvmlInit()
meter = UtilizationMeter(uuid)
while True:
    if region.exists():
        write_slice_utilization(meter, region, util)
    time.sleep(0.2)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_share_holds_inside_a_pid_namespace(make_slice, built):
    """In a pod the tenant's PIDs are not the ones NVML reports. The agent (host PIDs, through the
    double's host-side daemon) measures the slice and the shim steers on its read-only figure."""
    s = make_slice(memory_bytes=LIMIT, compute_share=25)
    daemon = start_fake_driverd(s.workdir / "fake-gpus.conf")
    util = create_utilization_file(utilization_file_for(s.config_path))
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT_LOOP, s.config.gpu_uuid, str(s.usage_dir / REGION_FILE), str(util)],
        env=env_of(s, shim=False),
    )
    try:
        result = run(
            s, ["unshare", "--pid", "--fork", "--mount-proc", probe(built), "launch", "5", "1000", "kernel"]
        )
        assert result.returncode == 0, result.stderr
        busy = float(values(result.stdout)["busy_fraction"])
        assert 0.15 <= busy <= 0.35, f"busy {busy:.2f} with share 25 inside a PID namespace"
    finally:
        agent.kill()
        agent.wait(timeout=30)
        daemon.terminate()
        daemon.wait(timeout=30)


def test_an_older_agents_utilization_file_grows_in_place_for_the_allowance(tmp_path):
    """A file of the 16-byte layout (an agent before computeBurst) keeps its inode, which a
    container's bind mount pins, and gains the allowance word."""
    path = tmp_path / "utilization"
    path.write_bytes(b"GSUTIL01" + bytes(8))
    inode = path.stat().st_ino
    assert write_allowance(path, 100.0) is False, "no room for the allowance yet"
    create_utilization_file(path)
    assert path.stat().st_ino == inode and path.stat().st_size == 24
    assert write_allowance(path, 100.0) is True and write_utilization(path, 40.0) is True
    with pytest.raises(ValueError, match=r"1\.\.100"):
        write_allowance(path, 0)


def test_a_stale_allowance_is_not_a_burst(make_slice, built):
    """An allowance older than 3 s (a stopped agent) no longer lifts the share."""
    s = make_slice(memory_bytes=LIMIT, compute_share=25)
    util = create_utilization_file(utilization_file_for(s.config_path))
    out = _launch_beside(
        s, built, ["5", "10000", "kernel"], lambda: write_allowance(util, 100.0, now=time.time() - 10), 0.1
    )
    assert float(values(out)["busy_fraction"]) <= 0.35
