"""The monitoring component: the Grafana dashboard queries only what the catalogue exports, and the
ServiceMonitor really scrapes the operator and agent Services."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpuslice import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "manifests/components/monitoring/dashboard.json"
METRIC = re.compile(r"\b(gpuslice_[a-z_]+)\b")
SELECTOR = re.compile(r"\b(gpuslice_[a-z_]+)\{([^}]*)\}")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
PROMQL_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def catalogue() -> dict[str, tuple[str, ...]]:
    """Every sample name either process can export -> its label names (histogram `le` included)."""
    names: dict[str, tuple[str, ...]] = {}
    for registry in (metrics.OPERATOR_REGISTRY, metrics.AGENT_REGISTRY):
        for collector in registry._collector_to_names:
            labels = tuple(getattr(collector, "_labelnames", ()))
            for fam in collector.describe() if hasattr(collector, "describe") else []:
                if not fam.name.startswith("gpuslice_"):
                    continue
                if fam.type == "counter":
                    names[f"{fam.name}_total"] = labels
                elif fam.type == "histogram":
                    names[f"{fam.name}_bucket"] = (*labels, "le")
                    names[f"{fam.name}_sum"] = labels
                    names[f"{fam.name}_count"] = labels
                else:
                    names[fam.name] = labels
    return names


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in dashboard["panels"] for t in p.get("targets", [])]


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_query_uses_catalogued_metrics_and_their_labels():
    known = catalogue()
    for title, target in targets(load()):
        expr = target["expr"]
        used = set(METRIC.findall(expr))
        assert used, f"panel {title!r} queries no gpuslice metric: {expr}"
        unknown = used - known.keys()
        assert not unknown, f"panel {title!r} queries {unknown}, which gpuslice.metrics does not export"
        labels = set().union(*(known[m] for m in used))
        for metric, matchers in SELECTOR.findall(expr):
            for matcher in filter(None, (m.strip() for m in matchers.split(","))):
                name = re.split(r"[=!~]", matcher, maxsplit=1)[0].strip()
                assert name in known[metric], f"panel {title!r}: {metric} has no label {name!r}"
        for grouping in PROMQL_GROUPING.findall(expr):
            for name in filter(None, (g.strip() for g in grouping.split(","))):
                assert name in labels, f"panel {title!r} groups by {name!r}, which {used} do not carry"
        for name in LEGEND_LABEL.findall(target.get("legendFormat", "")):
            assert name in labels, f"panel {title!r} shows {{{{{name}}}}}, which {used} do not carry"


def test_dashboard_covers_the_whole_catalogue_with_occupancy_and_per_slice_panels():
    queried = {m for _, t in targets(load()) for m in METRIC.findall(t["expr"])}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in catalogue()}
    missing = {f for f in families if not any(q == f or q.startswith(f + "_") for q in queried)}
    assert not missing, f"metrics with no panel: {missing}"
    titles = [p["title"] for p in load()["panels"]]
    assert any("per GPU" in t for t in titles)
    assert any(t.startswith("Slice") for t in titles)


PRODUCT = Path(metrics.__file__).resolve().parent


def _setters() -> dict[str, str]:
    """Sample name -> the gpuslice.metrics attribute of its collector."""
    out: dict[str, str] = {}
    for attr, value in vars(metrics).items():
        for fam in value.describe() if hasattr(value, "describe") and hasattr(value, "_labelnames") else []:
            for suffix in ("", "_total", "_bucket", "_count", "_sum"):
                out[fam.name + suffix] = attr
    return out


def test_every_metric_on_the_dashboard_is_set_by_the_product():
    # Declared in the catalogue is not enough: a series nothing sets is an empty panel.
    sources = "\n".join(
        p.read_text() for p in PRODUCT.rglob("*.py") if p.name != "metrics.py" and "dev" not in p.parts
    )
    setters = _setters()
    unset = set()
    for _title, target in targets(load()):
        for name in METRIC.findall(target["expr"]):
            attr = setters[name]
            setter = rf"\b{attr}\.(labels|set|inc|observe|time)\b|CounterFromTotal\((metrics\.)?{attr}\b"
            if not re.search(setter, sources):
                unset.add(f"{name} ({attr})")
    assert not unset, f"the dashboard queries series the product never sets: {sorted(unset)}"


def test_template_variables_read_labels_that_exist():
    known = catalogue()
    for var in load()["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((gpuslice_[a-z_]+),\s*([a-z_]+)\)", var["query"]["query"])
        assert match, f"variable {var['name']}: unexpected query {var['query']}"
        metric, label = match.groups()
        assert label in known[metric], f"variable {var['name']}: {metric} has no label {label}"


def test_panel_ids_are_unique():
    ids = [p["id"] for p in load()["panels"]]
    assert len(ids) == len(set(ids))


def _one(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar(with_monitoring):
    (cm,) = _one(with_monitoring, "ConfigMap")
    assert cm["metadata"]["name"] == "gpuslice-grafana-dashboard"
    assert cm["metadata"]["namespace"] == "gpuslice-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["gpuslice.json"]) == load()


def test_servicemonitor_scrapes_the_operator_and_every_agent(with_monitoring):
    (sm,) = _one(with_monitoring, "ServiceMonitor")
    spec = sm["spec"]
    services = [
        s
        for s in _one(with_monitoring, "Service")
        if s["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
        and spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    selected = {s["metadata"]["name"] for s in services}
    assert selected == {"gpuslice-operator-metrics", "gpuslice-agent-metrics"}
    endpoint_ports = {e["port"] for e in spec["endpoints"]}
    for svc in services:
        assert endpoint_ports <= {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]
        workload = next(
            d
            for d in with_monitoring
            if d["kind"] in ("Deployment", "DaemonSet")
            and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        )
        container_ports = {
            p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
        }
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    # Slice series carry the tenant's `namespace`; only honorLabels keeps it from being overwritten.
    assert "namespace" in metrics.SLICE_LABELS
    assert all(e.get("honorLabels") is True for e in spec["endpoints"])


def test_the_base_alone_has_no_prometheus_operator_kinds(base):
    assert not [d for d in base if d["apiVersion"].startswith("monitoring.coreos.com/")]


def test_prometheus_sends_its_token_and_is_bound_to_the_metrics_reader_role(with_monitoring):
    # Both processes answer /metrics only to a bearer token the API server allows GET /metrics.
    (sm,) = _one(with_monitoring, "ServiceMonitor")
    token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert [e.get("bearerTokenFile") for e in sm["spec"]["endpoints"]] == [token] * len(
        sm["spec"]["endpoints"]
    )
    (binding,) = [
        b
        for b in _one(with_monitoring, "ClusterRoleBinding")
        if b["roleRef"]["name"] == "gpuslice-metrics-reader"
    ]
    assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]
    (role,) = [
        r for r in _one(with_monitoring, "ClusterRole") if r["metadata"]["name"] == "gpuslice-metrics-reader"
    ]
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
