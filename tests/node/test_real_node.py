"""A GpuSlice pod on a real node: kubelet -> agent gRPC -> CDI -> containerd -> runc, as a tenant sees it."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice import constants
from gpuslice.agent.cdi import spec_file_name
from gpuslice.shim.region import REGION_FILE, REGION_SIZE
from gpuslice_dev.agents import DEV_USAGE_INTERVAL
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import agent_process_name, start_agents
from gpuslice_dev.devcluster.realnode import dirs_of, leftovers, start_real_nodes
from node.node_cluster import GPU_SPEC, TENANT, delete, exec_in, run_pod, sleeping_slice_pod, slice_pod
from support import get_json, skip_unless_served, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=150)]
NODE = "real-node-0"


@pytest.fixture(scope="module")
def probe_pod(node_cluster: DevCluster) -> Iterator[str]:
    """One long-running slice pod the read-only checks share."""
    with sleeping_slice_pod(node_cluster, "probe") as pod:
        yield pod


def claim_spec_file(cluster: DevCluster, claim: str) -> Path:
    uid = get_json(cluster, "resourceclaim", claim, "-n", TENANT)["metadata"]["uid"]
    return dirs_of(cluster, NODE).cdi_dirs[0] / spec_file_name(uid)


def test_real_node_registers_with_its_kubelet_and_runtime(node_cluster: DevCluster) -> None:
    node = get_json(node_cluster, "node", NODE)
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == node_cluster.kubernetes
    assert info["containerRuntimeVersion"] == "containerd://2.4.2"
    internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert internal and not internal[0].startswith("127."), node["status"]["addresses"]


def test_pod_logs_live_in_the_nodes_own_dir_not_the_machines(
    node_cluster: DevCluster, probe_pod: str
) -> None:
    """Two dev clusters on one machine (the suite's workers, two demos) must not share /var/log/pods:
    each kubelet deletes the log dirs there of pods it does not know, and `kubectl logs` of the other
    cluster's pods came back empty."""
    uid = get_json(node_cluster, "pod", probe_pod, "-n", TENANT)["metadata"]["uid"]
    own = dirs_of(node_cluster, NODE).pod_logs
    mine = list(own.glob(f"{TENANT}_{probe_pod}_{uid}/*/*.log")) if own.is_dir() else []
    assert mine, f"no log of pod {probe_pod} under {own}"
    assert not list(Path("/var/log/pods").glob(f"*_{uid}")), (
        "the pod's logs went to the machine's /var/log/pods"
    )
    rc, _, _ = exec_in(node_cluster, probe_pod, "sh", "-c", "echo from-the-probe > /proc/1/fd/1")
    assert rc == 0
    logs = node_cluster.kubectl("logs", "-n", TENANT, probe_pod, check=False)
    assert "from-the-probe" in logs.stdout, logs


def test_slice_pod_sees_exactly_its_slice_through_nvml(node_cluster: DevCluster, probe_pod: str) -> None:
    rc, out, err = exec_in(node_cluster, probe_pod, "gpuslice-probe", "smi")
    assert rc == 0, err
    # one card (the node has two), at the slice's size: what nvidia-smi would print
    assert out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"]


def test_allocation_past_the_slice_fails_with_out_of_memory(node_cluster: DevCluster, probe_pod: str) -> None:
    rc, out, err = exec_in(node_cluster, probe_pod, "gpuslice-probe", "alloc", "4Gi", "3Gi", "2Gi")
    assert rc == 0, err
    assert out.strip().splitlines() == [
        f"cuMemAlloc({4 << 30}) -> 0 CUDA_SUCCESS",
        f"cuMemAlloc({3 << 30}) -> 0 CUDA_SUCCESS",
        f"cuMemAlloc({2 << 30}) -> 2 CUDA_ERROR_OUT_OF_MEMORY",
    ]


def test_the_cuda_runtime_sees_the_slice_and_runs_out_at_its_edge(
    node_cluster: DevCluster, probe_pod: str
) -> None:
    """NVIDIA's libcudart 12.9 (from its PyPI wheel, in the image) in a real container: the runtime
    reaches the driver through cuGetProcAddress and its export tables, the shim still holds."""
    rc, out, err = exec_in(node_cluster, probe_pod, "gpuslice-cudart-probe", "info")
    assert rc == 0, err
    assert out.strip() == "Tesla V100-PCIE-32GB, 8192 MiB, free 8192 MiB, runtime 12090, driver 12020"
    rc, out, err = exec_in(
        node_cluster, probe_pod, "gpuslice-cudart-probe", "alloc", "4096", "3072", "2048", "1024"
    )
    assert rc == 0, err
    assert out.strip().splitlines() == [
        f"cudaMalloc({4 << 30}) -> 0 cudaSuccess",
        f"cudaMalloc({3 << 30}) -> 0 cudaSuccess",
        f"cudaMalloc({2 << 30}) -> 2 cudaErrorMemoryAllocation",
        f"cudaMalloc({1 << 30}) -> 0 cudaSuccess",
    ]


@pytest.mark.parametrize(
    "path", ["/etc/ld.so.preload", "/etc/gpuslice/slice.conf", "/etc/gpuslice/utilization"]
)
@pytest.mark.parametrize(
    "attack",
    [
        "echo /tmp/evil.so > {p}",
        "echo >> {p}",
        "rm -f {p}",
        "mv {p} {p}.old",
        "umount {p}",
        "mount -o remount,rw,bind {p}",
        "chmod 666 {p}",
    ],
)
def test_container_root_cannot_change_the_shim_files(
    node_cluster: DevCluster, probe_pod: str, path: str, attack: str
) -> None:
    _, before, _ = exec_in(node_cluster, probe_pod, "sh", "-c", f"id -u; md5sum {path}")
    assert before.splitlines()[0] == "0", "the attacker is the container's root"
    rc, _, _ = exec_in(node_cluster, probe_pod, "sh", "-c", attack.format(p=path))
    _, after, _ = exec_in(node_cluster, probe_pod, "sh", "-c", f"id -u; md5sum {path}")
    assert rc != 0, f"`{attack.format(p=path)}` succeeded"
    assert after == before, f"{path} changed"


def test_container_root_cannot_cover_the_preload_from_a_user_and_mount_namespace(
    node_cluster: DevCluster, probe_pod: str
) -> None:
    skip_unless_served(
        node_cluster,
        "admissionregistration.k8s.io/v1",
        "mutatingadmissionpolicies",
        "the slice-seccomp MutatingAdmissionPolicy",
    )
    # Under baseline with no seccomp profile (the runtime's default: Unconfined) this worked: the
    # shim was gone and cuMemAlloc(20 GiB) succeeded on the 8 GiB slice.
    pod = get_json(node_cluster, "pod", probe_pod, "-n", TENANT)
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    rc, out, err = exec_in(
        node_cluster, probe_pod, "sh", "-c",
        f"unshare -Urm sh -c 'mount --bind /dev/null /etc/ld.so.preload && gpuslice-probe alloc {20 << 30}'",
    )  # fmt: skip
    assert rc != 0, out
    assert "CUDA_SUCCESS" not in out
    assert "Operation not permitted" in err, err
    # ... and the shim still holds the slice
    rc, out, _ = exec_in(node_cluster, probe_pod, "gpuslice-probe", "alloc", str(20 << 30))
    assert rc == 0 and "CUDA_ERROR_OUT_OF_MEMORY" in out, out


@pytest.mark.parametrize(
    "attack",
    [
        "rm -f {r} && mkfifo {r}",  # froze the agent's reader (open blocked on the event loop)
        "rm -f {r} && ln -s /proc/1/root/etc/shadow {r}",  # a link the root agent would follow
        "mv {r} {r}.old",
    ],
)
def test_container_root_cannot_replace_the_usage_region(
    node_cluster: DevCluster, probe_pod: str, attack: str
) -> None:
    region = f"{constants.CONTAINER_USAGE_DIR}/{REGION_FILE}"
    rc, _, _ = exec_in(node_cluster, probe_pod, "sh", "-c", attack.format(r=region))
    assert rc != 0, f"`{attack.format(r=region)}` succeeded"
    rc, out, err = exec_in(node_cluster, probe_pod, "sh", "-c", f"test -f {region} && ! test -L {region}")
    assert rc == 0, (out, err)


def test_what_a_slice_writes_beside_or_past_its_region_is_not_the_hosts(
    node_cluster: DevCluster, probe_pod: str
) -> None:
    # 300 MiB went into the host's run dir from a pod limited to 20 MiB of ephemeral storage.
    spec = json.loads(claim_spec_file(node_cluster, probe_pod).read_text())
    [host_region] = [
        Path(m["hostPath"])
        for m in spec["devices"][0]["containerEdits"]["mounts"]
        if m["containerPath"].endswith(REGION_FILE)
    ]
    region = f"{constants.CONTAINER_USAGE_DIR}/{REGION_FILE}"
    rc, _, err = exec_in(
        node_cluster, probe_pod, "sh", "-c",
        f"dd if=/dev/zero of={constants.CONTAINER_USAGE_DIR}/big bs=1M count=16 && "
        f"dd if=/dev/zero of={region} bs=1M seek=1 count=16 conv=notrunc",
    )  # fmt: skip
    assert rc == 0, err
    assert sorted(p.name for p in host_region.parent.iterdir()) == [REGION_FILE]  # "big" is the container's
    # the region itself grew on the host: the agent cuts it back at its next reading
    wait_for(
        lambda: host_region.stat().st_size == REGION_SIZE,
        4 * DEV_USAGE_INTERVAL,
        "the region cut back to its size",
    )
    rc, out, _ = exec_in(node_cluster, probe_pod, "gpuslice-probe", "alloc", str(1 << 30))
    assert rc == 0 and "CUDA_SUCCESS" in out, out  # the slice works as before


def test_the_workload_is_pid_1_of_its_own_pid_namespace(node_cluster: DevCluster, probe_pod: str) -> None:
    _, cmdline, _ = exec_in(node_cluster, probe_pod, "cat", "/proc/1/cmdline")
    assert cmdline.split("\0")[:2] == ["sleep", "3600"]
    _, ps, _ = exec_in(node_cluster, probe_pod, "ps", "-o", "comm")
    assert not {"kubelet", "containerd", "python3"} & set(ps.split()), "the host's processes are visible"


def test_compute_share_holds_inside_the_pid_namespace(node_cluster: DevCluster, probe_pod: str) -> None:
    # v100-8g sells 25 % of the card's compute; unthrottled the probe takes 75-100 % of it.
    rc, out, err = exec_in(node_cluster, probe_pod, "gpuslice-probe", "burn", "8")
    assert rc == 0, err
    share = float(out.strip().splitlines()[-1].split()[1])
    assert 10 <= share <= 40, out


def test_deleting_the_pod_unprepares_its_claim(node_cluster: DevCluster) -> None:
    pod = run_pod(node_cluster, slice_pod("unprepare", ["sleep", "3600"]))
    spec = claim_spec_file(node_cluster, pod)
    assert spec.exists(), "prepare wrote the claim's CDI spec where containerd reads it"
    delete(node_cluster, "pod", pod)
    wait_for(lambda: not spec.exists(), 60, "kubelet's NodeUnprepareResources to remove the CDI spec")
    delete(node_cluster, "gpuslice", pod)


def _waiting_for_a_config_map(name: str) -> list[dict[str, Any]]:
    """A slice pod that mounts a ConfigMap not there yet: kubelet waits on its volumes and does not
    ask the agent to prepare the claim until the ConfigMap is made."""
    docs = slice_pod(name, ["sleep", "3600"])
    spec: Any = docs[1]["spec"]
    spec["volumes"] = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    spec["containers"][0]["volumeMounts"] = [{"name": "config", "mountPath": "/config"}]
    return docs


def _agent_log(cluster: DevCluster, claim: str) -> list[dict[str, Any]]:
    lines = (cluster.dir / "logs" / f"agent-{NODE}.log").read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r.get("claim") == f"{TENANT}/{claim}"]


