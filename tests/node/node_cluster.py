"""Helpers for tests on the real node: a slice's pod of the probe image, exec into it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gpuslice_dev.devcluster.cluster import DevCluster

GPU_SPEC = "2x Tesla V100-PCIE-32GB"
TENANT = "team-a"
PROBE = "localhost/gpuslice/probe:dev"


def slice_pod(name: str, command: list[str], claim: str | None = None) -> list[dict[str, object]]:
    """A GpuSlice of v100-8g and a pod of the probe image holding its claim."""
    return [
        {
            "apiVersion": "gpuslice.io/v1alpha1",
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
