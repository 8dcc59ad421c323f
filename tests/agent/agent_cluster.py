"""Helpers for the agent's end-to-end tests: packages, device classes, claims and what got allocated."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import yaml

from gpuslice import constants
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.dev.devcluster.cluster import DevCluster

V100 = "Tesla V100-PCIE-32GB"


def package_doc(name: str, fraction: int, model: str = V100) -> dict[str, Any]:
    return {
        "apiVersion": constants.GROUP_VERSION,
        "kind": constants.PACKAGE_KIND,
        "metadata": {"name": name},
        "spec": {"gpuModel": model, "fraction": fraction},
    }


def device_class_doc(package: str) -> dict[str, Any]:
    """The DeviceClass the operator generates for a package (created here so the agent's tests do
    not depend on the operator running)."""
    expr = (
        f'device.driver == "{constants.DRIVER_NAME}" && '
        f'device.attributes["{constants.DRIVER_NAME}"].package == "{package}"'
    )
    return {
        "apiVersion": f"{constants.DRA_GROUP}/{constants.DRA_VERSION}",
        "kind": "DeviceClass",
        "metadata": {"name": constants.device_class_name(package)},
        "spec": {"selectors": [{"cel": {"expression": expr}}]},
    }


def claim_doc(name: str, namespace: str, package: str) -> dict[str, Any]:
    """A ResourceClaim of the documented form: one request named `gpu`, ExactCount 1, the package's class."""
    return {
        "apiVersion": f"{constants.DRA_GROUP}/{constants.DRA_VERSION}",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": {constants.LABEL_PACKAGE: package}},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": constants.CLAIM_REQUEST_NAME,
                        "exactly": {
                            "deviceClassName": constants.device_class_name(package),
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
    }


def pod_doc(name: str, namespace: str, claim: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [
            {
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}},
            }
        ],
        "nodeSelector": {"type": "kwok"},
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


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


@dataclass(frozen=True)
class PublishedDevice:
    pool: str
    name: str
    uuid: str
    package: str
    memory: int
    compute: int


def published_devices(cluster: DevCluster) -> dict[tuple[str, str], PublishedDevice]:
    """(pool, device) -> device as last published in every gpuslice pool (a newer generation wins)."""
    slices = [s for s in get_items(cluster, "resourceslices") if s["spec"]["driver"] == constants.DRIVER_NAME]
    out = {}
    for s in sorted(slices, key=lambda s: int(s["spec"]["pool"]["generation"])):
        pool = s["spec"]["pool"]["name"]
        for d in s["spec"].get("devices") or []:
            counters = d["consumesCounters"][0]["counters"]
            out[(pool, d["name"])] = PublishedDevice(
                pool=pool,
                name=d["name"],
                uuid=d["attributes"]["uuid"]["string"],
                package=d["attributes"]["package"]["string"],
                memory=parse_int_quantity(counters["memory"]["value"]),
                compute=parse_int_quantity(counters["compute"]["value"]),
            )
    return out


def card_usage(cluster: DevCluster) -> dict[str, tuple[int, int]]:
    """GPU uuid -> (memory bytes, compute share) held by allocated gpuslice claims, cluster-wide."""
    devices = published_devices(cluster)
    usage: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for claim in get_items(cluster, "resourceclaims", "-A"):
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for r in (allocation.get("devices") or {}).get("results") or []:
            if r["driver"] != constants.DRIVER_NAME:
                continue
            d = devices.get((r["pool"], r["device"]))
            if d is None:  # its pool was withdrawn (agent stopped, node gone): no card to count on
                continue
            usage[d.uuid][0] += d.memory
            usage[d.uuid][1] += d.compute
    return {uuid: (m, c) for uuid, (m, c) in usage.items()}
