"""kind-config.yaml against kind's v1alpha4 config schema (kind cannot run here: no Docker).

Field names are those of sigs.k8s.io/kind v0.33.0, pkg/apis/config/v1alpha4/types.go; kind loads the
file with a strict decoder, so an unknown field anywhere is an error there too.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import constants

KIND_CONFIG = Path(__file__).resolve().parents[2] / "kind-config.yaml"

CLUSTER_FIELDS = {
    "kind", "apiVersion", "name", "nodes", "networking", "featureGates", "runtimeConfig",
    "kubeadmConfigPatches", "kubeadmConfigPatchesJSON6902", "containerdConfigPatches",
    "containerdConfigPatchesJSON6902",
}  # fmt: skip
NODE_FIELDS = {
    "role", "image", "labels", "extraMounts", "extraPortMappings", "kubeadmConfigPatches",
    "kubeadmConfigPatchesJSON6902",
}  # fmt: skip
MOUNT_FIELDS = {"containerPath", "hostPath", "readOnly", "selinuxRelabel", "propagation"}
PORT_FIELDS = {"containerPort", "hostPort", "listenAddress", "protocol"}
NETWORKING_FIELDS = {
    "ipFamily", "apiServerPort", "apiServerAddress", "podSubnet", "serviceSubnet", "disableDefaultCNI",
    "kubeProxyMode", "dnsSearch",
}  # fmt: skip
ROLES = {"control-plane", "worker"}
PROPAGATION = {"None", "HostToContainer", "Bidirectional"}
DRA_GATES = {"DRAPartitionableDevices", "DRAConsumableCapacity"}


def schema_errors(cfg: dict[str, Any]) -> list[str]:
    """What kind's strict loader and validation would refuse, as messages."""
    errors = []

    def unknown(obj: dict[str, Any], allowed: set[str], where: str) -> None:
        errors.extend(f"{where}: unknown field {k!r}" for k in sorted(obj.keys() - allowed))

    unknown(cfg, CLUSTER_FIELDS, "cluster")
    if cfg.get("kind") != "Cluster" or cfg.get("apiVersion") != "kind.x-k8s.io/v1alpha4":
        errors.append("cluster: kind must be Cluster and apiVersion kind.x-k8s.io/v1alpha4")
    unknown(cfg.get("networking") or {}, NETWORKING_FIELDS, "networking")
    for key in ("featureGates", "runtimeConfig"):
        value = cfg.get(key) or {}
        expected = bool if key == "featureGates" else str
        errors.extend(
            f"{key}.{k}: must be a {expected.__name__}" for k, v in value.items() if type(v) is not expected
        )
    patches = cfg.get("containerdConfigPatches") or []
    errors.extend(
        "containerdConfigPatches: entries are TOML strings" for p in patches if not isinstance(p, str)
    )
    for i, node in enumerate(cfg.get("nodes") or []):
        where = f"nodes[{i}]"
        unknown(node, NODE_FIELDS, where)
        if node.get("role", "control-plane") not in ROLES:
            errors.append(f"{where}.role: {node.get('role')!r} is not one of {sorted(ROLES)}")
        for j, mount in enumerate(node.get("extraMounts") or []):
            unknown(mount, MOUNT_FIELDS, f"{where}.extraMounts[{j}]")
            if mount.get("propagation", "None") not in PROPAGATION:
                errors.append(f"{where}.extraMounts[{j}].propagation: not one of {sorted(PROPAGATION)}")
        for j, port in enumerate(node.get("extraPortMappings") or []):
            unknown(port, PORT_FIELDS, f"{where}.extraPortMappings[{j}]")
        labels = node.get("labels") or {}
        errors.extend(
            f"{where}.labels.{k}: values are strings" for k, v in labels.items() if not isinstance(v, str)
        )
    if not any(n.get("role", "control-plane") == "control-plane" for n in cfg.get("nodes") or [{}]):
        errors.append("nodes: a cluster needs a control-plane node")
    return errors


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    loaded = yaml.safe_load(KIND_CONFIG.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_kind_config_uses_only_fields_kind_knows(cfg):
    assert schema_errors(cfg) == []


def test_the_schema_check_reports_what_kind_would_refuse():
    bad = {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "featureGate": {"X": True},
        "featureGates": {"DRAPartitionableDevices": "true"},
        "nodes": [{"role": "gpu-worker", "label": {}, "extraMounts": [{"hostpath": "/dev/null"}]}],
    }
    errors = schema_errors(bad)
    assert "cluster: unknown field 'featureGate'" in errors
    assert "featureGates.DRAPartitionableDevices: must be a bool" in errors
    assert "nodes[0]: unknown field 'label'" in errors
    assert "nodes[0].extraMounts[0]: unknown field 'hostpath'" in errors
    assert any("is not one of" in e for e in errors)
    assert "nodes: a cluster needs a control-plane node" in errors


def test_one_control_plane_and_a_gpu_worker_the_agent_daemonset_selects(cfg, base):
    roles = [n["role"] for n in cfg["nodes"]]
    assert roles.count("control-plane") == 1 and "worker" in roles
    (agent,) = [d for d in base if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpuslice-agent"]
    selector = agent["spec"]["template"]["spec"]["nodeSelector"]
    gpu_workers = [n for n in cfg["nodes"] if selector.items() <= (n.get("labels") or {}).items()]
    assert [n["role"] for n in gpu_workers] == ["worker"]


def test_nodes_run_kubernetes_136_or_newer_pinned_by_digest(cfg):
    for node in cfg["nodes"]:
        match = re.fullmatch(r"kindest/node:v1\.(\d+)\.\d+@sha256:[0-9a-f]{64}", node["image"])
        assert match, (
            f"{node['image']}: use a kindest/node image pinned by digest, as kind's release notes ask"
        )
        assert int(match.group(1)) >= 36


def test_dra_feature_gates_and_api_are_on(cfg):
    assert {g for g, on in cfg["featureGates"].items() if on} >= DRA_GATES
    assert cfg["runtimeConfig"][f"{constants.DRA_GROUP}/{constants.DRA_VERSION}"] == "true"


def test_containerd_reads_cdi_specs_from_where_the_agent_writes_them(cfg):
    # kind's node image writes a version 2 containerd config, so the CRI plugin key is the v2 one.
    merged: dict[str, Any] = {}
    for patch in cfg["containerdConfigPatches"]:
        merged.update(tomllib.loads(patch))
    cri = merged["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True
    assert constants.CDI_DIR in cri["cdi_spec_dirs"]
