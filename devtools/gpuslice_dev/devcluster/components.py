"""The control plane's components and their flags: what each one is started with (pure)."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpuslice_dev.devcluster import pki
from gpuslice_dev.devcluster.binaries import DEFAULT_KUBERNETES, Binaries, minor_of

#: Order matters: started in this order, stopped in reverse.
CORE_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: --feature-gates of every component (kube-apiserver, kube-controller-manager, kube-scheduler,
#: kubelet) per minor: what a platform on that minor runs, its defaults (the README's "Kubernetes
#: versions" table, read from each minor's pkg/features/kube_features.go). On 1.36 and 1.37 the gates
#: named are beta or GA and on by default (named so a gate that is gone fails the start); none is
#: locked there. On 1.35 they are alpha and off, as a managed 1.35 runs them: gpuslice must see that
#: and say what it cannot do (`--feature-gates` turns them on for a self-managed platform's case).
#: DRAExtendedResource is not named: GA and locked on in 1.37 (setting it is refused there).
FEATURE_GATES_BY_MINOR: dict[str, str] = {
    "1.35": "",
    "1.36": "DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true",
    "1.37": "DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRADeviceTaints=true",
}
FEATURE_GATES = FEATURE_GATES_BY_MINOR[DEFAULT_KUBERNETES]


def feature_gates(release: str, extra: str = "") -> str:
    """The --feature-gates value for Kubernetes `release`: its minor's set, then `extra`
    ("Gate=bool,...") on top, a gate named in both taking extra's value."""
    gates: dict[str, str] = {}
    for part in (FEATURE_GATES_BY_MINOR[minor_of(release)], extra):
        for item in filter(None, (g.strip() for g in part.split(","))):
            name, _, value = item.partition("=")
            gates[name.strip()] = value.strip()
    return ",".join(f"{k}={v}" for k, v in gates.items())


def gates_map(gates: str) -> dict[str, bool]:
    """ "A=true,B=false" -> {"A": True, "B": False} (the kubelet's config file form)."""
    return {k: v == "true" for k, v in (g.split("=", 1) for g in gates.split(",") if g)}


def _gates_flag(gates: str) -> list[str]:
    # An empty --feature-gates= is the defaults too; left out, the command line says so plainly.
    return [f"--feature-gates={gates}"] if gates else []


KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


def etcd_argv(bins: Binaries, data: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(bins.etcd),
        "--name=devcluster",
        f"--data-dir={data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--listen-metrics-urls=",
        # A throw-away dev cluster: skipping fsync keeps writes fast on shared disks.
        "--unsafe-no-fsync",
        "--quota-backend-bytes=2147483648",
        "--log-level=warn",
    ]


def apiserver_argv(
    bins: Binaries,
    *,
    etcd_port: int,
    port: int,
    pki_dir: Path,
    serving: pki.CertPair,
    service_accounts: pki.CertPair,
    kubelet_client: pki.CertPair,
    feature_gates: str,
    emulated_version: str = "",
) -> list[str]:
    """emulated_version ("1.34"): the API server serves that minor's APIs and feature gates (its
    /version says so in emulationMajor/emulationMinor), as a platform on that minor does: the way to
    meet a minor older than the binaries built here (kube-apiserver 1.37 emulates 1.34 to 1.37)."""
    ca = pki_dir / "ca.crt"
    return [
        str(bins.kube_apiserver),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        # The `kubernetes` Service endpoint may not be loopback; nothing here needs it.
        "--endpoint-reconciler-type=none",
        f"--secure-port={port}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        f"--client-ca-file={ca}",
        f"--service-account-key-file={service_accounts.cert}",
        f"--service-account-signing-key-file={service_accounts.key}",
        "--service-account-issuer=https://kubernetes.default.svc",
        "--api-audiences=https://kubernetes.default.svc",
        # Node + NodeRestriction: a real kubelet may touch only its own Node and its pods' objects.
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        # kube-apiserver -> kubelet (logs, exec): a client certificate the kubelets authorize by
        # webhook, and their serving certificates checked against the cluster's CA.
        f"--kubelet-client-certificate={kubelet_client.cert}",
        f"--kubelet-client-key={kubelet_client.key}",
        f"--kubelet-certificate-authority={ca}",
        "--kubelet-preferred-address-types=InternalIP",
        "--service-cluster-ip-range=10.96.0.0/16",
        # Privileged pods must reach admission so gpuslice's policies (not this flag) reject them.
        "--allow-privileged=true",
        *_gates_flag(feature_gates),
        *([f"--emulated-version=kube={emulated_version}"] if emulated_version else []),
        "--profiling=false",
        "--enable-priority-and-fairness=false",
        f"--cert-dir={pki_dir / 'apiserver-generated'}",
    ]


