"""The Helm chart renders the kustomize base's own objects (one source of truth: it reads the files the
kustomizations list, linked under files/ and crds/), changed only where values say so."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.tools import ensure_helm

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "manifests/helm/gpuslice"
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm()


def template(helm: Path, *args: str) -> list[Doc]:
    proc = subprocess.run(
        [str(helm), "template", "gpuslice", str(CHART), "--include-crds", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_key(docs: list[Doc]) -> dict[tuple[str, str, str], Doc]:
    out = {}
    for d in docs:
        key = (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = d
    return out


def test_helm_lint_passes(helm: Path) -> None:
    proc = subprocess.run([str(helm), "lint", str(CHART)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_values_render_exactly_the_kustomize_base(helm: Path, base: list[Doc]) -> None:
    assert by_key(template(helm)) == by_key(base)


def test_monitoring_on_renders_exactly_the_monitoring_overlay(helm: Path, with_monitoring: list[Doc]) -> None:
    assert by_key(template(helm, "--set", "monitoring.enabled=true")) == by_key(with_monitoring)


METRICS_SERVER_NAME = "gpuslice-metrics.gpuslice-system.svc"


def test_metrics_tls_on_renders_the_monitoring_tls_overlay_and_a_self_signed_secret(
    helm: Path, renderer: Callable[[Path], list[Doc]]
) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    rendered = by_key(template(helm, "--set", "monitoring.enabled=true,metrics.tls.enabled=true"))
    secret = rendered.pop(("Secret", "gpuslice-system", "gpuslice-metrics-tls"))
    assert rendered == by_key(renderer(REPO / "manifests/overlays/monitoring-tls"))
    # The Secret the pods mount and the ServiceMonitor trusts: a serving certificate for the name it
    # checks, signed by its ca.crt, with its own key.
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    cert, ca = (x509.load_pem_x509_certificate(data[k]) for k in ("tls.crt", "ca.crt"))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [METRICS_SERVER_NAME]
    cert.verify_directly_issued_by(ca)
    key = serialization.load_pem_private_key(data["tls.key"], password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]


def test_metrics_tls_with_a_secret_of_ones_own_renders_no_secret(helm: Path) -> None:
    rendered = template(helm, "--set", "metrics.tls.enabled=true,metrics.tls.selfSigned=false")
    assert not [d for d in rendered if d["kind"] == "Secret"]
    (agent,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    assert (
        "--metrics-tls-cert-file=/etc/gpuslice/metrics-tls/tls.crt"
        in agent["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_values_change_only_what_they_name(helm: Path, base: list[Doc]) -> None:
    values = {
        "image": {"repository": "registry.example.com/gpuslice", "tag": "0.1.1", "pullPolicy": "Always"},
        "operator": {"replicas": 3},
        "agent": {
            "nodeSelector": {"gpu": "v100"},
            "tolerations": [],
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 3}},
        },
        "podSecurity": {"enforce": "baseline"},
    }
    rendered = by_key(template(helm, "--set-json", f"image={json.dumps(values['image'])}",
                               "--set-json", f"operator={json.dumps(values['operator'])}",
                               "--set-json", f"agent={json.dumps(values['agent'])}",
                               "--set", "podSecurity.enforce=baseline"))  # fmt: skip
    expected = by_key(copy.deepcopy(base))
    ns = expected[("Namespace", "", "gpuslice-system")]
    ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] = "baseline"
    deploy = expected[("Deployment", "gpuslice-system", "gpuslice-operator")]
    deploy["spec"]["replicas"] = 3
    ds = expected[("DaemonSet", "gpuslice-system", "gpuslice-agent")]
    ds["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "v100"}
    ds["spec"]["template"]["spec"]["tolerations"] = []
    ds["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 3}}
    for workload in (deploy, ds):
        pod = workload["spec"]["template"]["spec"]
        for ctr in [*pod.get("initContainers", []), *pod["containers"]]:
            ctr["image"] = "registry.example.com/gpuslice:0.1.1"
            ctr["imagePullPolicy"] = "Always"
    assert rendered == expected


CATALOG = [
    {
        "name": "v100-8g",
        "displayName": "V100 25% (8 GiB)",
        "gpuModel": "Tesla V100-PCIE-32GB",
        "fraction": 25,
        "entitlements": [
            {"namespaceSelector": {"matchLabels": {"tenant.example.com/project": "a"}}, "slices": 2}
        ],
    },
    {"name": "v100-32g", "gpuModel": "Tesla V100-PCIE-32GB", "fraction": 100},
]


def test_catalog_values_become_gpupackages(helm: Path, base: list[Doc]) -> None:
    rendered = template(helm, "--set-json", f"catalog={json.dumps(CATALOG)}")
    packages = [d for d in rendered if d["kind"] == "GpuPackage"]
    assert [p["metadata"]["name"] for p in packages] == ["v100-8g", "v100-32g"]
    assert packages[0]["spec"] == {k: v for k, v in CATALOG[0].items() if k != "name"}
    assert len(rendered) == len(base) + 2


@pytest.mark.cluster
def test_catalog_gpupackages_pass_the_api_servers_validation(helm: Path, cluster: DevCluster) -> None:
    cluster.apply_crds()
    packages = [
        d for d in template(helm, "--set-json", f"catalog={json.dumps(CATALOG)}") if d["kind"] == "GpuPackage"
    ]
    proc = cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "-f",
        "-",
        input=yaml.safe_dump_all(packages),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    bad = [{**packages[1], "spec": {**packages[1]["spec"], "fraction": 0}}]
    proc = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(bad), check=False
    )
    assert proc.returncode != 0 and "spec.fraction" in proc.stderr


@pytest.mark.cluster
def test_helm_install_and_uninstall_on_a_devcluster_of_its_own(
    helm: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A control plane of its own: the install owns gpuslice-system, which the shared one's tests use.
    # Its nodes are kwok's, so the pods are accepted, scheduled and shown Running, not really run.
    dc = DevCluster(tmp_path_factory.mktemp("helm"))
    try:
        dc.up(nodes=1, crds=False)  # the chart installs them
        dc.kubectl("label", "node", dc.nodes[0], "nvidia.com/gpu.present=true")
        # What the GPU Operator creates on a real cluster; the agent's pods name it.
        dc.apply(
            '{"apiVersion":"node.k8s.io/v1","kind":"RuntimeClass","metadata":{"name":"nvidia"},"handler":"nvidia"}'
        )
        catalog = json.dumps(CATALOG[1:])
        proc = subprocess.run(
            [str(helm), "install", "gpuslice", str(CHART), f"--kubeconfig={dc.kubeconfig}", "--wait=watcher",
             "--timeout=90s", "--set-json", f"catalog={catalog}"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "STATUS: deployed" in proc.stdout
        for crd in (
            "gpupackages.gpuslice.io",
            "gpuslices.gpuslice.io",
            "gpuusages.gpuslice.io",
            "clusterkopfpeerings.kopf.dev",
        ):
            dc.kubectl("get", "crd", crd)
        deploy = json.loads(
            dc.kubectl("get", "deploy", "gpuslice-operator", "-n", "gpuslice-system", "-o", "json").stdout
        )
        assert deploy["spec"]["replicas"] == 2
        assert (
            json.loads(dc.kubectl("get", "gpupackage", "v100-32g", "-o", "json").stdout)["spec"]["fraction"]
            == 100
        )
        proc = subprocess.run(
            [str(helm), "uninstall", "gpuslice", f"--kubeconfig={dc.kubeconfig}", "--wait", "--timeout=120s"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        left = dc.kubectl(
            "get", "clusterroles", "-l", "app.kubernetes.io/part-of=gpuslice", "-o", "name"
        ).stdout
        assert left == ""
    finally:
        dc.down()
