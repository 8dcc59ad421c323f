"""A real Kueue for the devcluster: its controller built from the Go module `sigs.k8s.io/kueue`,
installed from the manifests in that module's own source (CRDs, RBAC, webhook configurations).

The binary is cached like the control plane under
`${XDG_CACHE_HOME:-~/.cache}/gpuslice/bin/kueue-<version>/kueue`. The manifests are read from the
module's `config/components` (the source `go mod download` puts in the module cache) and given what
Kueue's own kustomization (`config/default`) gives them: the `kueue-` name prefix, the
`kueue-system` namespace, the webhook namespace selectors. Only where the webhooks are reached
differs: a controller on this machine, not a Service, so every webhook (admission and CRD
conversion) is a URL to 127.0.0.1 with the devcluster's CA as its caBundle, and the controller
serves a certificate that CA issued (Kueue's internal certificate management is off: it writes
certificates for a Service's DNS name).

Kueue with its internal certificates off reads its metrics certificate from a fixed path,
/etc/kueue/metrics/certs; the controller runs in its own mount namespace (`unshare`, root) with the
cluster's certificate directory bound there, so clusters on one machine do not share a file. Its
visibility server (the pending-workloads API) reads a fixed /visibility too and is an aggregated
API server with no APIService here: the VisibilityOnDemand gate is off.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from gpuslice_dev.devcluster.cluster import DevCluster

from gpuslice_dev.devcluster.binaries import (
    BuildError,
    Component,
    Progress,
    build_component,
    build_lock,
    cache_root,
    default_progress,
)
from gpuslice_dev.devcluster.supervisor import DevClusterError, ProcessRecord

KUEUE_MODULE = "sigs.k8s.io/kueue"
KUEUE_VERSION = "v0.17.0"
KUEUE = Component(
    "kueue",
    KUEUE_MODULE,
    KUEUE_VERSION,
    (f"{KUEUE_MODULE}/cmd/kueue",),
    ldflags=f"-s -w -X {KUEUE_MODULE}/pkg/version.GitVersion={KUEUE_VERSION}",
)


@dataclass(frozen=True)
class KueueBinaries:
    kueue: Path


def _paths() -> KueueBinaries:
    return KueueBinaries(kueue=cache_root() / "bin" / KUEUE.key / "kueue")


def ensure_kueue(progress: Progress | None = None) -> KueueBinaries:
    """The kueue controller, built from the Go module on first use, then cached."""
    paths = _paths()
    if paths.kueue.exists():
        return paths
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.26 to build Kueue")
    report = progress or default_progress
    with build_lock():
        if not paths.kueue.exists():
            started = time.monotonic()
            build_component(KUEUE, report)
            report(f"kueue {KUEUE_VERSION} built in {time.monotonic() - started:.0f}s")
    return paths


# ---------------------------------------------------------------------------------------------------
# Manifests, from the module's own config/
# ---------------------------------------------------------------------------------------------------

NAMESPACE = "kueue-system"
NAME_PREFIX = "kueue-"
#: The integrations the devcluster's Kueue manages (Configuration `integrations.frameworks`).
FRAMEWORKS = ("batch/job", "pod", "deployment")
#: Kueue's own gates off here (see the module docstring); `kueue_feature_gates` adds the caller's.
DEFAULT_FEATURE_GATES = "VisibilityOnDemand=false"
#: The user the controller acts as: its ServiceAccount's name, so the shipped bindings apply.
CONTROLLER_USER = f"system:serviceaccount:{NAMESPACE}:{NAME_PREFIX}controller-manager"


class KueueError(DevClusterError):
    pass


def module_dir() -> Path:
    """Where the Go module cache holds `sigs.k8s.io/kueue@<version>`'s source (downloaded if not)."""
    import subprocess

    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{KUEUE_MODULE}@{KUEUE_VERSION}"],
        capture_output=True,
        text=True,
        cwd=cache_root() if cache_root().is_dir() else None,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )
    if proc.returncode != 0:
        raise KueueError(f"go mod download {KUEUE_MODULE}@{KUEUE_VERSION} failed:\n{proc.stderr[-800:]}")
    return Path(json.loads(proc.stdout)["Dir"])


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return doc


