"""The one parser of each wire format gpuslice reads: ResourceSlices, allocations, pods' claim
references, refusal messages, /proc/<pid>/stat, and the one atomic file write."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice import procfs
from gpuslice.api.pod import claim_refs, resolved_claims
from gpuslice.api.refusal import is_quota_refusal
from gpuslice.api.resourceclaim import allocated_node, allocation_results
from gpuslice.api.resourceslice import attribute, find_device, parse_resource_slices
from gpuslice.files import atomic_write
from support import allocated_claim, pod_doc, published, wait_for


def test_the_newest_generation_of_a_pool_is_the_one_read() -> None:
    old = published("n0", 2, {"v100-8g": 25}, generation=1)
    new = published("n0", 1, {"v100-16g": 50}, generation=2)
    slices = parse_resource_slices(old + new)
    assert find_device(slices, "n0", "gpu-0-v100-8g-0") is None  # only in the old generation
    device = find_device(slices, "n0", "gpu-0-v100-16g-0")
    assert device is not None
    assert (device.package, device.uuid, device.memory_bytes, device.compute_share) == (
        "v100-16g",
        "GPU-n0-0",
        16 * 1024**3,
        50,
    )


def test_attributes_are_read_by_short_or_qualified_name() -> None:
    assert attribute({"uuid": {"string": "GPU-1"}}, "uuid") == "GPU-1"
    assert attribute({"gpuslice.io/computeShare": {"int": 25}}, "computeShare") == 25
    assert attribute({"x": {"bool": True}}, "uuid") is None


def test_allocation_results_of_one_driver_and_the_node() -> None:
    claim = allocated_claim("ns", "c", "node-a", "gpu-0-v100-8g-0")
    claim["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "sriov.example.com", "pool": "node-a", "device": "vf0"}
    )
    assert [(r.request, r.pool, r.device) for r in allocation_results(claim)] == [
        ("gpu", "node-a", "gpu-0-v100-8g-0")
    ]
    assert len(allocation_results(claim, driver=None)) == 2
    assert allocated_node(claim) == "node-a"
    assert allocation_results({"status": {}}) == [] and allocated_node({}) is None


def test_pod_claim_references_resolve_generated_claims() -> None:
    pod = pod_doc("p", "ns", template="workers")
    pod["spec"]["resourceClaims"].append({"name": "direct", "resourceClaimName": "mine"})
    assert [(r.name, r.claim, r.template) for r in claim_refs(pod["spec"])] == [
        ("gpu", None, "workers"),
        ("direct", "mine", None),
    ]
    assert resolved_claims(pod) == {"gpu": None, "direct": "mine"}  # not generated yet
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}]}
    assert resolved_claims(pod) == {"gpu": "p-gpu-x1", "direct": "mine"}


def test_quota_refusals_are_told_from_other_refusals() -> None:
    assert is_quota_refusal('resourceclaims "s" is forbidden: exceeded quota: gpuslice, requested: x=1')
    assert not is_quota_refusal('resourceclaims "s" is forbidden: ValidatingAdmissionPolicy denied')
    assert not is_quota_refusal(None) and not is_quota_refusal("")


def test_proc_stat_with_a_command_name_holding_spaces_and_parentheses() -> None:
    fields = " ".join(["S"] + [str(i) for i in range(1, 19)] + ["123456", "0"])
    stat_line = f"42 (my (odd) cmd) {fields}"
    parsed = procfs.parse_stat(42, stat_line)
    assert (parsed.state, parsed.start_time, parsed.zombie) == ("S", 123456, False)


def test_proc_stat_of_real_processes() -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None and me.start_time > 0 and procfs.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited but not reaped yet: a zombie, which is not alive.
    seen = wait_for(lambda: (s := procfs.read_stat(child.pid)) is not None and s.zombie and s, 30, "zombie")
    assert seen.zombie and not procfs.alive(child.pid)
    child.wait()
    assert procfs.read_stat(child.pid) is None and procfs.start_time(child.pid) is None


@pytest.mark.parametrize("mode", [0o444, 0o555, 0o644])
def test_atomic_write_replaces_with_mode_and_leaves_nothing_else(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "slice.conf"
    target.write_text("old")
    target.chmod(0o444)  # a read-only file is replaced all the same
    atomic_write(target, "new", mode)
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["slice.conf"]
    atomic_write(target, b"\x00bytes")
    assert target.read_bytes() == b"\x00bytes"


def test_atomic_write_into_a_missing_directory_fails_without_leftovers(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "f", "x")
    assert list(tmp_path.iterdir()) == []
