"""The agent DaemonSet's update strategy as every deploy flow renders it: one node at a time, the old
agent gone before the new one starts (two agents on a node cannot both be kubelet's DRA plugin for
the driver), and a chart value that asks for a surge is refused when rendering, not on the nodes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.devcluster.binaries import ensure_binaries
from gpuslice_dev.tools import ensure_helm

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "manifests/helm/gpuslice"
AGENT = "gpuslice-agent"
OVERLAYS = sorted(
    str(p.parent.relative_to(REPO)) for p in (REPO / "manifests/overlays").glob("*/kustomization.yaml")
)
ONE_AT_A_TIME = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}


def _agent(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (agent,) = [d for d in docs if d and d["kind"] == "DaemonSet" and d["metadata"]["name"] == AGENT]
    return agent


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ensure_helm()), "template", "gpuslice", str(CHART), *args],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("directory", ["manifests", *OVERLAYS])
def test_each_kustomize_flow_updates_the_agent_one_node_at_a_time_without_surge(directory: str) -> None:
    proc = subprocess.run([str(ensure_binaries().kubectl), "kustomize", str(REPO / directory)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    if not [d for d in docs if d and d["kind"] == "DaemonSet"]:
        pytest.skip(f"{directory} deploys no agent")
    assert _agent(docs)["spec"]["updateStrategy"] == ONE_AT_A_TIME


def test_the_chart_updates_the_agent_as_kustomize_does_and_takes_a_wider_rollout() -> None:
    default = _helm()
    assert default.returncode == 0, default.stderr
    assert _agent(list(yaml.safe_load_all(default.stdout)))["spec"]["updateStrategy"] == ONE_AT_A_TIME
    wider = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": 0}}
    proc = _helm("--set-json", f"agent.updateStrategy={json.dumps(wider)}")
    assert proc.returncode == 0, proc.stderr
    assert _agent(list(yaml.safe_load_all(proc.stdout)))["spec"]["updateStrategy"] == wider


def test_the_chart_refuses_a_surge_of_the_agent_saying_why() -> None:
    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    proc = _helm("--set-json", f"agent.updateStrategy={json.dumps(surge)}")
    assert proc.returncode != 0
    assert "maxSurge is 1: it must be 0" in proc.stderr and "one DRA plugin per driver" in proc.stderr
