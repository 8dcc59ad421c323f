"""A multi-GPU product through the operator: a GpuSlice of a `gpus: 4` package gets one claim of
4 whole cards on one PCIe root (on hand-made DGX-1 slices, and on what the real agent publishes
over the driver double's DGX-1), quota counts its cards, admission holds hand-written claims of
the product to its form, the ledger counts a 2-card product's card-seconds, and the CRD refuses
burst on a whole-card product."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from agent.agent_cluster import simulated_agent
from gpuslice import constants as c
from gpuslice.domain.multigpu import PCIE_ROOT_ATTRIBUTE
from gpuslice_dev.devcluster.cluster import DevCluster
from support import apply, get_json, pod_doc, slice_doc, wait_for

from .operator_cluster import TEST_LABEL, OperatorProcess, module_operator
from .test_multigpu_cluster import SXM2, allocated_roots, dgx, slices

pytestmark = pytest.mark.slow(seconds=90)


@pytest.fixture(scope="module")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with module_operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def _product_on(
    cluster: DevCluster, namespace: str, prefix: str, *, gpus: int, entitled: int, node: str
) -> str:
    """A `gpus`-card SamePcieRoot package entitling `namespace` (made here) to `entitled` products,
    its DeviceClass made, and `node` publishing DGX-1 cards for it; returns the package's name."""
    from gpuslice.agent.slices import Package
    from gpuslice.api.package import GpuPackageSpec

    token = prefix + uuid.uuid4().hex[:5]
    pkg = f"{token}-x{gpus}"
    spec: dict[str, Any] = {"gpuModel": SXM2, "gpus": gpus, "topology": "SamePcieRoot"}
    spec["entitlements"] = [{"namespaceSelector": {"matchLabels": {"mg": token}}, "slices": entitled}]
    package = {
        "apiVersion": c.GROUP_VERSION,
        "kind": c.PACKAGE_KIND,
        "metadata": {"name": pkg, "labels": {TEST_LABEL: "true"}},
        "spec": spec,
    }
    cluster.create_namespace(namespace, {"mg": token})
    apply(cluster, [package])
    wait_for(lambda: get_json(cluster, "deviceclass", c.device_class_name(pkg)), 30, "DeviceClass")
    docs = slices(node, dgx(node), [Package(pkg, GpuPackageSpec.model_validate(spec))])
    for d in docs:
        d["metadata"]["labels"]["gpuslice-test/operator"] = "true"
    apply(cluster, docs)
    return pkg


def test_a_4_gpu_gpuslice_gets_4_cards_on_one_root(
    cluster: DevCluster, namespace: str, operator: OperatorProcess
) -> None:
    pkg = _product_on(cluster, namespace, "g", gpus=4, entitled=3, node=cluster.nodes[0])

    # Quota counts cards: 3 products of 4 cards are 12 devices.
    def hard() -> str | None:
        q = get_json(cluster, "resourcequota", c.QUOTA_NAME, "-n", namespace) or {}
        return (q.get("spec") or {}).get("hard", {}).get(c.quota_key(pkg))

    assert wait_for(hard, 30, "quota") == "12"
    apply(cluster, [slice_doc("big", namespace, pkg)])
    wait_for(lambda: get_json(cluster, "resourceclaim", "big", "-n", namespace), 30, "the slice's claim")
    apply(cluster, [pod_doc("big", namespace, "big")])
    roots = wait_for(lambda: allocated_roots_any(cluster, namespace, "big"), 60, "4 cards allocated")
    assert len(roots) == 4 and len(set(roots)) == 1, roots

    def free() -> int | None:
        st = (get_json(cluster, "gpupackage", pkg) or {}).get("status") or {}
        value = (st.get("capacity") or {}).get("productsFree")
        return value if value == 1 else None

    assert wait_for(free, 60, "productsFree 1 (the other root)") == 1

    # The second product takes the other root; the third finds no node with 4 free cards on one root.
    for name in ("big2", "big3"):
        apply(cluster, [slice_doc(name, namespace, pkg)])
        wait_for(lambda n=name: get_json(cluster, "resourceclaim", n, "-n", namespace), 30, "claim")
        apply(cluster, [pod_doc(name, namespace, name)])
    second = wait_for(lambda: allocated_roots_any(cluster, namespace, "big2"), 60, "second product")
    assert len(set(second)) == 1 and set(second) != set(roots)

    def waiting() -> dict[str, Any] | None:
        st = (get_json(cluster, "gpuslice", "big3", "-n", namespace) or {}).get("status") or {}
        return st if st.get("reason") == "NoNodeFits" else None

    status = wait_for(waiting, 60, "third product Pending NoNodeFits")
    assert status["phase"] == "Pending"
    assert f"no node has 4 free cards of {SXM2} on one PCIe root" in status["message"], status["message"]
    explained = explain(cluster, f"{namespace}/big3")
    assert "NoNodeFits" in explained and f"no node has 4 free cards of {SXM2} on one PCIe root" in explained

    # A hand-written claim of the product with count 1 is not its form.
    claim = {
        "apiVersion": c.DRA_GROUP_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": "hand", "namespace": namespace, "labels": {c.LABEL_PACKAGE: pkg}},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": c.device_class_name(pkg),
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
    }
    out = cluster.kubectl("create", "-f", "-", input=json.dumps(claim), check=False)
    assert out.returncode != 0 and f"multi-GPU product {pkg} count 4" in out.stderr, out.stderr


