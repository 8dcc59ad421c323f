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


def test_the_agent_writes_each_burst_slices_allowance_from_its_cards_slices(tmp_path):
    """Per card: a burst slice alone running gets the card; one running neighbour on the same card
    holds it to its share; a slice on another card changes nothing."""
    from gpuslice.agent.checkpoint import ClaimRecord, PreparedDevice
    from gpuslice.agent.prepare import NodePaths
    from gpuslice.agent.utilization import UtilizationFeedback
    from gpuslice.shim.region import create_utilization_file, utilization_file_for

    paths = NodePaths(tmp_path / "state", tmp_path / "run", tmp_path / "cdi", tmp_path / "lib.so")

    def record(uid: str, card: str, burst: bool) -> ClaimRecord:
        device = PreparedDevice(
            request="gpu",
            pool="n",
            device=uid,
            gpu_uuid=card,
            memory_bytes=1,
            compute_share=25,
            cdi_device_ids=[],
            compute_burst=burst,
        )
        create_utilization_file(utilization_file_for(paths.claim_dir(uid) / "slice.conf"))
        return ClaimRecord(uid=uid, namespace="t", name=uid, state="Prepared", devices=[device])

    def allowance(uid: str) -> float:
        raw = utilization_file_for(paths.claim_dir(uid) / "slice.conf").read_bytes()
        return (int.from_bytes(raw[16:24], "little") & 0xFFFF) / 100

    records = [record("b", "GPU-0", True), record("n", "GPU-0", False), record("o", "GPU-1", False)]
    feedback = UtilizationFeedback(paths)
    feedback._last.update({"b": 95.0, "n": 0.0, "o": 80.0})
    feedback._write_allowances(records)
    assert allowance("b") == 100 and allowance("n") == 0 and allowance("o") == 0
    feedback._last["n"] = 20.0
    feedback._write_allowances(records)
    assert allowance("b") == 25
