"""A real Prometheus for the devcluster: built from its Go module, scraping the way the shipped
ServiceMonitor says.

`prometheus` and `promtool` are compiled from `github.com/prometheus/prometheus` (module versions
v0.3xx.y are Prometheus 3.xx.y) with only the Kubernetes service discovery (the `remove_all_sd` and
`enable_kubernetes_sd` build tags the module's `plugins/` files carry), and cached like the control
plane under `${XDG_CACHE_HOME:-~/.cache}/gpuslice/bin/prometheus-<version>/`.

The scrape configuration is not written by hand: `scrape_configs` translates
`manifests/components/monitoring/servicemonitor.yaml` into Prometheus' own `kubernetes_sd_configs`
(role `endpointslice`) the way the Prometheus Operator does, so a wrong port name, path, selector,
token or TLS setting in the ServiceMonitor is a target Prometheus cannot scrape here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
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

PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
#: Prometheus 3.16.0.
PROMETHEUS_VERSION = "v0.316.0"
_RELEASE = "3." + PROMETHEUS_VERSION.split(".")[1][1:].lstrip("0") + "." + PROMETHEUS_VERSION.split(".")[2]
PROMETHEUS = Component(
    "prometheus",
    PROMETHEUS_MODULE,
    PROMETHEUS_VERSION,
    (f"{PROMETHEUS_MODULE}/cmd/prometheus", f"{PROMETHEUS_MODULE}/cmd/promtool"),
    ldflags=f"-s -w -X github.com/prometheus/common/version.Version={_RELEASE}",
    # Only Kubernetes' service discovery: the cloud SDKs (AWS, Azure, GCE...) stay out of the build.
    tags="remove_all_sd,enable_kubernetes_sd",
)


@dataclass(frozen=True)
class PrometheusBinaries:
    prometheus: Path
    promtool: Path


def _paths() -> PrometheusBinaries:
    out = cache_root() / "bin" / PROMETHEUS.key
    return PrometheusBinaries(prometheus=out / "prometheus", promtool=out / "promtool")


def ensure_prometheus(progress: Progress | None = None) -> PrometheusBinaries:
    """prometheus and promtool, built from the Go module on first use, then cached."""
    paths = _paths()
    if paths.prometheus.exists() and paths.promtool.exists():
        return paths
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.26 to build Prometheus")
    report = progress or default_progress
    with build_lock():
        if not (paths.prometheus.exists() and paths.promtool.exists()):
            started = time.monotonic()
            build_component(PROMETHEUS, report)
            report(f"prometheus {_RELEASE} built in {time.monotonic() - started:.0f}s")
    return paths


# ---------------------------------------------------------------------------------------------------
# ServiceMonitor -> scrape_configs, as the Prometheus Operator generates them
# (pkg/prometheus/promcfg.go: generateServiceMonitorConfig). Only what the ServiceMonitor uses, and an
# error for anything else, so a field added to it later cannot be silently ignored here.
# ---------------------------------------------------------------------------------------------------

_SUPPORTED_SPEC = {"jobLabel", "namespaceSelector", "selector", "endpoints"}
_SUPPORTED_ENDPOINT = {
    "port",
    "path",
    "interval",
    "scheme",
    "bearerTokenFile",
    "honorLabels",
    "tlsConfig",
    "authorization",
}


class ServiceMonitorError(ValueError):
    """The ServiceMonitor uses a field this translation does not know."""


def _label(name: str) -> str:
    """A Kubernetes label name as Prometheus' SD meta label suffix (sanitised like the operator)."""
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


@dataclass(frozen=True)
class Credentials:
    """What Prometheus would have in its pod: the API server's address and CA, and the files the
    ServiceMonitor names (service account token, CA) mapped to where they are on this machine."""

    api_server: str
    api_ca_file: Path
    api_token_file: Path
    files: dict[str, Path]  # in-pod path -> local path

    def local(self, in_pod: str) -> str:
        if in_pod not in self.files:
            raise ServiceMonitorError(
                f"the ServiceMonitor reads {in_pod}, which this Prometheus has no copy of"
            )
        return str(self.files[in_pod])


