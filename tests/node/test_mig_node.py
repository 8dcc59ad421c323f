"""MIG on the real node: containerd and runc take the agent's CDI spec of a MIG claim, and the container
gets its instance's capability devices and not its neighbour's, the driver's libraries from the
toolkit's spec, and CUDA inside the instance with the driver's own limit (no shim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import fake_gpu_config, start_agents, start_real_node_gpus
from gpuslice_dev.devcluster.realnode import start_real_nodes
from gpuslice_dev.gpusim import simulate
from node.node_cluster import PROBE, TENANT, delete, exec_in, run_pod
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=120)]
NODE = "real-node-0"
SPEC = "1x NVIDIA A100-SXM4-80GB"
PACKAGE = "a100-9g"

MIG_ON = """
import sys
import pynvml
from gpuslice_dev.gpusim import simulate
simulate.use_fake_driver(sys.argv[1])
pynvml.nvmlInit()
assert pynvml.nvmlDeviceSetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0), 1) == 0
"""

INSTANCES = """
import json, sys
from gpuslice.agent import nvml
from gpuslice_dev.gpusim import simulate
simulate.use_fake_driver(sys.argv[1])
with nvml.session():
    d = nvml.devices()[0]
    print(json.dumps({i.uuid: [d.minor_number, i.gpu_instance_id, i.compute_instance_id]
                      for i in nvml.mig_instances(d.uuid)}))
"""


@pytest.fixture(scope="module")
def mig_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (kubelet, containerd, runc)")
    cluster = DevCluster(tmp_path_factory.mktemp("mignode"), progress=lambda m: print(m, file=sys.stderr))
    try:
        cluster.up(nodes=0)
        start_real_nodes(cluster, 1)
        cluster.apply_crds()
        # the node's card, in MIG mode before its agent first looks (the platform's nvidia-smi -mig 1)
        start_real_node_gpus(cluster, NODE, SPEC)
        config = fake_gpu_config(cluster, NODE)
        subprocess.run([sys.executable, "-c", MIG_ON, str(config)], check=True, timeout=60)
        package = {
            "apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND, "metadata": {"name": PACKAGE},
            "spec": {
                "gpuModel": "NVIDIA A100-SXM4-80GB", "fraction": 100,
                "isolation": {"mode": "Hardware", "memory": "9Gi"},
                "entitlements": [{"namespaceSelector": {"matchLabels": {"mig": TENANT}}, "slices": 2}],
            },
        }  # fmt: skip
        cluster.apply(json.dumps(package))
        cluster.create_namespace(TENANT, {"mig": TENANT})
        cluster.start_process(
            "operator",
            [sys.executable, "-m", "gpuslice", "operator", "--kubeconfig", str(cluster.kubeconfig)],
        )
        start_agents(cluster, SPEC)
        wait_for(
            lambda: get_json(cluster, "deviceclass", c.device_class_name(PACKAGE)),
            90,
            "the operator's DeviceClass",
        )
        yield cluster
    finally:
        cluster.down()


def mig_pod(name: str) -> list[dict[str, object]]:
    return [
        {"apiVersion": c.GROUP_VERSION, "kind": c.SLICE_KIND, "metadata": {"name": name, "namespace": TENANT},
         "spec": {"package": PACKAGE}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TENANT},
         "spec": {"terminationGracePeriodSeconds": 1,
                  "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                  "containers": [{"name": "main", "image": PROBE, "command": ["sleep", "3600"],
                                  "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}}}]}},
    ]  # fmt: skip


def caps_in(cluster: DevCluster, pod: str) -> dict[str, tuple[int, int]]:
    """/dev/nvidia-caps in the container: name -> (major, minor)."""
    rc, out, err = exec_in(cluster, pod, "sh", "-c", "ls -ln /dev/nvidia-caps")
    assert rc == 0, err
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if line.startswith("c") and len(parts) >= 10:
            found[parts[-1]] = (int(parts[4].rstrip(",")), int(parts[5]))
    return found


def test_a_mig_container_gets_its_instances_caps_not_its_neighbours_and_the_drivers_limit(
    mig_cluster: DevCluster,
) -> None:
    pods = [run_pod(mig_cluster, mig_pod(n), timeout=120) for n in ("mig-a", "mig-b")]
    try:
        config = fake_gpu_config(mig_cluster, NODE)
        argv = [sys.executable, "-c", INSTANCES, str(config)]
        listed = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
        instances = json.loads(listed.strip().splitlines()[-1])
        assert len(instances) == 2, instances
        minors = {}
        uuids = {}
        for pod in pods:
            rc, out, err = exec_in(mig_cluster, pod, "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; ls /dev")
            assert rc == 0, err
            mig_uuid, *devs = out.split()
            uuids[pod] = mig_uuid
            gpu, gi, ci = instances[mig_uuid]
            gi_minor = 3 + gpu * 135 + gi * 9  # the kernel module's mig-minors layout
            major = simulate.NVIDIA_CAPS_MAJOR
            ci_minor = gi_minor + 1 + ci
            want = {f"nvidia-cap{gi_minor}": (major, gi_minor), f"nvidia-cap{ci_minor}": (major, ci_minor)}
            assert caps_in(mig_cluster, pod) == want, pod
            minors[pod] = set(want)
            assert {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-caps"} <= set(devs), devs
            # CUDA in the instance through the toolkit's libraries: 9 GiB fits, 10 GiB is refused by the
            # driver itself (1g.10gb holds 9.50 GiB), no shim
            holds = "gpuslice-probe hold 9Gi 0.1; gpuslice-probe hold 10Gi 0.1; cat /etc/ld.so.preload"
            rc, out, err = exec_in(mig_cluster, pod, "sh", "-c", holds)
            assert "held 9663676416 -> 0 CUDA_SUCCESS" in out, out + err
            assert "held 10737418240 -> 2 CUDA_ERROR_OUT_OF_MEMORY" in out, out + err
            assert "gpuslice" not in out, "no shim in a MIG container"
        assert not minors["mig-a"] & minors["mig-b"]
        # the boundary is the capability devices, not the environment: without them the neighbour's
        # instance cannot be opened, named or not; with CUDA_VISIBLE_DEVICES unset only its own is there
        neighbours = f"CUDA_VISIBLE_DEVICES={uuids['mig-b']} gpuslice-probe hold 1Gi 0.1"
        rc, out, err = exec_in(mig_cluster, "mig-a", "sh", "-c", neighbours)
        assert rc != 0 and "held" not in out, out + err
        rc, out, err = exec_in(mig_cluster, "mig-a", "sh", "-c",
                               "env -u CUDA_VISIBLE_DEVICES gpuslice-probe hold 9Gi 0.1")  # fmt: skip
        assert "held 9663676416 -> 0 CUDA_SUCCESS" in out, out + err
    finally:
        for pod in pods:
            delete(mig_cluster, "pod", pod)
            delete(mig_cluster, "gpuslice", pod)
    # unprepare destroyed both instances
    wait_for(
        lambda: subprocess.run([sys.executable, "-c", INSTANCES, str(fake_gpu_config(mig_cluster, NODE))],
                               capture_output=True, text=True, timeout=60).stdout.strip().endswith("{}"),
        60, "the instances destroyed at unprepare",
    )  # fmt: skip
