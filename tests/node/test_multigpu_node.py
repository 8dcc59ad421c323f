"""A 2-card product on the real node (kubelet -> agent -> CDI -> containerd -> runc): the pod sees
both cards whole, the quota counts its two cards, and the agent's NVML cross-check watches both:
memory its pod holds on the second card is the product's, a host process there is reported; and
a card failing under it fails the product, the second as the first."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice import constants as c
from gpuslice_dev.agents import DEV_USAGE_INTERVAL
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.node_agents import fake_gpu_config
from gpuslice_dev.gpusim import faults
from node.node_cluster import PROBE, TENANT, delete, exec_in, run_pod
from node.test_gpu_health_node import card_taints, events
from node.test_isolation_node import _container_pid, _memory_isolated, _release, gpu_holder
from support import get_json, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=90)]
NODE = "real-node-0"
PACKAGE = "v100-x2"
GIB = 1024**3
CARD = "Tesla V100-PCIE-32GB"


def node_uuids(cluster: DevCluster) -> list[str]:
    """The node's cards in index order, as the driver double describes them."""
    lines = dict(
        line.split("=", 1) for line in fake_gpu_config(cluster, NODE).read_text().splitlines() if "=" in line
    )
    indexed = sorted((int(k.split(".")[1]), v) for k, v in lines.items() if k.endswith(".uuid"))
    return [uuid for _, uuid in indexed]


def product_pod(name: str) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "gpuslice.io/v1beta1",
            "kind": "GpuSlice",
            "metadata": {"name": name, "namespace": TENANT},
            "spec": {"package": PACKAGE},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": TENANT},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": PROBE,
                        "command": ["sleep", "3600"],
                        "resources": {"claims": [{"name": "gpu"}], "limits": {"memory": "1Gi"}},
                    }
                ],
            },
        },
    ]


@pytest.fixture(scope="module")
def pair(node_cluster: DevCluster) -> Iterator[str]:
    """A `gpus: 2` package TENANT is entitled to one product of, and a pod holding one."""
    package = {
        "apiVersion": "gpuslice.io/v1beta1",
        "kind": "GpuPackage",
        "metadata": {"name": PACKAGE},
        "spec": {
            "gpuModel": CARD,
            "gpus": 2,
            "entitlements": [
                {"namespaceSelector": {"matchLabels": {"tenant.example.com/project": TENANT}}, "slices": 1}
            ],
        },
    }
    node_cluster.apply(json.dumps(package))

    def published() -> int:
        listing = get_json(node_cluster, "resourceslices", f"--field-selector=spec.nodeName={NODE}")
        return sum(
            1
            for s in listing["items"]
            for d in s["spec"].get("devices") or []
            if (d["attributes"].get("package") or {}).get("string") == PACKAGE
        )

    assert wait_for(lambda: published() == 2 or None, 90, "a whole-card device of the product per card")
    try:
        yield run_pod(node_cluster, product_pod("pair"))
    finally:
        delete(node_cluster, "pod", "pair")
        delete(node_cluster, "gpuslice", "pair")
        node_cluster.kubectl("delete", "gpupackage", PACKAGE, "--ignore-not-found", "--timeout=60s")


def test_the_pod_sees_both_cards_whole(node_cluster: DevCluster, pair: str) -> None:
    rc, out, err = exec_in(node_cluster, pair, "gpuslice-probe", "smi")
    assert rc == 0, err
    assert out.strip().splitlines() == [f"{CARD}, 32768 MiB"] * 2, (out, err)
    # each card whole through CUDA too: 30 GiB fits on either (a quarter slice stops at 8)
    for index in ("0", "1"):
        rc, out, err = exec_in(
            node_cluster, pair, "sh", "-c", f"CUDA_VISIBLE_DEVICES={index} gpuslice-probe alloc 30Gi"
        )
        assert rc == 0 and "CUDA_SUCCESS" in out, (index, out, err)


def test_the_quota_counts_the_products_two_cards(node_cluster: DevCluster, pair: str) -> None:
    key = c.quota_key(PACKAGE)

    def quota() -> tuple[str | None, str | None] | None:
        status = get_json(node_cluster, "resourcequota", c.QUOTA_NAME, "-n", TENANT)["status"]
        now = ((status.get("hard") or {}).get(key), (status.get("used") or {}).get(key))
        return now if now == ("2", "2") else None

    assert wait_for(quota, 30, "quota of one product: 2 cards hard, 2 used") == ("2", "2")
    claim = get_json(node_cluster, "resourceclaim", "pair", "-n", TENANT)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2 and len({r["device"] for r in results}) == 2


def test_the_cross_check_watches_the_second_card(node_cluster: DevCluster, pair: str) -> None:
    uid = get_json(node_cluster, "pod", pair, "-n", TENANT)["metadata"]["uid"]
    first, second = node_uuids(node_cluster)
    assert wait_for(
        lambda: (cond := _memory_isolated(node_cluster, "pair")) and cond["status"] == "True",
        60,
        "MemoryIsolated=True on the product",
    )
    # The pod's own process on its second card, past the shim: the product's memory (20 GiB of 32).
    own = gpu_holder(node_cluster, second, 20 * GIB, into_pod_of=_container_pid(uid))
    try:
        time.sleep(3 * DEV_USAGE_INTERVAL)
        cond = _memory_isolated(node_cluster, "pair")
        assert cond is not None and cond["status"] == "True", cond
        assert own.poll() is None, "the product's own process on its card was stopped"
    finally:
        _release(own)
    # A host process on the second card: reported on the product, as on its first.
    host = gpu_holder(node_cluster, second, 1 * GIB, into_pod_of=None)
    try:
        cond = wait_for(
            lambda: (x := _memory_isolated(node_cluster, "pair")) and x["status"] == "False" and x,
            60,
            "MemoryIsolated=False for a host process on the product's second card",
        )
        assert f"belongs to no pod (a host process); it holds 1024 MiB on GPU {second}" in cond["message"]
        assert f"{TENANT}/pair" in cond["message"] and first not in cond["message"]
    finally:
        _release(host)


def test_an_xid_on_the_second_card_fails_the_product(node_cluster: DevCluster, pair: str) -> None:
    """Last in the module: the product's pod is evicted."""
    config = fake_gpu_config(node_cluster, NODE)
    first, second = node_uuids(node_cluster)
    uid = get_json(node_cluster, "pod", pair, "-n", TENANT)["metadata"]["uid"]
    faults.inject(config, "1", xid=79)
    try:
        tainted = wait_for(lambda: (t := card_taints(node_cluster, 1)) and all(t) and t, 30, "card 1 tainted")
        assert all(t[0]["value"] == "xid-79" and t[0]["effect"] == "NoExecute" for t in tainted), tainted
        assert not any(card_taints(node_cluster, 0)), "the product's healthy first card stays untainted"

        def evicted() -> bool | None:
            pod = get_json(node_cluster, "pod", pair, "-n", TENANT)
            return True if pod is None or pod["metadata"]["uid"] != uid else None

        wait_for(evicted, 120, "kube-controller-manager evicts the product's pod")
        failed = wait_for(
            lambda: next((e for e in events(node_cluster, TENANT, pair) if e["reason"] == "GpuFailed"), None),
            30,
            "a GpuFailed Event on the product",
        )
        assert failed["type"] == "Warning" and "XID 79" in failed["message"], failed
        assert second in failed["message"] and first not in failed["message"], failed["message"]
    finally:
        faults.inject(config, "1", clear=True)
        wait_for(lambda: not any(card_taints(node_cluster, 1)), 30, "the reset card untainted")