#: The cards a DGX-1's V100-SXM2 boards have an NVLink to (the double's hybrid cube-mesh).
DGX1_PEERS = ["1,2,3,4", "0,2,3,5", "0,1,3,6", "0,1,2,7", "0,5,6,7", "1,4,6,7", "2,4,5,7", "3,4,5,6"]


def test_the_real_agent_publishes_a_dgx1s_topology_and_a_4_card_product_lands_on_one_root(
    cluster: DevCluster, namespace: str, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No hand-written slice: the agent over the driver double reads the node's sysfs and NVML as
    on a real DGX-1, and the scheduler and the operator's explanation work from what it published."""
    token = "t" + uuid.uuid4().hex[:5]
    cluster.create_namespace(namespace, {"mg": token})
    entitled = [{"namespaceSelector": {"matchLabels": {"mg": token}}, "slices": 1}]
    packages = {f"{token}-x{n}": {"gpuModel": SXM2, "gpus": n, "topology": "SamePcieRoot",
                                  "entitlements": entitled} for n in (4, 8)}  # fmt: skip
    apply(cluster, [{"apiVersion": c.GROUP_VERSION, "kind": c.PACKAGE_KIND,
                     "metadata": {"name": n, "labels": {TEST_LABEL: "true"}}, "spec": s}
                    for n, s in packages.items()])  # fmt: skip
    for name in packages:
        wait_for(lambda n=name: get_json(cluster, "deviceclass", c.device_class_name(n)), 30, "DeviceClass")
    x4, x8 = packages
    node = f"dgx-{token}"
    with simulated_agent(cluster, node, f"8x {SXM2}", tmp_path_factory.mktemp("dgx")):

        def cards() -> dict[str, dict[str, Any]] | None:
            listing = get_json(cluster, "resourceslices", "-l", f"{c.LABEL_NODE}={node}")["items"]
            found = {
                d["name"]: d["attributes"]
                for s in listing
                for d in s["spec"].get("devices") or []
                if (d["attributes"].get("package") or {}).get("string") == x4
            }
            return found if len(found) == 8 else None

        published = wait_for(cards, 60, "a whole-card device of the 4-card package per card")
        by_index = sorted(published.values(), key=lambda a: a["gpuIndex"]["int"])
        assert [(a[PCIE_ROOT_ATTRIBUTE]["string"], a["numaNode"]["int"]) for a in by_index] == [
            ("pci0000:00", 0)
        ] * 4 + [("pci0000:80", 1)] * 4
        assert [a["nvlinkPeers"]["string"] for a in by_index] == DGX1_PEERS

        apply(cluster, [slice_doc("quad", namespace, x4)])
        wait_for(lambda: get_json(cluster, "resourceclaim", "quad", "-n", namespace), 30, "the slice's claim")
        apply(cluster, [pod_doc("quad", namespace, "quad")])
        roots = wait_for(
            lambda: allocated_roots(cluster, namespace, "quad", label=f"{c.LABEL_NODE}={node}"), 60, "4 cards"
        )
        assert len(roots) == 4 and len(set(roots)) == 1, roots
        claim = get_json(cluster, "resourceclaim", "quad", "-n", namespace)
        taken = {
            published[r["device"]]["gpuIndex"]["int"]
            for r in claim["status"]["allocation"]["devices"]["results"]
        }
        assert taken in ({0, 1, 2, 3}, {4, 5, 6, 7}), "one root's cards: one NUMA node, one NVLink quad"

        # 8 cards on one root: no node has them (each root has 4), so the product waits, and says why.
        apply(cluster, [slice_doc("octo", namespace, x8)])
        wait_for(lambda: get_json(cluster, "resourceclaim", "octo", "-n", namespace), 30, "the slice's claim")
        apply(cluster, [pod_doc("octo", namespace, "octo")])

        free_root = "pci0000:80" if taken == {0, 1, 2, 3} else "pci0000:00"
        why = f"no node has 8 free cards of {SXM2} on one PCIe root (most: 4 on node {node} PCIe root "
        why += free_root
        seen: list[str] = []

        def waiting() -> dict[str, Any] | None:
            st = (get_json(cluster, "gpuslice", "octo", "-n", namespace) or {}).get("status") or {}
            if st.get("reason") != "NoNodeFits":
                return None
            seen.append(st.get("message", ""))
            return st if why in st["message"] else None

        # the status names the root whose cards are free. (A CI run once read a first status naming
        # the other root, its cards held by quad; not reproduced here in 4 runs: the status must come
        # to the right root, and what it said before is in the failure.)
        try:
            status = wait_for(waiting, 60, f"the 8-card product Pending NoNodeFits, {why}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nmessages seen: {sorted(set(seen))}") from None
        assert status["phase"] == "Pending", status
        explained = explain(cluster, f"{namespace}/octo")
        assert "NoNodeFits" in explained and why in explained, explained
        assert allocated_roots(cluster, namespace, "octo", label=f"{c.LABEL_NODE}={node}") is None


def explain(cluster: DevCluster, ref: str) -> str:
    """What `gpuslice explain <namespace>/<slice>` prints."""
    argv = [sys.executable, "-m", "gpuslice", "explain", ref, f"--kubeconfig={cluster.kubeconfig}"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def allocated_roots_any(cluster: DevCluster, ns: str, name: str) -> list[str] | None:
    return allocated_roots(cluster, ns, name, label="gpuslice-test/operator")


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def test_a_2_card_products_interval_carries_twice_its_seconds_in_card_seconds(
    cluster: DevCluster, namespace: str, operator: OperatorProcess
) -> None:
    # The other node: the 4-card test's slices stay on the first until the module ends.
    pkg = _product_on(cluster, namespace, "c", gpus=2, entitled=1, node=cluster.nodes[1])
    apply(cluster, [slice_doc("pair", namespace, pkg)])
    wait_for(lambda: get_json(cluster, "resourceclaim", "pair", "-n", namespace), 30, "the slice's claim")
    apply(cluster, [pod_doc("pair", namespace, "pair")])
    roots = wait_for(lambda: allocated_roots_any(cluster, namespace, "pair"), 60, "2 cards allocated")
    assert len(roots) == 2

    month = datetime.now(UTC).strftime("%Y-%m")

    def usage() -> dict[str, Any]:
        return get_json(cluster, "gpuusages.gpuslice.io", month, "-n", namespace) or {}

    def interval(closed: bool) -> dict[str, Any] | None:
        for iv in usage().get("intervals") or []:
            if iv["claim"] == "pair" and (iv.get("end") is not None) == closed:
                return dict(iv)
        return None

    opened = wait_for(lambda: interval(closed=False), 30, "the product's open interval")
    assert opened["cards"] == 2

    # Every card named: the slice's status and its interval list both, the first stays gpuUUID/gpu.
    def named() -> dict[str, Any] | None:
        st = (get_json(cluster, "gpuslice", "pair", "-n", namespace) or {}).get("status") or {}
        return st if len(st.get("gpuUUIDs") or []) == 2 else None

    status = wait_for(named, 30, "the product's status naming both cards")
    cards = status["gpuUUIDs"]
    assert len(set(cards)) == 2 and status["gpuUUID"] == cards[0] and status["gpus"] == 2, status
    [alloc] = status["allocations"]
    assert alloc["gpuUUIDs"] == cards and len(set(alloc["devices"])) == 2, alloc
    assert (opened["gpu"], opened["gpus"]) == (cards[0], cards), opened
    rows = cluster.kubectl("get", "gpuslices", "-n", namespace).stdout.splitlines()
    header = rows[0].split()
    row = dict(zip(header, rows[1].split(), strict=False))
    assert (row["NAME"], row["GPU"], row["GPUS"]) == ("pair", cards[0], "2"), rows
    time.sleep(5)
    cluster.kubectl("delete", "pod", "pair", "-n", namespace, "--grace-period=0", "--force")
    closed = wait_for(lambda: interval(closed=True), 60, "the interval closed at the release")
    seconds = _ts(closed["end"]) - _ts(closed["start"])
    assert seconds >= 5 and closed["cardSeconds"] == 2 * seconds, closed
    (totals,) = usage()["packages"]
    assert (totals["sliceSeconds"], totals["cardSeconds"]) == (seconds, 2 * seconds), totals
    assert usage()["cardHours"] == f"{2 * seconds / 3600:.2f}"


def test_the_crd_refuses_burst_on_a_whole_card_product(cluster: DevCluster) -> None:
    cluster.apply_crds()

    def create(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        doc = {
            "apiVersion": c.GROUP_VERSION,
            "kind": c.PACKAGE_KIND,
            "metadata": {"name": "burst-check"},
            "spec": {"gpuModel": SXM2, **spec},
        }
        return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)

    for whole in (
        {"gpus": 2, "computeBurst": True},
        {"fraction": 100, "computeBurst": True},
        {"fraction": 25, "computeShare": 100, "computeBurst": True},
    ):
        out = create(whole)
        assert out.returncode != 0 and "computeBurst needs a share below the whole card" in out.stderr, (
            whole,
            out.stderr,
        )
    for fine in (
        {"fraction": 25, "computeBurst": True},
        {"fraction": 100, "computeShare": 50, "computeBurst": True},
        {"gpus": 2, "computeBurst": False},
        {"gpus": 2},
    ):
        out = create(fine)
        assert out.returncode == 0, (fine, out.stderr)