def _tls(tls: dict[str, Any], creds: Credentials) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tls.items():
        if key == "caFile":
            out["ca_file"] = creds.local(value)
        elif key == "serverName":
            out["server_name"] = value
        elif key == "insecureSkipVerify":
            out["insecure_skip_verify"] = value
        elif key == "ca" and "secret" in value:
            out["ca_file"] = creds.local(f"secret/{value['secret']['name']}/{value['secret']['key']}")
        else:
            raise ServiceMonitorError(f"tlsConfig.{key} is not translated")
    return out


def scrape_configs(servicemonitor: dict[str, Any], creds: Credentials) -> list[dict[str, Any]]:
    """One scrape config per endpoint of `servicemonitor`, with Kubernetes endpointslice discovery."""
    meta = servicemonitor["metadata"]
    spec = servicemonitor["spec"]
    unknown = set(spec) - _SUPPORTED_SPEC
    if unknown:
        raise ServiceMonitorError(f"ServiceMonitor spec fields not translated: {sorted(unknown)}")
    namespaces = spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]]
    selector = spec.get("selector", {})
    if set(selector) - {"matchLabels"}:
        raise ServiceMonitorError("only selector.matchLabels is translated")
    configs = []
    for i, ep in enumerate(spec["endpoints"]):
        unknown = set(ep) - _SUPPORTED_ENDPOINT
        if unknown:
            raise ServiceMonitorError(f"endpoint {i}: fields not translated: {sorted(unknown)}")
        relabel: list[dict[str, Any]] = [
            # Keep only Services whose labels match the selector (every matchLabels pair).
            *(
                {
                    "source_labels": [
                        f"__meta_kubernetes_service_label_{_label(k)}",
                        f"__meta_kubernetes_service_labelpresent_{_label(k)}",
                    ],
                    "regex": f"({v});true",
                    "action": "keep",
                }
                for k, v in selector.get("matchLabels", {}).items()
            ),
            {
                "source_labels": ["__meta_kubernetes_endpointslice_port_name"],
                "regex": ep["port"],
                "action": "keep",
            },
            # The operator's target labels: namespace, service, pod, container, endpoint, job.
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        ]
        if spec.get("jobLabel"):
            relabel.append(
                {
                    "source_labels": [f"__meta_kubernetes_service_label_{_label(spec['jobLabel'])}"],
                    "regex": "(.+)",
                    "target_label": "job",
                    "replacement": "${1}",
                }
            )
        relabel.append({"target_label": "endpoint", "replacement": ep["port"]})
        config: dict[str, Any] = {
            "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "honor_labels": bool(ep.get("honorLabels", False)),
            "metrics_path": ep.get("path", "/metrics"),
            "scheme": ep.get("scheme", "http"),
            "kubernetes_sd_configs": [
                {
                    "role": "endpointslice",
                    "api_server": creds.api_server,
                    "tls_config": {"ca_file": str(creds.api_ca_file)},
                    "authorization": {"credentials_file": str(creds.api_token_file)},
                    "namespaces": {"names": list(namespaces)},
                }
            ],
            "relabel_configs": relabel,
        }
        if "interval" in ep:
            config["scrape_interval"] = ep["interval"]
        if "bearerTokenFile" in ep:
            config["authorization"] = {"credentials_file": creds.local(ep["bearerTokenFile"])}
        if "authorization" in ep:
            raise ServiceMonitorError(
                "endpoint authorization (a Secret) is not translated; use bearerTokenFile"
            )
        if "tlsConfig" in ep:
            config["tls_config"] = _tls(ep["tlsConfig"], creds)
        configs.append(config)
    return configs