def _served_controller_flags(kubeconfig: Path, port: int) -> list[str]:
    """What kube-controller-manager and kube-scheduler are both given: one kubeconfig to reach the API
    server and to check who calls their own HTTPS port (127.0.0.1:port), and no leader election (one of
    each runs)."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--leader-elect=false",
    ]


def controller_manager_argv(
    bins: Binaries,
    *,
    kubeconfig: Path,
    port: int,
    pki_dir: Path,
    service_account_key: Path,
    gates: str | None = None,
) -> list[str]:
    return [
        str(bins.kube_controller_manager),
        *_served_controller_flags(kubeconfig, port),
        # Each controller acts as its own service account, with the bootstrap RBAC roles.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={service_account_key}",
        f"--root-ca-file={pki_dir / 'ca.crt'}",
        "--controllers=*",
        *_gates_flag(feature_gates(bins.kubernetes) if gates is None else gates),
        f"--cert-dir={pki_dir / 'kcm-generated'}",
        "--concurrent-gc-syncs=5",
    ]


def scheduler_argv(
    bins: Binaries, *, kubeconfig: Path, port: int, pki_dir: Path, gates: str | None = None
) -> list[str]:
    return [
        str(bins.kube_scheduler),
        *_served_controller_flags(kubeconfig, port),
        *_gates_flag(feature_gates(bins.kubernetes) if gates is None else gates),
        f"--cert-dir={pki_dir / 'scheduler-generated'}",
    ]


#: A pod of a Job with this annotation is not completed by kwok: it stays Running, as a Job's pod at
#: work does, until something deletes it (kwok completes any other Job's pod as soon as it runs).
KWOK_KEEP_RUNNING = "kwok.gpuslice.io/keep-running"


def kwok_stages(cached: str) -> str:
    """kwok's stages (the cached fast ones) with pod-complete skipping pods that carry
    KWOK_KEEP_RUNNING; every other stage as kwok ships it."""
    docs = [d for d in yaml.safe_load_all(cached) if d]
    for doc in docs:
        if doc.get("kind") == "Stage" and doc["metadata"]["name"] == "pod-complete":
            doc["spec"]["selector"]["matchExpressions"].append(
                {"key": f'.metadata.annotations["{KWOK_KEEP_RUNNING}"]', "operator": "DoesNotExist"}
            )
    return yaml.safe_dump_all(docs, sort_keys=False)


def kwok_argv(bins: Binaries, *, kubeconfig: Path, port: int, stages: Path | None = None) -> list[str]:
    """kwok's command line; `stages`: the file of its stages (kwok_stages), the cached one if None."""
    return [
        str(bins.kwok),
        f"--kubeconfig={kubeconfig}",
        f"--config={stages or bins.kwok_stages}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
        "--disregard-status-with-annotation-selector=kwok.x-k8s.io/status=custom",
        "--cidr=10.0.0.1/16",
        "--node-ip=10.0.0.1",
        "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{port}",
    ]


def node_manifest(name: str, cpu: str = "32", memory: str = "256Gi") -> dict[str, object]:
    """A kwok node: Ready as long as kwok runs, with room for many pods."""
    resources = {"cpu": cpu, "memory": memory, "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1],
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "spec": {},
        "status": {"allocatable": resources, "capacity": resources},
    }
