"""One slice's claim shared on a real node (kubelet, containerd, runc, the agent, the shim): the slice's
own pod, a second pod and a pod of two containers all name the claim. It is one slice: its memory
limit holds for all of them together, every one sees the slice's size, and the ledger bills it once,
for the time the device was held (not three or four times that)."""

from __future__ import annotations

import copy
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from node.node_cluster import TENANT, delete, run_pod, slice_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=120)]
GIB = 1 << 30
#: Allowed |billed - seen| seconds: the API's times have whole seconds, and the test polls.
TOLERANCE = 4.0


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _sharer(name: str, claim: str, containers: int = 1) -> dict[str, Any]:
    pod: dict[str, Any] = copy.deepcopy(slice_pod(name, ["sleep", "3600"], claim)[1])
    first = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**copy.deepcopy(first), "name": f"c{i}"} for i in range(containers)]
    return pod


def _in(cluster: DevCluster, pod: str, container: str, *command: str) -> str:
    proc = cluster.kubectl(
        "exec", "-n", TENANT, pod, "-c", container, "--", *command, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_two_pods_and_a_two_container_pod_share_one_slice_and_are_billed_once(
    node_cluster: DevCluster,
) -> None:
    c = node_cluster
    owner = run_pod(c, slice_pod("shared", ["sleep", "3600"]))
    run_pod(c, [_sharer("shared-second", "shared")])
    run_pod(c, [_sharer("shared-pair", "shared", containers=2)])
    claim = get_json(c, "resourceclaim", "shared", "-n", TENANT)
    assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == [
        "shared",
        "shared-pair",
        "shared-second",
    ]
    allocated = time.time()  # (the claim was allocated when the first pod was scheduled: earlier, if at all)
    try:
        # 6 GiB held in one pod for the test; 6 GiB more is refused in each of the others, 1 GiB fits.
        _in(c, owner, "main", "sh", "-c", "gpuslice-probe hold 6Gi 600 > /tmp/hold 2>&1 &")
        wait_for(lambda: "-> 0 CUDA_SUCCESS" in _in(c, owner, "main", "cat", "/tmp/hold"), 30, "6 GiB held")
        for pod, container in (("shared-second", "c0"), ("shared-pair", "c0"), ("shared-pair", "c1")):
            assert _in(c, pod, container, "gpuslice-probe", "smi").strip() == "Tesla V100-PCIE-32GB, 8192 MiB"
            out = _in(c, pod, container, "gpuslice-probe", "alloc", "6Gi", "1Gi").strip().splitlines()
            assert out == [
                f"cuMemAlloc({6 * GIB}) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
                f"cuMemAlloc({GIB}) -> 0 CUDA_SUCCESS",
            ], (
                pod,
                container,
                out,
            )
        time.sleep(5)
    finally:
        for pod in ("shared-second", "shared-pair", owner):
            delete(c, "pod", pod)
    wait_for(
        lambda: (
            not (get_json(c, "resourceclaim", "shared", "-n", TENANT) or {})
            .get("status", {})
            .get("allocation")
        ),
        60,
        "claim deallocated",
    )
    released = time.time()
    delete(c, "gpuslice", "shared")
    month = datetime.now(UTC).strftime("%Y-%m")

    def closed() -> list[dict[str, Any]] | None:
        usage = get_json(c, "gpuusages.gpuslice.io", month, "-n", TENANT) or {}
        mine = [iv for iv in usage.get("intervals") or [] if iv["claim"] == "shared"]
        return mine if mine and all(iv.get("end") for iv in mine) else None

    (iv,) = wait_for(closed, 30, "the shared claim's interval closed")
    billed = _ts(iv["end"]) - _ts(iv["start"])
    seen = released - _ts(iv["start"])
    print(f"\n[shared slice, real node] 3 pods / 4 containers: held {seen:.1f} s, billed {billed:.0f} s")
    assert _ts(iv["start"]) <= allocated + 1
    assert abs(billed - seen) <= TOLERANCE, (iv, released)