def _merge_webhook_patch(configs: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    """A strategic-merge patch of a webhook configuration: webhooks merge by name."""
    for config in configs:
        if (config["kind"], config["metadata"]["name"]) != (patch["kind"], patch["metadata"]["name"]):
            continue
        by_name = {w["name"]: w for w in config["webhooks"]}
        for change in patch.get("webhooks", []):
            if change["name"] not in by_name:
                raise KueueError(f"kueue's webhook patch names {change['name']}, which it does not define")
            by_name[change["name"]].update({k: v for k, v in change.items() if k != "name"})


def _client_config(service: dict[str, Any], url: str, ca_bundle: str) -> dict[str, Any]:
    return {"url": url.rstrip("/") + service.get("path", "/"), "caBundle": ca_bundle}


def _prefixed(doc: dict[str, Any]) -> dict[str, Any]:
    """kustomize's namePrefix and namespace, as config/default sets them (CRDs keep their names)."""
    doc = copy.deepcopy(doc)
    meta = doc["metadata"]
    kind = doc["kind"]
    if kind != "CustomResourceDefinition":
        meta["name"] = NAME_PREFIX + meta["name"]
    if kind in ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "Secret", "ConfigMap"):
        meta["namespace"] = NAMESPACE
    meta.setdefault("labels", {})["app.kubernetes.io/name"] = "kueue"
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        doc["roleRef"]["name"] = NAME_PREFIX + doc["roleRef"]["name"]
        for subject in doc.get("subjects", []):
            if subject["kind"] == "ServiceAccount":
                subject["name"] = NAME_PREFIX + subject["name"]
                subject["namespace"] = NAMESPACE
    return doc