def test_a_claim_is_prepared_while_kubelet_mounts_the_pods_volumes(node_cluster: DevCluster) -> None:
    """The agent prepares a bound pod's claim without waiting for kubelet's call (kubelet asks only
    once the pod's volumes are mounted, and then waits for the answer): here kubelet cannot mount a
    volume yet, and the claim is prepared all the same; once it can, kubelet's call is answered from
    what was prepared and the pod runs on its slice."""
    docs = _waiting_for_a_config_map("early")
    try:
        node_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        spec = wait_for(
            lambda: (f := claim_spec_file(node_cluster, "early")).exists() and f, 60, "the claim prepared"
        )
        pod = get_json(node_cluster, "pod", "early", "-n", TENANT)
        assert pod["spec"]["nodeName"] == NODE and pod["status"]["phase"] == "Pending", pod["status"]
        [prepared] = [r for r in _agent_log(node_cluster, "early") if r["event"] == "claim prepared"]
        assert prepared["ahead_of_kubelet"] is True

        node_cluster.kubectl("create", "configmap", "early-config", "-n", TENANT, "--from-literal=a=b")
        run_pod(node_cluster, [docs[1]])
        rc, out, err = exec_in(node_cluster, "early", "gpuslice-probe", "smi")
        assert (rc, out.strip()) == (0, "Tesla V100-PCIE-32GB, 8192 MiB"), err
        events = [r["event"] for r in _agent_log(node_cluster, "early")]
        assert events.count("claim prepared") == 1, events
        assert "claim prepared ahead taken by kubelet" in events, events

        delete(node_cluster, "pod", "early")  # kubelet's to unprepare now, as for any claim it prepared
        wait_for(lambda: not spec.exists(), 60, "kubelet's NodeUnprepareResources to remove the CDI spec")
    finally:
        delete(node_cluster, "pod", "early")
        delete(node_cluster, "configmap", "early-config")
        delete(node_cluster, "gpuslice", "early")


