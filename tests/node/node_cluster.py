"""Helpers for tests on the real node: a slice's pod of the probe image, exec into it."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import start_agents
from gpuslice_dev.devcluster.realnode import start_real_nodes
from support import get_json, wait_for

REPO = Path(__file__).resolve().parents[2]

GPU_SPEC = "2x Tesla V100-PCIE-32GB"
TENANT = "team-a"
PROBE = "localhost/gpuslice/probe:dev"


def slice_pod(name: str, command: list[str], claim: str | None = None) -> list[dict[str, object]]:
    """A GpuSlice of v100-8g and a pod of the probe image holding its claim."""
    return [
        {
            "apiVersion": "gpuslice.io/v1beta1",
            "kind": "GpuSlice",
            "metadata": {"name": claim or name, "namespace": TENANT},
            "spec": {"package": "v100-8g"},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": TENANT},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim or name}],
                "containers": [
                    {
                        "name": "main",
                        "image": PROBE,
                        "command": command,
                        "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}},
                    }
                ],
            },
        },
    ]


def restricted_container(name: str, uid: int, gid: int, command: list[str]) -> dict[str, Any]:
    """A probe container as the restricted Pod Security profile asks: non-root `uid`:`gid`, no
    privilege escalation, no capabilities, a read-only root, RuntimeDefault seccomp; holding the
    pod's claim `gpu`."""
    return {
        "name": name,
        "image": PROBE,
        "command": command,
        "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "256Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def run_pod(cluster: DevCluster, docs: list[dict[str, object]], timeout: float = 90) -> str:
    """Create the objects and wait until the pod runs; returns its name."""
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    pod = str(docs[-1]["metadata"]["name"])  # type: ignore[index]
    started = time.monotonic()
    proc = cluster.kubectl(
        "wait", "--for=condition=Ready", f"pod/{pod}", "-n", TENANT, f"--timeout={int(timeout)}s", check=False
    )
    if proc.returncode != 0:
        events = cluster.kubectl("get", "events", "-n", TENANT, "-o", "wide", check=False).stdout
        described = cluster.kubectl("describe", "pod", pod, "-n", TENANT, check=False).stdout
        waited = time.monotonic() - started
        raise AssertionError(f"pod {pod} not Ready ({waited:.0f}s):\n{described[-2500:]}\n{events[-1500:]}")
    return pod


def exec_in(cluster: DevCluster, pod: str, *command: str) -> tuple[int, str, str]:
    proc = cluster.kubectl("exec", "-n", TENANT, pod, "--", *command, check=False, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def delete(cluster: DevCluster, kind: str, name: str) -> None:
    cluster.kubectl("delete", kind, name, "-n", TENANT, "--ignore-not-found", "--wait=true", "--timeout=60s")


@contextmanager
def sleeping_slice_pod(cluster: DevCluster, name: str) -> Iterator[str]:
    """A slice pod of the probe image that only sleeps, Ready for the block (its name); then it and its
    GpuSlice are deleted."""
    pod = run_pod(cluster, slice_pod(name, ["sleep", "3600"]))
    try:
        yield pod
    finally:
        delete(cluster, "pod", pod)
        delete(cluster, "gpuslice", pod)


@contextmanager
def entitled(cluster: DevCluster, slices: int) -> Iterator[None]:
    """TENANT entitled to `slices` v100-8g slices for the block (8 otherwise): its quota says so first."""

    def entitle(n: int) -> None:
        package = get_json(cluster, "gpupackage", "v100-8g")
        entitlements = package["spec"]["entitlements"]
        entitlements[0]["slices"] = n
        patch = json.dumps({"spec": {"entitlements": entitlements}})
        cluster.kubectl("patch", "gpupackage", "v100-8g", "--type=merge", "-p", patch)

        def settled() -> bool:
            hard = get_json(cluster, "resourcequota", c.QUOTA_NAME, "-n", TENANT)["status"].get("hard", {})
            keys = (c.quota_key("v100-8g"), "requests.gpuslice.io/v100-8g")  # a claim; the product
            return all(hard.get(k) == str(n) for k in keys)

        wait_for(settled, 30, f"quota of {n}")

    entitle(slices)
    try:
        yield
    finally:
        entitle(8)


def _progress(msg: str) -> None:
    print(f"[real node] {msg}", file=sys.stderr, flush=True)


@contextmanager
def fresh_node_cluster(directory: Path) -> Iterator[DevCluster]:
    """A devcluster with one real node, the v100-8g product, a tenant, the operator and the agent."""
    if os.geteuid() != 0:
        pytest.skip("real nodes need root (kubelet, containerd, runc)")
    c = DevCluster(directory, progress=_progress)
    try:
        c.up(nodes=0)
        start_real_nodes(c, 1)
        c.apply_crds()
        package = yaml.safe_load((REPO / "manifests" / "samples" / "v100-8g.yaml").read_text())
        package["spec"]["entitlements"][0]["slices"] = 8  # every 8 GiB slice of the node's two cards
        c.apply(yaml.safe_dump(package))
        c.create_namespace(TENANT, {"tenant.example.com/project": TENANT})
        c.start_process(
            "operator", [sys.executable, "-m", "gpuslice", "operator", "--kubeconfig", str(c.kubeconfig)]
        )
        start_agents(c, GPU_SPEC, progress=_progress)
        wait_for(
            lambda: c.kubectl("get", "deviceclass", "v100-8g.gpuslice.io", check=False).returncode == 0,
            90,
            "the operator's DeviceClass",
        )
        yield c
    finally:
        c.down()