def load_servicemonitor(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ServiceMonitor"]
    return dict(doc)


# ---------------------------------------------------------------------------------------------------
# The running server
# ---------------------------------------------------------------------------------------------------


class PrometheusError(RuntimeError):
    pass


@dataclass
class PrometheusServer:
    """A Prometheus process on loopback and its HTTP API."""

    url: str
    process: subprocess.Popen[bytes]
    config_file: Path

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400/422 carry Prometheus' own error in JSON
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, **params: Any) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, **params)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return active

    def reload(self) -> None:
        urllib.request.urlopen(
            urllib.request.Request(f"{self.url}/-/reload", method="POST"), timeout=30
        ).close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def prometheus_argv(binary: Path, config_file: Path, workdir: Path, port: int) -> list[str]:
    return [
        str(binary),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]


def write_config(config: dict[str, Any], workdir: Path, rule_files: list[Path] | None = None) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    if rule_files:
        config = {**config, "rule_files": [str(p) for p in rule_files]}
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return config_file


def wait_ready(url: str, alive: Callable[[], bool], log: Path, deadline: float = 60.0) -> None:
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        if not alive():
            raise PrometheusError(f"prometheus exited:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while it replays its WAL
            pass
        time.sleep(0.3)
    raise PrometheusError(f"prometheus on {url} not ready after {deadline:.0f}s; log: {log}")


def start_prometheus(
    binary: Path,
    config: dict[str, Any],
    workdir: Path,
    port: int,
    *,
    rule_files: list[Path] | None = None,
) -> PrometheusServer:
    """Start `binary` with `config` on 127.0.0.1:`port`, its data under `workdir`; wait until ready."""
    config_file = write_config(config, workdir, rule_files)
    log = workdir / "prometheus.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            prometheus_argv(binary, config_file, workdir, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", proc, config_file)
    try:
        wait_ready(server.url, lambda: proc.poll() is None, log)
    except PrometheusError:
        server.stop()
        raise
    return server


# ---------------------------------------------------------------------------------------------------
# What Prometheus would hold in its pod, made on the devcluster
# ---------------------------------------------------------------------------------------------------

#: The ServiceMonitor's token path, and the monitoring component's subject (metrics-reader.yaml).
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SERVICE_ACCOUNT_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def discovery_role(name: str) -> dict[str, Any]:
    """What Prometheus' service discovery reads, as kube-prometheus-stack's Prometheus ClusterRole
    grants it (services, endpoints, pods, endpointslices: get, list, watch; GET /metrics)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["services", "endpoints", "pods"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
            {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
        ],
    }


def scraper_docs(
    metrics_reader_binding: dict[str, Any], namespace: str, suffix: str = ""
) -> list[dict[str, Any]]:
    """Prometheus' ServiceAccount in `namespace`, the monitoring component's metrics-reader binding
    pointed at it (as a user patches it for their Prometheus) and the discovery role, bound."""
    (subject,) = metrics_reader_binding["subjects"]
    account = subject["name"]
    binding = json.loads(json.dumps(metrics_reader_binding))
    binding["metadata"]["name"] += suffix
    binding["subjects"][0]["namespace"] = namespace
    sd = f"prometheus-discovery{suffix}"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}},
        binding,
        discovery_role(sd),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": sd},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sd},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
    ]


def host_address() -> str:
    """This machine's first global IPv4 address: EndpointSlices may not name loopback addresses
    (the API server refuses 127.0.0.0/8), and the operator and agents listen on every address."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True, check=False
    ).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    raise PrometheusError("this machine has no global IPv4 address for the metrics EndpointSlices")