def test_a_claim_prepared_for_a_pod_that_never_started_is_given_back(node_cluster: DevCluster) -> None:
    """kubelet unprepares only what it prepared: a claim the agent prepared ahead for a pod deleted
    before kubelet got to it would stay on the node (its files, its card's memory in the agent's
    count) unless the agent gives it back itself."""
    docs = _waiting_for_a_config_map("never")
    try:
        node_cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        spec = wait_for(
            lambda: (f := claim_spec_file(node_cluster, "never")).exists() and f, 60, "the claim prepared"
        )
        uid = get_json(node_cluster, "resourceclaim", "never", "-n", TENANT)["metadata"]["uid"]
        delete(node_cluster, "pod", "never")
        wait_for(lambda: not spec.exists(), 30, "the agent to give the claim back")
        checkpoint = dirs_of(node_cluster, NODE).base / "agent" / "state" / "checkpoint.json"
        # the agent removes the claim's files before it rewrites its checkpoint: wait for the record
        wait_for(
            lambda: uid not in json.loads(checkpoint.read_text())["claims"],
            30,
            "the agent's checkpoint to drop the claim",
        )
    finally:
        delete(node_cluster, "pod", "never")
        delete(node_cluster, "gpuslice", "never")


def test_a_slice_deleted_while_its_pod_runs_is_released_before_its_name_is_taken_again(
    node_cluster: DevCluster,
) -> None:
    """A GpuSlice deleted while its pod runs stays (Releasing, naming the pod) with its claim and its
    usage until that pod is gone: the device is still held. Only then can the name be taken again,
    and the new slice gets a claim of its own, with its own usage."""
    docs = slice_pod("again", ["sleep", "3600"])
    run_pod(node_cluster, docs)
    old = get_json(node_cluster, "resourceclaim", "again", "-n", TENANT)["metadata"]
    old_slice = old["ownerReferences"][0]["uid"]
    try:
        node_cluster.kubectl("delete", "gpuslice", "again", "-n", TENANT, "--wait=false")

        def status() -> dict[str, Any]:
            return dict((get_json(node_cluster, "gpuslice", "again", "-n", TENANT) or {}).get("status") or {})

        st = wait_for(
            lambda: (s := status()).get("phase") == "Releasing" and s, 60, "the slice to be Releasing"
        )
        assert st.get("heldBy") == ["again"], st
        assert get_json(node_cluster, "gpuslice", "again", "-n", TENANT)["metadata"]["uid"] == old_slice
        assert get_json(node_cluster, "resourceclaim", "again", "-n", TENANT)["metadata"]["uid"] == old["uid"]
        # still held, still the tenant's: the pod's GPU works as before
        rc, _, err = exec_in(node_cluster, "again", "gpuslice-probe", "alloc", "1Gi")
        assert rc == 0, err

        delete(node_cluster, "pod", "again")  # the last consumer gone: the slice and its claim go
        wait_for(
            lambda: get_json(node_cluster, "gpuslice", "again", "-n", TENANT) is None, 60, "the slice to go"
        )
        node_cluster.apply(json.dumps(docs[0]))
        new_uid = get_json(node_cluster, "gpuslice", "again", "-n", TENANT)["metadata"]["uid"]
        assert new_uid != old_slice
        st = wait_for(lambda: (s := status()).get("reason") == "WaitingForPod" and s, 60, "its own claim")
        claim = get_json(node_cluster, "resourceclaim", "again", "-n", TENANT)["metadata"]
        assert claim["uid"] != old["uid"] and claim["ownerReferences"][0]["uid"] == new_uid
        run_pod(node_cluster, [docs[1]])
        st = wait_for(
            lambda: (s := status()).get("phase") == "InUse" and "usage" in s and s, 60, "in use, with usage"
        )
        assert {c["type"]: c["status"] for c in st["conditions"]}["MemoryIsolated"] == "True"
        assert st["usage"]["refusedAllocations"] == 0, st["usage"]
    finally:
        delete(node_cluster, "pod", "again")
        delete(node_cluster, "gpuslice", "again")


