"""The agent's side of the compute share: which host PIDs belong to a slice, and its utilization."""

from __future__ import annotations

import mmap
import os
import subprocess

from gpuslice.agent.utilization import slice_host_pids, slice_utilization


def test_a_slice_process_is_recognised_by_the_region_it_maps(tmp_path):
    region = tmp_path / "usage.bin"
    region.write_bytes(bytes(8192))
    other = subprocess.Popen(["sleep", "30"])
    try:
        with open(region, "r+b") as f, mmap.mmap(f.fileno(), 8192):
            found = slice_host_pids(region, [os.getpid(), other.pid, 999_999_999])
        assert found == {os.getpid()}
        # a copy with the same content is another file: not the slice's
        copy = tmp_path / "copy.bin"
        copy.write_bytes(region.read_bytes())
        with open(copy, "r+b") as f, mmap.mmap(f.fileno(), 8192):
            assert slice_host_pids(region, [os.getpid()]) == set()
    finally:
        other.kill()
        other.wait()


def test_utilization_is_the_sum_of_the_slices_processes_means_capped_at_100():
    samples = [(10, 20.0), (10, 40.0), (11, 15.0), (12, 90.0)]
    assert slice_utilization(samples, {10, 11}) == 45.0
    assert slice_utilization(samples, set()) == 0.0
    assert slice_utilization(samples, {10, 11, 12}) == 100.0
