"""Slice pods as Pod Security's `restricted` profile requires them, on the real node: non-root uids
(1000, and 1000680000 in group 0 with no passwd entry), no privilege escalation, every capability
dropped, RuntimeDefault seccomp, a read-only root filesystem. They get what root gets: the slice in
NVML, out-of-memory at its edge, one account across the slice's containers whatever their uids, usage
in the GpuSlice's status, the throttle. No container can write the driver double's state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster, State
from gpuslice_dev.devcluster.node_agents import fake_gpu_config
from gpuslice_dev.devcluster.realnode import bridge_owner_of, dirs_of, stop_node
from gpuslice_dev.gpusim.build import ensure_built
from node.node_cluster import TENANT, exec_in, restricted_container, sleeping_slice_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=70)]
NODE = "real-node-0"
#: selected by the v100-8g entitlement like the tenant's own namespace, enforced `restricted`
RESTRICTED_NS = "team-a-restricted"
GIB = 1 << 30
HOLDER_UID, TENANT_UID = (1000, 1000), (1000680000, 0)


def _kubectl_ns(cluster: DevCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("-n", RESTRICTED_NS, *args, check=False, timeout=120)


def _exec(cluster: DevCluster, container: str, *command: str) -> tuple[int, str, str]:
    proc = _kubectl_ns(cluster, "exec", "restricted", "-c", container, "--", *command)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def restricted_pod(node_cluster: DevCluster) -> Iterator[DevCluster]:
    """One slice, two containers of different uids: `holder` keeps 6 GiB, `tenant` idles."""
    c = node_cluster
    c.create_namespace(
        RESTRICTED_NS,
        {
            "tenant.example.com/project": TENANT,
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    )
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "gpuslice.io/v1beta1",
            "kind": "GpuSlice",
            "metadata": {"name": "restricted", "namespace": RESTRICTED_NS},
            "spec": {"package": "v100-8g"},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "restricted", "namespace": RESTRICTED_NS},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "restricted"}],
                "containers": [
                    restricted_container("holder", *HOLDER_UID, ["gpuslice-probe", "hold", "6Gi", "0"]),
                    restricted_container("tenant", *TENANT_UID, ["sleep", "3600"]),
                ],
            },
        },
    ]
    c.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    ready = _kubectl_ns(c, "wait", "--for=condition=Ready", "pod/restricted", "--timeout=120s")
    if ready.returncode != 0:
        described = _kubectl_ns(c, "describe", "pod", "restricted").stdout
        events = _kubectl_ns(c, "get", "events", "-o", "wide").stdout
        raise AssertionError(f"restricted pod not Ready:\n{described[-3000:]}\n{events[-2000:]}")
    yield c
    _kubectl_ns(c, "delete", "pod", "restricted", "--wait=true", "--timeout=60s")
    _kubectl_ns(c, "delete", "gpuslice", "restricted", "--wait=true", "--timeout=60s")


def test_the_pod_passed_restricted_admission_and_runs_as_the_uids_asked(restricted_pod: DevCluster) -> None:
    for container, (uid, gid) in (("holder", HOLDER_UID), ("tenant", TENANT_UID)):
        rc, out, err = _exec(restricted_pod, container, "id")
        assert rc == 0, err
        assert f"uid={uid}" in out and f"gid={gid}" in out, out
    rc, out, _ = _exec(restricted_pod, "tenant", "sh", "-c", "touch /x 2>&1; echo rc=$?")
    assert "rc=0" not in out, "the root filesystem is read-only"


@pytest.mark.parametrize("container", ["holder", "tenant"])
def test_each_uid_sees_its_slice_through_nvml(restricted_pod: DevCluster, container: str) -> None:
    rc, out, err = _exec(restricted_pod, container, "gpuslice-probe", "smi")
    assert rc == 0, err
    assert out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"]


def test_the_slice_is_one_account_across_its_containers_uids(restricted_pod: DevCluster) -> None:
    # the holder (uid 1000) keeps 6 GiB; the tenant (uid 1000680000, group 0) gets the rest, no more
    rc, out, err = _exec(restricted_pod, "tenant", "gpuslice-probe", "alloc", "1536Mi", "1Gi")
    assert rc == 0, err
    assert out.strip().splitlines() == [
        f"cuMemAlloc({1536 << 20}) -> 0 CUDA_SUCCESS",
        f"cuMemAlloc({1 << 30}) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
    ]


def test_usage_of_both_uids_reaches_the_slices_status(restricted_pod: DevCluster) -> None:
    def usage() -> dict[str, Any] | None:
        st = (get_json(restricted_pod, "gpuslice", "restricted", "-n", RESTRICTED_NS) or {}).get("status", {})
        u = st.get("usage")
        return u if u and u["memoryUsedBytes"] >= 6 * GIB else None

    u = wait_for(usage, 60, "the holder's 6 GiB in status.usage")
    assert u["memoryLimitBytes"] == 8 * GIB
    assert any(p["memoryUsedBytes"] == 6 * GIB for p in u["processes"]), u


def test_the_throttle_holds_a_non_root_uid(restricted_pod: DevCluster) -> None:
    rc, out, err = _exec(restricted_pod, "tenant", "gpuslice-probe", "burn", "8")
    assert rc == 0, err
    share = float(out.strip().splitlines()[-1].split()[1])
    assert 10 <= share <= 40, out  # v100-8g: 25 % of the card's compute


HOST_NVML = textwrap.dedent(
    """
    import pynvml
    pynvml.nvmlInit()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            print(f"{p.pid} {p.usedGpuMemory}")
    """
)


def _host_nvml(cluster: DevCluster) -> set[tuple[int, int]]:
    """(host pid, bytes) of every process NVML lists on the node, read on the host like the agent."""
    env = {
        **os.environ,
        "GPUSLICE_FAKE_GPU_CONFIG": str(fake_gpu_config(cluster, NODE)),
        "LD_LIBRARY_PATH": str(ensure_built().fake_dir),
    }
    env.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, "-c", HOST_NVML], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return {(int(a), int(b)) for a, b in (line.split() for line in out.stdout.splitlines())}


def _holder_host_pid(cluster: DevCluster) -> int:
    """The holder's host pid: the process of that command in this pod's cgroup (another dev cluster on
    the machine, another xdist worker's, runs the same command as the same uid)."""
    pod_uid = get_json(cluster, "pod", "restricted", "-n", RESTRICTED_NS)["metadata"]["uid"]
    cgroup_ids = (f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            uid = int((entry / "status").read_text().split("\nUid:")[1].split()[0])
            cgroup = (entry / "cgroup").read_text()
        except (OSError, IndexError):
            continue
        mine = any(i in cgroup for i in cgroup_ids)
        if mine and cmd[:4] == [b"gpuslice-probe", b"hold", b"6Gi", b"0"] and uid == HOLDER_UID[0]:
            return int(entry.name)
    raise AssertionError("the holder's process is not on the host")


STATE = "/run/nvidia-fake/fake-gpus.conf.state"
STATE_ATTACKS = [
    f"dd if=/dev/zero of={STATE}/gpu0.bin bs=4096 count=1 conv=notrunc",
    f": > {STATE}/gpu0.bin",
    f"rm -f {STATE}/gpu0.bin",
    f"echo x > {STATE}/new.bin",
    "echo x > /run/nvidia-fake/fake-gpus.conf",
]


@pytest.fixture(scope="module")
def root_pod(node_cluster: DevCluster) -> Iterator[str]:
    """A slice pod whose container runs as root (the strongest tenant without extra capabilities)."""
    with sleeping_slice_pod(node_cluster, "state-root") as pod:
        yield pod


def test_no_container_can_write_the_doubles_state_and_nvml_stays_true(
    restricted_pod: DevCluster, root_pod: str
) -> None:
    c = restricted_pod
    holder = _holder_host_pid(c)
    before = _host_nvml(c)
    assert (holder, 6 * GIB) in before, before
    for attack in STATE_ATTACKS:
        rc, out, err = _exec(c, "tenant", "sh", "-c", f"({attack}) 2>&1; echo rc=$?")
        assert rc == 0 and "rc=" in out and "rc=0" not in out, f"uid {TENANT_UID[0]}: `{attack}`: {out}{err}"
        rc, out, err = exec_in(c, root_pod, "sh", "-c", f"({attack}) 2>&1; echo rc=$?")
        assert rc == 0 and "rc=" in out and "rc=0" not in out, f"root: `{attack}`: {out}{err}"
        assert "Read-only file system" in out, out
    assert _host_nvml(c) == before, "what NVML reports changed"
    rc, out, err = exec_in(c, root_pod, "gpuslice-probe", "smi")
    assert rc == 0 and out.strip() == "Tesla V100-PCIE-32GB, 8192 MiB", out + err


def test_another_devclusters_teardown_leaves_this_nodes_bridge(
    node_cluster: DevCluster, tmp_path: Path
) -> None:
    """Two devclusters on one machine: a cluster whose state names the same node and bridge slot (its
    own bridge was gone when this one took the slot) tears down without touching this node's."""
    c = node_cluster
    d = dirs_of(c, NODE)
    assert bridge_owner_of(d.bridge) == d.bridge_owner
    other = DevCluster(tmp_path / "other")
    other.dir.mkdir(parents=True, exist_ok=True)
    State(dir=str(other.dir), real_nodes=[NODE], node_slots={NODE: d.slot}).save()
    stop_node(other, NODE)
    assert bridge_owner_of(d.bridge) == d.bridge_owner, f"{d.bridge} was deleted by the other cluster"
    with sleeping_slice_pod(c, "after-teardown") as pod:
        rc, out, err = exec_in(c, pod, "gpuslice-probe", "smi")  # kubelet exec over the node's address
        assert rc == 0 and "8192 MiB" in out, err
