"""Sharing mode Kueue on a cluster without Kueue: the package says so, and the ResourceQuota (the
entitlement plus borrowingLimit) is what still limits each namespace."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster, free_port
from support import apply, wait_for

from .operator_cluster import OperatorProcess, get, module_operator, package_doc

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with module_operator(cluster, log, f"--metrics-port={free_port()}") as op:
        yield op


def _condition(cluster: DevCluster, pkg: str) -> dict[str, Any] | None:
    status = (get(cluster, "gpupackage", pkg) or {}).get("status") or {}
    return next((x for x in status.get("conditions") or [] if x["type"] == "Queues"), None)


def test_kueue_not_installed_is_in_the_package_status(cluster: DevCluster, operator: OperatorProcess) -> None:
    if cluster.kubectl("get", "crd", "clusterqueues.kueue.x-k8s.io", check=False).returncode == 0:
        pytest.skip("this cluster has Kueue installed")
    token = uuid.uuid4().hex[:5]
    pkg = f"n{token}-8g"
    ns = cluster.create_namespace(f"nokueue-{token}", {"nokueue": token})
    doc = package_doc(pkg, 25, {"nokueue": token}, slices=2)
    doc["spec"]["sharing"] = {"mode": "Kueue", "borrowingLimit": 1}
    apply(cluster, [doc])
    cond = wait_for(lambda: _condition(cluster, pkg), 30, "the package's Queues condition")
    assert cond["status"] == "False" and cond["reason"] == "KueueNotInstalled", cond
    assert "install Kueue" in cond["message"]
    quota = wait_for(lambda: get(cluster, "resourcequota", c.QUOTA_NAME, "-n", ns), 30, "the quota")
    assert quota["spec"]["hard"][c.quota_key(pkg)] == "3"

    # Back to the default mode: the condition goes, the quota is the entitlement again.
    doc["spec"].pop("sharing")
    apply(cluster, [doc])
    wait_for(lambda: _condition(cluster, pkg) is None, 30, "the Queues condition gone")
    wait_for(
        lambda: (
            get(cluster, "resourcequota", c.QUOTA_NAME, "-n", ns)["spec"]["hard"][c.quota_key(pkg)] == "2"
        ),
        30,
        "the quota back at the entitlement",
    )
