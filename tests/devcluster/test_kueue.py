"""`gpuslice-dev devcluster up --with-kueue`: the real Kueue (controller and webhooks built from
sigs.k8s.io/kueue) admits a Job within its ClusterQueue's quota and holds the next one suspended."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.kueue import KUEUE_VERSION, manifests, module_dir

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=120)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuslice_dev", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def kueue_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    d = tmp_path_factory.mktemp("kueue") / "dc"
    up = _cli("up", "--nodes", "1", "--with-kueue", "--dir", str(d))
    try:
        assert up.returncode == 0, up.stderr
        yield DevCluster(d)
    finally:
        _cli("down", "--dir", str(d))


def _job(name: str, queue: str, cpu: str, node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}},
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": node_selector or {},
                    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
                    "containers": [
                        {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu}}}
                    ],
                }
            },
        },
    }


def _get(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _wait(what: str, check: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_manifests_are_kueues_own_with_every_webhook_on_loopback() -> None:
    docs = manifests(module_dir(), "https://127.0.0.1:1234", b"CA")
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "ServiceAccount"} <= kinds
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io", "workloads.kueue.x-k8s.io"} <= crds
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    hooks += [
        d["spec"]["conversion"]["webhook"]
        for d in docs
        if d["kind"] == "CustomResourceDefinition" and d["spec"].get("conversion", {}).get("webhook")
    ]
    assert len(hooks) > 20
    for hook in hooks:
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:1234/"), hook
        assert "service" not in hook["clientConfig"]
    pod_hook = next(h for h in hooks if h.get("name") == "mpod.kb.io")
    assert pod_hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "kueue-system"]


def test_real_kueue_admits_within_quota_and_holds_the_rest_suspended(kueue_cluster: DevCluster) -> None:
    c = kueue_cluster
    assert c.status().get("kueue") is True
    log = (c.dir / "logs" / "kueue.log").read_text()
    assert KUEUE_VERSION in log
    ns = c.create_namespace("team-a")
    objects = [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "default"}},
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": "cq-a"},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu"],
                        "flavors": [{"name": "default", "resources": [{"name": "cpu", "nominalQuota": "1"}]}],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "lq", "namespace": ns},
            "spec": {"clusterQueue": "cq-a"},
        },
    ]
    c.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    _wait(
        "the ClusterQueue to be active",
        lambda: any(
            cond["type"] == "Active" and cond["status"] == "True"
            for cond in _get(c, "clusterqueue", "cq-a").get("status", {}).get("conditions", [])
        ),
    )
    # Kueue's mutating webhook suspends a queued Job on create: it runs only once admitted. kwok
    # completes a Job's pod at once; the first one's pod is kept Pending (no node matches) so that
    # it holds its quota: Kueue counts an admitted workload, whether its pods run or not.
    hold = {"gpuslice.test/no-such-node": "true"}
    # The object the create returns is what admission stored: a later read races Kueue, which
    # admits and unsuspends a Job that fits within milliseconds.
    created = c.kubectl(
        "create", "-n", ns, "-f", "-", "-o", "json", input=json.dumps(_job("first", "lq", "800m", hold))
    )
    assert json.loads(created.stdout)["spec"]["suspend"] is True
    _wait(
        "the first job to be admitted", lambda: _get(c, "job", "first", "-n", ns)["spec"]["suspend"] is False
    )
    _wait("the first job's pod", lambda: _get(c, "pods", "-n", ns, "-l", "job-name=first")["items"])

    c.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(_job("second", "lq", "800m")))

    def pending_for_quota() -> str:
        for wl in _get(c, "workloads", "-n", ns)["items"]:
            owners = [o["name"] for o in wl["metadata"].get("ownerReferences", [])]
            if "second" in owners:
                for cond in wl.get("status", {}).get("conditions", []):
                    if cond["type"] == "QuotaReserved" and cond["status"] == "False":
                        return str(cond["message"])
        return ""

    message = _wait("the second workload to be refused quota", pending_for_quota)
    assert "insufficient unused quota for cpu" in message
    time.sleep(3)
    assert _get(c, "job", "second", "-n", ns)["spec"]["suspend"] is True
    assert _get(c, "pods", "-n", ns, "-l", "job-name=second")["items"] == []
    usage = _get(c, "clusterqueue", "cq-a")["status"]
    assert usage["admittedWorkloads"] == 1 and usage["pendingWorkloads"] == 1

    # The first one gone frees its quota: Kueue admits the second, which runs to completion.
    c.kubectl("delete", "job", "first", "-n", ns, "--wait=false")
    _wait(
        "the second job to complete",
        lambda: any(
            cond["type"] == "Complete" and cond["status"] == "True"
            for cond in _get(c, "job", "second", "-n", ns).get("status", {}).get("conditions", [])
        ),
    )
