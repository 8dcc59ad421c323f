"""Helpers for the agent's end-to-end tests: packages, device classes, claims and what got allocated."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

import support
from gpuslice import constants
from gpuslice.api.resourceclaim import allocated_devices
from gpuslice.api.resourceslice import PublishedDevice, newest_generation, parse_resource_slices
from gpuslice_dev.agents import agent_kubeconfig, spawn_agent
from gpuslice_dev.devcluster.cluster import DevCluster, node_manifest
from support import V100, claim_doc, device_class_doc, package_doc, wait_for

__all__ = ["V100", "claim_doc", "device_class_doc", "package_doc", "pod_doc"]


def pod_doc(name: str, namespace: str, claim: str, node: str | None = None) -> dict[str, Any]:
    """A pod holding `claim`, placed on a kwok node (or on `node`)."""
    return support.pod_doc(
        name,
        namespace,
        claim,
        cpu=None,
        memory="1Gi",
        image="registry.k8s.io/pause:3.10",
        node_selector={"kubernetes.io/hostname": node} if node else {"type": "kwok"},
    )


def apply_docs(cluster: DevCluster, docs: list[dict[str, Any]]) -> None:
    cluster.kubectl(
        "apply", "--server-side", "--field-manager=gpuslice-tests", "-f", "-", input=yaml.safe_dump_all(docs)
    )


def get_items(cluster: DevCluster, *args: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", *args, "-o", "json").stdout
    return list(json.loads(out)["items"])


def pool_slices(cluster: DevCluster, node: str) -> list[dict[str, Any]]:
    return [
        s
        for s in get_items(cluster, "resourceslices", f"--field-selector=spec.nodeName={node}")
        if s["spec"]["driver"] == constants.DRIVER_NAME
    ]


@contextmanager
def simulated_agent(
    cluster: DevCluster, node: str, spec: str, root: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`node` as a kwok node with the real agent over the driver double simulating `spec` (its files
    under `root`), yielded once it has published devices (the packages it sells exist already); the
    agent stopped and the node deleted afterwards."""
    apply_docs(cluster, [node_manifest(node)])
    log = root / "agent.log"
    agent = spawn_agent(node, spec, agent_kubeconfig(cluster, node), root, log)
    try:
        wait_for(
            lambda: (
                agent.poll() is not None or any(s["spec"].get("devices") for s in pool_slices(cluster, node))
            ),
            timeout=90,
            what=f"the agent of {node} to publish its devices",
        )
        assert agent.poll() is None, log.read_text()[-3000:]
        yield agent
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)


def published_devices(cluster: DevCluster) -> dict[tuple[str, str], PublishedDevice]:
    """(pool, device) -> device as last published in every gpuslice pool (the newest generation)."""
    slices = newest_generation(parse_resource_slices(get_items(cluster, "resourceslices")))
    return {(d.pool, d.name): d for s in slices for d in s.devices}


def card_usage(cluster: DevCluster) -> dict[str, tuple[int, int]]:
    """GPU uuid -> (memory bytes, compute share) held by allocated gpuslice claims, cluster-wide."""
    devices = published_devices(cluster)
    usage: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for claim in get_items(cluster, "resourceclaims", "-A"):
        for pool, name in allocated_devices(claim):
            d = devices.get((pool, name))
            if d is None or d.uuid is None:  # its pool was withdrawn (agent stopped, node gone)
                continue
            usage[d.uuid][0] += d.consumes["memory"]
            usage[d.uuid][1] += d.consumes["compute"]
    return {uuid: (m, c) for uuid, (m, c) in usage.items()}