def local_endpoint_slice(
    service: dict[str, Any], address: str, endpoints: list[tuple[int, str | None]], name: str
) -> dict[str, Any]:
    """An EndpointSlice of `service` whose endpoints are processes on this machine (`address`, one
    port each, and the node they serve), in place of the pods kube-controller-manager would list:
    one slice per port, since a slice's ports apply to all its endpoints."""
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    ports = sorted({p for p, _ in endpoints})
    if len(ports) != 1:
        raise ValueError("one EndpointSlice per port: pass the endpoints of one port")
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": service["metadata"]["namespace"],
            "labels": {
                "kubernetes.io/service-name": service["metadata"]["name"],
                # not kube-controller-manager's: it leaves slices another manager owns alone
                "endpointslice.kubernetes.io/managed-by": "gpuslice-dev",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port["name"], "port": ports[0], "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [address], "conditions": {"ready": True}, **({"nodeName": node} if node else {})}
            for _, node in endpoints
        ],
    }


def expose_agents(cluster: DevCluster) -> int:
    """The shipped agent metrics Service in gpuslice-system and an EndpointSlice for each agent
    `start_agents(metrics=True)` started on this machine; returns how many."""
    from gpuslice_dev.paths import MANIFESTS

    st = cluster.state()
    ports = {
        k.split("/", 1)[1]: v for k, v in (st.ports if st else {}).items() if k.startswith("agent-metrics/")
    }
    if not ports:
        return 0
    (service,) = [
        d for d in yaml.safe_load_all((MANIFESTS / "base" / "agent" / "service.yaml").read_text()) if d
    ]
    address = host_address()
    slices = [
        local_endpoint_slice(service, address, [(p, node)], f"agent-{node}") for node, p in ports.items()
    ]
    cluster.create_namespace(service["metadata"]["namespace"])
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [service, *slices]}))
    return len(slices)


def start_devcluster_prometheus(cluster: DevCluster, progress: Progress | None = None) -> str:
    """`devcluster up --with-prometheus`: Prometheus as the monitoring component sets it up, on
    loopback, supervised like the control plane. Its account is the shipped binding's subject
    (monitoring/kube-prometheus-stack-prometheus); it scrapes the shipped ServiceMonitor's targets
    in gpuslice-system: the manifests' pods on real nodes (`devcluster deploy`), or any process
    whose EndpointSlice a caller writes (`local_endpoint_slice`). Returns its URL."""
    from gpuslice_dev.paths import MANIFESTS

    binaries = ensure_prometheus(progress)
    st = cluster.state()
    if st is None:
        raise PrometheusError(f"no devcluster in {cluster.dir}; run `gpuslice-dev devcluster up` first")
    monitoring = MANIFESTS / "components" / "monitoring"
    (binding,) = [d for d in yaml.safe_load_all((monitoring / "metrics-reader.yaml").read_text()) if d]
    (role,) = [d for d in yaml.safe_load_all((MANIFESTS / "base" / "metrics-reader.yaml").read_text()) if d]
    namespace = binding["subjects"][0]["namespace"]
    cluster.create_namespace(namespace)
    docs = [role, *scraper_docs(binding, namespace)]
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    account = binding["subjects"][0]["name"]
    workdir = cluster.dir / "prometheus"
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "token"
    token.write_text(
        cluster.kubectl("create", "token", account, "-n", namespace, "--duration=24h").stdout.strip()
    )
    token.chmod(0o600)
    ca = cluster.dir / "pki" / "ca.crt"
    creds = Credentials(st.server, ca, token, {SERVICE_ACCOUNT_TOKEN: token, SERVICE_ACCOUNT_CA: ca})
    sm = load_servicemonitor(monitoring / "servicemonitor.yaml")
    expose_agents(cluster)
    config_file = write_config({"scrape_configs": scrape_configs(sm, creds)}, workdir)
    from gpuslice_dev.devcluster.cluster import free_port

    port = free_port()
    rec = cluster.start_process(
        "prometheus", prometheus_argv(binaries.prometheus, config_file, workdir, port)
    )
    st = cluster.state()
    assert st is not None
    st.ports["prometheus"] = port
    st.save()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, rec.alive, cluster.dir / "logs" / "prometheus.log")
    return url