def test_agent_restart_keeps_prepared_claims(node_cluster: DevCluster) -> None:
    pod = run_pod(node_cluster, slice_pod("restart", ["sleep", "3600"]))
    spec = claim_spec_file(node_cluster, pod)
    st = node_cluster.state()
    assert st is not None
    agent = st.processes[agent_process_name(NODE)]
    os.kill(agent.pid, signal.SIGKILL)
    wait_for(lambda: not agent.alive(), 30, "the agent to die")
    assert start_agents(node_cluster, GPU_SPEC) == [NODE]
    # the running workload keeps its slice, and kubelet still unprepares through the new agent
    rc, out, err = exec_in(node_cluster, pod, "gpuslice-probe", "smi")
    assert (rc, out.strip()) == (0, "Tesla V100-PCIE-32GB, 8192 MiB"), err
    other = run_pod(node_cluster, slice_pod("after-restart", ["sleep", "3600"]))
    delete(node_cluster, "pod", pod)
    wait_for(lambda: not spec.exists(), 60, "the restarted agent to unprepare the old claim")
    for name in (pod, other):
        delete(node_cluster, "pod", name)
        delete(node_cluster, "gpuslice", name)


def test_down_leaves_no_process_mount_or_network_behind(tmp_path_factory: pytest.TempPathFactory) -> None:
    if os.geteuid() != 0:
        pytest.skip("real nodes need root")
    c = DevCluster(tmp_path_factory.mktemp("downtest"), progress=lambda m: print(m, file=sys.stderr))
    try:
        c.up(nodes=0)
        start_real_nodes(c, 1)
        c.create_namespace(TENANT)
        docs = slice_pod("plain", ["sleep", "3600"])[1:]
        docs[0]["spec"].pop("resourceClaims")  # type: ignore[union-attr]
        docs[0]["spec"]["containers"][0].pop("resources")  # type: ignore[index]
        run_pod(c, docs)
        st = c.state()
        assert st is not None
        slots = dict(st.node_slots)
        d = dirs_of(c, NODE)
        assert leftovers(c.dir, slots)["mounts"], "a running pod has mounts (so the check can see them)"
    finally:
        c.down()
    assert leftovers(c.dir, slots) == {"mounts": [], "links": [], "processes": []}
    assert not list(Path("/sys/fs/cgroup/memory").glob(d.cgroup_root.lstrip("/"))), (
        "the node's cgroups remain"
    )
    assert not (d.containerd_state / "netns").exists() or not list((d.containerd_state / "netns").iterdir())


def test_a_cdi_annotation_on_a_pod_injects_no_device(node_cluster: DevCluster) -> None:
    """containerd with CDI on also reads `cdi.k8s.io/*` annotations; from a pod they must not reach it."""
    docs = slice_pod("cdi-annotation", ["sleep", "3600"])[1:]
    spec = docs[0]["spec"]
    spec.pop("resourceClaims")  # type: ignore[union-attr]
    spec["containers"][0].pop("resources")  # type: ignore[index]
    docs[0]["metadata"]["annotations"] = {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}  # type: ignore[index]
    pod = run_pod(node_cluster, docs)
    rc, out, _ = exec_in(
        node_cluster, pod, "sh", "-c", "ls /dev/nvidia* /usr/lib/x86_64-linux-gnu/libcuda.so.1"
    )
    assert rc != 0 and "nvidia0" not in out, out
    delete(node_cluster, "pod", pod)