def manifests(moddir: Path, webhook_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs (with their conversion webhooks), RBAC and webhook configurations from the
    module's config/components, every webhook pointed at `webhook_url` (https://127.0.0.1:port)."""
    import base64

    ca_bundle = base64.b64encode(ca_pem).decode()
    components = moddir / "config" / "components"
    out: list[dict[str, Any]] = []

    crd_dir = components / "crd"
    crd_kust = _kustomization(crd_dir)
    crds = {d["metadata"]["name"]: d for r in crd_kust["resources"] for d in _docs(crd_dir / r)}
    for patch_ref in crd_kust.get("patches", []):
        (patch,) = _docs(crd_dir / patch_ref["path"])
        crd = crds[patch["metadata"]["name"]]
        conversion = copy.deepcopy(patch["spec"]["conversion"])
        hook = conversion["webhook"]
        hook["clientConfig"] = _client_config(hook["clientConfig"]["service"], webhook_url, ca_bundle)
        crd["spec"]["conversion"] = conversion
    out += [_prefixed(c) for c in crds.values()]

    rbac = components / "rbac"
    for r in _kustomization(rbac)["resources"]:
        out += [_prefixed(d) for d in _docs(rbac / r)]

    hooks_dir = components / "webhook"
    hooks_kust = _kustomization(hooks_dir)
    configs = [
        d
        for r in hooks_kust["resources"]
        for d in _docs(hooks_dir / r)
        if d["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]
    for patch_ref in hooks_kust.get("patches", []):
        for patch in yaml.safe_load_all(patch_ref["patch"]):
            _merge_webhook_patch(configs, patch)
    for config in configs:
        for hook in config["webhooks"]:
            hook["clientConfig"] = _client_config(hook["clientConfig"]["service"], webhook_url, ca_bundle)
        out.append(_prefixed(config))
    return out


#: Fair sharing's preemption strategies: the pair the shipped controller_manager_config.yaml
#: suggests (v1beta2 enables fair sharing by the presence of `fairSharing`, which needs them).
FAIR_SHARING = {"preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]}


def configuration(
    *, health_port: int, metrics_port: int, webhook_port: int, cert_dir: Path, fair_sharing: bool = False
) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2): the shipped
    controller_manager_config.yaml with loopback ports, no leader election (one controller runs),
    certificates from `cert_dir`, and the devcluster's integrations; fair sharing on only when asked,
    as Kueue ships it off."""
    config: dict[str, Any] = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }
    if fair_sharing:
        config["fairSharing"] = copy.deepcopy(FAIR_SHARING)
    return config


METRICS_CERT_PATH = "/etc/kueue/metrics/certs"


def controller_argv(
    binary: Path, config_file: Path, kubeconfig: Path, cert_dir: Path, gates: str, visibility_port: int
) -> list[str]:
    """The controller in a private mount namespace where `cert_dir` is Kueue's fixed metrics
    certificate path (see the module docstring)."""
    kueue = [
        str(binary),
        f"--config={config_file}",
        f"--kubeconfig={kubeconfig}",
        f"--feature-gates={gates}",
        f"--visibility-server-port={visibility_port}",
        "--zap-log-level=info",
    ]
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--propagation=private",
        "sh",
        "-c",
        script,
        "kueue",
        str(cert_dir),
        METRICS_CERT_PATH,
        *kueue,
    ]


def kueue_feature_gates(extra: str = "") -> str:
    gates: dict[str, str] = {}
    for part in (DEFAULT_FEATURE_GATES, extra):
        for item in filter(None, (g.strip() for g in part.split(","))):
            name, _, value = item.partition("=")
            gates[name] = value
    return ",".join(f"{k}={v}" for k, v in gates.items())


def _ready(url: str) -> bool:
    from gpuslice_dev.devcluster.supervisor import http_ok

    return http_ok(url)


def start_devcluster_kueue(
    cluster: DevCluster,
    progress: Progress | None = None,
    *,
    feature_gates: str = "",
    timeout: float = 120,
    fair_sharing: bool = False,
) -> None:
    """`devcluster up --with-kueue`: Kueue's manifests applied, its controller started (supervised
    as `kueue`) and ready: its webhooks answer and its CRDs are served."""
    from gpuslice_dev.devcluster import pki
    from gpuslice_dev.devcluster.supervisor import free_port

    report = progress or default_progress
    if os.geteuid() != 0:
        raise KueueError("the devcluster's Kueue needs root (its controller runs in a mount namespace)")
    binaries = ensure_kueue(progress)
    st = cluster.state()
    if st is None:
        raise KueueError(f"no devcluster in {cluster.dir}; run `gpuslice-dev devcluster up` first")
    workdir = cluster.dir / "kueue"
    cert_dir = workdir / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    ca = pki.LocalCA(cluster.dir / "pki")
    serving = ca.issue("kueue-webhook", "kueue-webhook", server=True, hosts=["127.0.0.1", "localhost"])
    # controller-runtime's webhook server and Kueue's metrics read tls.crt/tls.key from one folder.
    shutil.copyfile(serving.cert, cert_dir / "tls.crt")
    shutil.copyfile(serving.key, cert_dir / "tls.key")
    (cert_dir / "tls.key").chmod(0o600)
    client = ca.issue("kueue-controller", CONTROLLER_USER, ["system:serviceaccounts"])
    kubeconfig = pki.write_kubeconfig(
        workdir / "kubeconfig", st.server, ca.cert_path, client, CONTROLLER_USER
    )
    ports = {
        name: free_port() for name in ("kueue-webhook", "kueue-health", "kueue-metrics", "kueue-visibility")
    }
    cluster.create_namespace(NAMESPACE)
    docs = manifests(module_dir(), f"https://127.0.0.1:{ports['kueue-webhook']}", ca.cert_path.read_bytes())
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        *(f"crd/{c['metadata']['name']}" for c in crds),
    )
    config_file = workdir / "controller_manager_config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            configuration(
                health_port=ports["kueue-health"],
                metrics_port=ports["kueue-metrics"],
                webhook_port=ports["kueue-webhook"],
                cert_dir=cert_dir,
                fair_sharing=fair_sharing,
            ),
            sort_keys=False,
        )
    )
    Path(METRICS_CERT_PATH).mkdir(parents=True, exist_ok=True)
    st = cluster.state()
    assert st is not None
    st.ports.update(ports)
    st.save()
    rec = cluster.start_process(
        "kueue",
        controller_argv(
            binaries.kueue,
            config_file,
            kubeconfig,
            cert_dir,
            kueue_feature_gates(feature_gates),
            ports["kueue-visibility"],
        ),
    )
    report(f"starting kueue {KUEUE_VERSION} (pid {rec.pid}) ...")
    _wait_ready(rec, ports["kueue-health"], timeout)


def _wait_ready(rec: ProcessRecord, health_port: int, timeout: float) -> None:
    readyz = f"http://127.0.0.1:{health_port}/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not rec.alive():
            raise KueueError(
                f"kueue exited; log: {rec.log}\n{Path(rec.log).read_text(errors='replace')[-2000:]}"
            )
        if _ready(readyz):
            return
        time.sleep(0.3)
    raise KueueError(f"kueue not ready after {timeout:.0f}s; log: {rec.log}")


def kill_kueue(cluster: DevCluster) -> int:
    """SIGKILL the devcluster's Kueue controller (a crash: no graceful shutdown); returns its pid."""
    rec = _kueue_record(cluster)
    os.kill(rec.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rec.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rec.pid


def restart_kueue(cluster: DevCluster, timeout: float = 120) -> ProcessRecord:
    """Start the devcluster's Kueue controller again as `start_devcluster_kueue` started it (its
    recorded command line: the same Configuration, ports and certificates) once it has died, and
    wait until it is ready."""
    rec = _kueue_record(cluster)
    if rec.alive():
        raise KueueError(f"kueue (pid {rec.pid}) is still running")
    st = cluster.state()
    assert st is not None
    again = cluster.start_process("kueue", rec.argv)
    _wait_ready(again, st.ports["kueue-health"], timeout)
    return again


def _kueue_record(cluster: DevCluster) -> ProcessRecord:
    st = cluster.state()
    rec = st.processes.get("kueue") if st is not None else None
    if rec is None:
        raise KueueError(f"no kueue in the devcluster in {cluster.dir}; run `devcluster up --with-kueue`")
    return rec
