"""The deploy manifests running for real: the image built here, the operator Deployment and the agent
DaemonSet as pods on a real node (kubelet + containerd + runc) over simulated V100s, with only their
RBAC; a tenant's slice through them, the standby operator taking over, and the README's uninstall.

No host-process agent or operator runs here: the DaemonSet is the agent, the Deployment the operator.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.deploy import NAMESPACE, write_overlay
from gpuslice_dev.devcluster.node_binaries import ensure_node_binaries
from gpuslice_dev.devcluster.pki import LocalCA
from gpuslice_dev.devcluster.realnode import crictl, dirs_of, start_real_nodes
from node.node_cluster import TENANT, slice_pod
from support import get_json, metrics_readers, scrape, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow(seconds=230)]

REPO = Path(__file__).resolve().parents[2]
NODE = "real-node-0"
GPU_SPEC = "2x Tesla V100-PCIE-32GB"
IMAGE = "localhost/gpuslice/gpuslice:dev"
OPERATOR = "app.kubernetes.io/name=gpuslice-operator"
#: an allocated slice: Allocated, or InUse once its pod runs
IN_USE = ("Allocated", "InUse")


def _progress(msg: str) -> None:
    print(f"[deploy] {msg}", file=sys.stderr, flush=True)


def kubectl(c: DevCluster, *args: str, timeout: float = 240, check: bool = True) -> str:
    proc = c.kubectl(*args, check=False, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}\n{proc.stdout[-2000:]}")
    return proc.stdout


def diagnose(c: DevCluster) -> str:
    """Pods, events and the last log lines of gpuslice-system, for a failure's message."""
    out = [kubectl(c, "get", "pods", "-A", "-o", "wide", check=False)]
    out.append(kubectl(c, "get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)[-3000:])
    for pod in kubectl(c, "get", "pods", "-n", NAMESPACE, "-o", "name", check=False).split():
        log = kubectl(c, "logs", "-n", NAMESPACE, pod, "--all-containers", "--tail=15", check=False)
        out.append(f"--- {pod}\n{log[-2500:]}")
    return "\n".join(out)


def wait_for_log(c: DevCluster, pod: str, text: str, timeout: float, what: str) -> None:
    """Until `text` is in the pod's log; a timeout says what the log and the peering showed instead."""
    last: list[subprocess.CompletedProcess[str]] = []

    def says() -> bool:
        last[:] = [c.kubectl("logs", "-n", NAMESPACE, pod, check=False, timeout=60)]
        return last[0].returncode == 0 and text in last[0].stdout

    try:
        wait_for(says, timeout, what, interval=1)
    except AssertionError as exc:
        proc = last[0] if last else None
        shown = f"rc={proc.returncode} stderr={proc.stderr[-1000:]}\n{proc.stdout[-3000:]}" if proc else ""
        peering = peering_status(c)
        message = f"{exc}\nkubectl logs {pod}: {shown}\npeering: {peering}\n{diagnose(c)}"
        raise AssertionError(message) from None


def rollout(c: DevCluster, what: str, timeout: int = 240) -> None:
    proc = c.kubectl(
        "-n", NAMESPACE, "rollout", "status", what, f"--timeout={timeout}s", check=False, timeout=timeout + 30
    )
    if proc.returncode != 0:
        raise AssertionError(f"{what} did not become ready: {proc.stderr}\n{diagnose(c)}")


def peering_status(c: DevCluster) -> dict[str, Any]:
    doc = get_json(c, "clusterkopfpeering", "gpuslice")
    return dict((doc or {}).get("status") or {})


def active_operator(c: DevCluster, pods: list[str]) -> str | None:
    """The operator pod with the highest live peering priority (Kopf pauses every other one)."""
    peers = peering_status(c)
    ranked = sorted(
        (
            (info.get("priority", 0), pod)
            for pod in pods
            for ident, info in peers.items()
            if ident.startswith(pod)
        ),
        reverse=True,
    )
    return ranked[0][1] if ranked else None


def operator_pods(c: DevCluster) -> list[str]:
    pods = get_json(c, "pods", "-n", NAMESPACE, "-l", OPERATOR)["items"]
    return sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp"))


def slice_phase(c: DevCluster, name: str) -> str:
    doc = get_json(c, "gpuslice", name, "-n", TENANT) or {}
    return str(doc.get("status", {}).get("phase", ""))


def apply_docs(c: DevCluster, docs: list[dict[str, Any]]) -> None:
    c.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevCluster, Path]]:
    if os.geteuid() != 0:
        pytest.skip("real nodes and the image build need root (kubelet, containerd, mmdebstrap, chroot)")
    if shutil.which("mmdebstrap") is None:
        pytest.skip("the image build needs mmdebstrap (apt-get install mmdebstrap)")
    from gpuslice_dev.image import build_image

    started = time.monotonic()
    archive = build_image(output=None, progress=_progress)
    _progress(f"image ready after {time.monotonic() - started:.1f}s")
    c = DevCluster(tmp_path_factory.mktemp("deploy"), progress=_progress)
    try:
        c.up(nodes=0)
        start_real_nodes(c, 1)
        # the command a developer runs (ctr images import on every real node)
        load = subprocess.run(
            [sys.executable, "-m", "gpuslice_dev", "devcluster", "load-image", "--dir", str(c.dir),
             str(archive)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert load.returncode == 0, load.stderr
        overlay = write_overlay(c, NODE, GPU_SPEC)
        kubectl(c, "apply", "--server-side", "-k", str(REPO / "manifests" / "crds"))
        kubectl(c, "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        kubectl(c, "apply", "--server-side", "-k", str(overlay))
        rollout(c, "deploy/gpuslice-operator")
        rollout(c, "ds/gpuslice-agent")
        _progress(f"deployed after {time.monotonic() - started:.1f}s")
        yield c, overlay
    finally:
        c.down()


def test_image_carries_the_product_as_user_65532(deployed: tuple[DevCluster, Path]) -> None:
    c, _ = deployed
    for pod in operator_pods(c):
        spec = get_json(c, "pod", pod, "-n", NAMESPACE)
        (status,) = spec["status"]["containerStatuses"]
        assert status["image"].endswith(IMAGE) and status["ready"], status
        out = kubectl(c, "exec", "-n", NAMESPACE, pod, "--", "sh", "-c", "id -u; ls /usr/local/gpuslice/lib")
        assert out.split() == ["65532", "libgpuslice.so"]


def test_operator_and_agent_ready_with_one_active_replica(deployed: tuple[DevCluster, Path]) -> None:
    c, _ = deployed
    pods = operator_pods(c)
    assert len(pods) == 2, pods
    # both replicas report to the peering object; the one with the lower priority pauses
    peers = wait_for(lambda: len(peering_status(c)) == 2 and peering_status(c), 60, "both operator peers")
    assert {ident.split("@")[0] for ident in peers} == set(pods), peers
    active = active_operator(c, pods)
    assert active, peers
    (standby,) = [p for p in pods if p != active]
    wait_for_log(c, standby, "Pausing operations in favour of", 60, f"the standby {standby} pausing")
    # the agent pod published the node's GPUs as itself (its service account, its node only)
    slices = wait_for(
        lambda: get_json(c, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"],
        60,
        "GPUs",
    )
    assert {s["spec"]["driver"] for s in slices} == {"gpuslice.io"}
    ds = get_json(c, "ds", "gpuslice-agent", "-n", NAMESPACE)
    assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == 1


def test_tenant_slice_pod_gets_its_slice_through_the_deployed_product(
    deployed: tuple[DevCluster, Path],
) -> None:
    c, _ = deployed
    package = yaml.safe_load((REPO / "manifests" / "samples" / "v100-8g.yaml").read_text())
    package["spec"]["entitlements"][0]["slices"] = 8
    c.apply(yaml.safe_dump(package))
    c.create_namespace(TENANT, {"tenant.example.com/project": TENANT})
    wait_for(
        lambda: c.kubectl("get", "deviceclass", "v100-8g.gpuslice.io", check=False).returncode == 0,
        90,
        "the DeviceClass the deployed operator writes",
    )
    apply_docs(c, slice_pod("first", ["sleep", "3600"]))
    proc = c.kubectl(
        "wait", "--for=condition=Ready", "pod/first", "-n", TENANT, "--timeout=180s", check=False, timeout=200
    )
    assert proc.returncode == 0, (
        f"{proc.stderr}\n{kubectl(c, 'describe', 'pod', 'first', '-n', TENANT)}\n{diagnose(c)}"
    )
    out = kubectl(c, "exec", "-n", TENANT, "first", "--", "gpuslice-probe", "smi")
    assert out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"]
    wait_for(lambda: slice_phase(c, "first") in IN_USE, 60, "slice first allocated")


def test_standby_takes_over_when_the_active_operator_is_killed(deployed: tuple[DevCluster, Path]) -> None:
    c, _ = deployed
    before = get_json(c, "gpuslice", "first", "-n", TENANT)
    pods = operator_pods(c)
    active = active_operator(c, pods)
    assert active, peering_status(c)
    (standby,) = [p for p in pods if p != active]
    # The pod deleted as kubectl, a drain or a rollout delete it (SIGTERM): Kopf withdraws its
    # peering record on the way out, and the standby resumes at once.
    kubectl(c, "delete", "pod", active, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    killed_at = time.monotonic()
    wait_for_log(c, standby, "Resuming operations after the pause", 90, f"the standby {standby} resuming")
    # ... and serves a new slice: its claim, allocation and the tenant's pod on the card
    apply_docs(c, slice_pod("second", ["sleep", "3600"]))
    ready = c.kubectl(
        "wait", "--for=condition=Ready", "pod/second", "-n", TENANT, "--timeout=120s", check=False
    )
    assert ready.returncode == 0, f"{ready.stderr}\n{diagnose(c)}"
    wait_for(lambda: slice_phase(c, "second") in IN_USE, 60, "slice second allocated after the kill")
    _progress(f"new slice allocated {time.monotonic() - killed_at:.0f}s after the active operator was killed")
    out = kubectl(c, "exec", "-n", TENANT, "second", "--", "gpuslice-probe", "smi")
    assert out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"]
    # no slice lost: the first one keeps its claim and card, its pod still sees its slice
    after = get_json(c, "gpuslice", "first", "-n", TENANT)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["phase"] in IN_USE
    assert after["status"]["allocations"] == before["status"]["allocations"]
    out = kubectl(c, "exec", "-n", TENANT, "first", "--", "gpuslice-probe", "smi")
    assert out.strip().splitlines() == ["Tesla V100-PCIE-32GB, 8192 MiB"]
    rollout(c, "deploy/gpuslice-operator")  # the Deployment's replacement replica is Ready too


def test_a_sigkilled_active_operator_loses_no_slice(deployed: tuple[DevCluster, Path]) -> None:
    """No goodbye: the active replica's process is SIGKILLed from the host. Its peering record stays
    until it expires (60 s) or its restarted container overwrites it (same pod, same identity); either
    way a replica takes over, and a slice created meanwhile gets allocated."""
    c, _ = deployed
    rollout(c, "deploy/gpuslice-operator")
    pods = operator_pods(c)
    active = wait_for(lambda: active_operator(c, pods), 60, "an active operator")
    status = get_json(c, "pod", active, "-n", NAMESPACE)["status"]["containerStatuses"][0]
    container = status["containerID"].split("://", 1)[1]
    inspect = crictl(ensure_node_binaries(), dirs_of(c, NODE), "inspect", container)
    pid = json.loads(inspect.stdout)["info"]["pid"]
    before = get_json(c, "gpuslice", "first", "-n", TENANT)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    apply_docs(c, slice_pod("third", ["sleep", "3600"]))
    ready = c.kubectl(
        "wait", "--for=condition=Ready", "pod/third", "-n", TENANT, "--timeout=180s", check=False, timeout=200
    )
    assert ready.returncode == 0, f"{ready.stderr}\n{diagnose(c)}"
    wait_for(lambda: slice_phase(c, "third") in IN_USE, 60, "slice third allocated after the SIGKILL")
    _progress(f"new slice allocated {time.monotonic() - killed_at:.0f}s after the active operator's SIGKILL")
    restarts = get_json(c, "pod", active, "-n", NAMESPACE)["status"]["containerStatuses"][0]["restartCount"]
    assert restarts >= 1
    after = get_json(c, "gpuslice", "first", "-n", TENANT)
    assert after["status"]["allocations"] == before["status"]["allocations"]
    assert after["status"]["phase"] in IN_USE


#: what the operator writes at run time and leaves when it is stopped (the README deletes it by label)
OPERATOR_WRITTEN = (
    "validatingadmissionpolicies,validatingadmissionpolicybindings,"
    "mutatingadmissionpolicies,mutatingadmissionpolicybindings",
)


def test_gpuslice_check_passes_on_the_deployed_product(deployed: tuple[DevCluster, Path]) -> None:
    """The README's check, run on this deploy flow, judges what is deployed: this overlay's agent
    uses no RuntimeClass (the devcluster node has no NVIDIA runtime), so none is asked for."""
    c, _ = deployed
    proc = subprocess.run(
        [sys.executable, "-m", "gpuslice", "check", f"--kubeconfig={c.kubeconfig}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RuntimeClass: the deployed agent uses none" in proc.stdout, proc.stdout


#: The name the metrics-tls component's ServiceMonitor checks; the certificate must carry it.
METRICS_SERVER_NAME = "gpuslice-metrics.gpuslice-system.svc"


def _https_metrics(ip: str, ca: Path, token: str | None) -> int:
    """GET /metrics over TLS at a pod's address, checking the certificate against `ca` and the
    component's server name (as Prometheus does with its tlsConfig); the HTTP status."""
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPConnection(ip, 8080, timeout=20)
    conn.sock = ctx.wrap_socket(
        socket.create_connection((ip, 8080), timeout=20), server_hostname=METRICS_SERVER_NAME
    )
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    return conn.getresponse().status


def test_the_metrics_tls_component_serves_both_ports_over_https_only(
    deployed: tuple[DevCluster, Path], tmp_path: Path
) -> None:
    """The README's TLS steps on the deployed product: a kubernetes.io/tls Secret with the CA, the
    metrics-tls component added to the overlay; both ports then answer HTTPS (the token gate
    unchanged: no token 401, the reader's 200) with the Secret's certificate, and refuse plain HTTP."""
    c, overlay = deployed
    ca = LocalCA(tmp_path / "ca")
    pair = ca.issue("metrics", METRICS_SERVER_NAME, server=True, hosts=[METRICS_SERVER_NAME])
    data = {"tls.crt": pair.cert, "tls.key": pair.key, "ca.crt": ca.cert_path}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": "gpuslice-metrics-tls", "namespace": NAMESPACE},
        "data": {k: base64.b64encode(v.read_bytes()).decode() for k, v in data.items()},
    }
    apply_docs(c, [secret])
    # A layer over the installed overlay, as a platform adds the component over its own: the
    # component's patches come after the devcluster overlay's (which set the agent's args whole).
    layer = tmp_path / "with-tls"
    layer.mkdir()
    (layer / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(overlay, layer)],
                "components": [os.path.relpath(REPO / "manifests/components/metrics-tls", layer)],
            }
        )
    )
    kubectl(c, "apply", "--server-side", "-k", str(layer))
    rollout(c, "deploy/gpuslice-operator")
    rollout(c, "ds/gpuslice-agent")
    pods = get_json(c, "pods", "-n", NAMESPACE)["items"]
    ips = {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
    }
    assert any(n.startswith("gpuslice-agent") for n in ips) and any(
        n.startswith("gpuslice-operator") for n in ips
    )
    with metrics_readers(c) as readers:
        for name, ip in ips.items():
            assert _https_metrics(ip, ca.cert_path, None) == 401, name
            assert _https_metrics(ip, ca.cert_path, readers.prometheus) == 200, name
            with pytest.raises(OSError):  # plain HTTP: the TLS handshake fails, no answer
                scrape(f"http://{ip}:8080/metrics", readers.prometheus, timeout=10)


def _leftovers(c: DevCluster) -> dict[str, list[str]]:
    def names(*args: str) -> list[str]:
        return kubectl(c, "get", *args, "-o", "name", "--ignore-not-found", check=False).split()

    found = {
        "crds": [n for n in names("crd") if "gpuslice.io" in n or "kopf.dev" in n],
        "namespaces": [n for n in names("namespace") if "gpuslice" in n],
        "deviceclasses": [n for n in names("deviceclass") if "gpuslice" in n],
        "resourceslices": [
            s["metadata"]["name"]
            for s in (get_json(c, "resourceslices") or {"items": []})["items"]
            if s["spec"].get("driver") == "gpuslice.io"
        ],
        "clusterroles": [n for n in names("clusterrole") if "gpuslice" in n],
        "clusterrolebindings": [n for n in names("clusterrolebinding") if "gpuslice" in n],
    }
    for kind in (
        "validatingadmissionpolicy",
        "validatingadmissionpolicybinding",
        "mutatingadmissionpolicy",
        "mutatingadmissionpolicybinding",
    ):
        found[kind] = [n for n in names(kind) if "gpuslice" in n]
    found["resourcequotas"] = [n for n in names("resourcequota", "-A") if "gpuslice" in n]
    node = get_json(c, "node", NODE)
    found["node taints"] = [t["key"] for t in node["spec"].get("taints", []) if "gpuslice" in t["key"]]
    tenant = get_json(c, "namespace", TENANT) or {"metadata": {}}
    # "Tenant namespaces keep only the labels you gave them" (README): Pod Security's too go
    given = {"tenant.example.com/project", "kubernetes.io/metadata.name"}
    found["tenant labels"] = sorted(set(tenant["metadata"].get("labels", {})) - given)
    return {k: v for k, v in found.items() if v}


def test_uninstall_as_the_readme_says_leaves_nothing_behind(deployed: tuple[DevCluster, Path]) -> None:
    c, overlay = deployed
    for pod in ("first", "second", "third"):
        kubectl(c, "delete", "pod", pod, "-n", TENANT, "--ignore-not-found", "--wait=true", "--timeout=60s")
    # the README's uninstall, with the overlay this cluster was installed from
    kubectl(c, "delete", "gpuslices", "--all", "-A", "--wait=true", "--timeout=120s")
    kubectl(c, "delete", "gpupackages", "--all", "--wait=true", "--timeout=120s")
    kubectl(
        c,
        "-n",
        NAMESPACE,
        "delete",
        "ds/gpuslice-agent",
        "deploy/gpuslice-operator",
        "--cascade=foreground",
        "--wait=true",
        "--timeout=120s",
    )
    kubectl(c, "delete", *OPERATOR_WRITTEN, "-l", "app.kubernetes.io/managed-by=gpuslice")
    kubectl(c, "taint", "nodes", "-l", "nvidia.com/gpu.present=true", "gpuslice.io/gpu-")
    kubectl(c, "delete", "-k", str(overlay), "--ignore-not-found", "--wait=true", "--timeout=180s")
    deadline = time.monotonic() + 90
    while (left := _leftovers(c)) and time.monotonic() < deadline:
        time.sleep(2)
    assert left == {}, left
