"""The shipped ServiceMonitor, translated into Prometheus' own configuration, is one Prometheus
accepts (`promtool check config`), and a field the translation does not know is an error, never
dropped silently."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gpuslice_dev.devcluster import prometheus as prom

SERVICEMONITOR = Path(__file__).resolve().parents[2] / "manifests/components/monitoring/servicemonitor.yaml"


def _creds(tmp_path: Path) -> prom.Credentials:
    for name in ("token", "ca.crt"):
        (tmp_path / name).write_text("x\n")
    return prom.Credentials(
        api_server="https://127.0.0.1:6443",
        api_ca_file=tmp_path / "ca.crt",
        api_token_file=tmp_path / "token",
        files={prom.SERVICE_ACCOUNT_TOKEN: tmp_path / "token", prom.SERVICE_ACCOUNT_CA: tmp_path / "ca.crt"},
    )


def test_the_servicemonitor_becomes_endpointslice_discovery_with_its_selector_port_and_token(
    tmp_path: Path,
) -> None:
    sm = prom.load_servicemonitor(SERVICEMONITOR)
    (config,) = prom.scrape_configs(sm, _creds(tmp_path))
    (sd,) = config["kubernetes_sd_configs"]
    assert sd["role"] == "endpointslice"
    assert sd["namespaces"] == {"names": sm["spec"]["namespaceSelector"]["matchNames"]}
    keeps = [r for r in config["relabel_configs"] if r.get("action") == "keep"]
    assert {
        "source_labels": ["__meta_kubernetes_endpointslice_port_name"],
        "regex": "metrics",
        "action": "keep",
    } in keeps
    assert any(r["source_labels"][0] == "__meta_kubernetes_service_label_gpuslice_io_metrics" for r in keeps)
    assert config["honor_labels"] is True
    assert config["metrics_path"] == "/metrics"
    assert config["authorization"] == {"credentials_file": str(tmp_path / "token")}


def test_promtool_accepts_the_translated_configuration(tmp_path: Path) -> None:
    binaries = prom.ensure_prometheus()
    sm = prom.load_servicemonitor(SERVICEMONITOR)
    config = {"scrape_configs": prom.scrape_configs(sm, _creds(tmp_path))}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [str(binaries.promtool), "check", "config", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("where", "field"),
    [("spec", {"podTargetLabels": ["app"]}), ("endpoint", {"metricRelabelings": []})],
)
def test_a_field_the_translation_does_not_know_is_an_error(
    tmp_path: Path, where: str, field: dict[str, object]
) -> None:
    sm = prom.load_servicemonitor(SERVICEMONITOR)
    (sm["spec"] if where == "spec" else sm["spec"]["endpoints"][0]).update(field)
    with pytest.raises(prom.ServiceMonitorError, match=next(iter(field))):
        prom.scrape_configs(sm, _creds(tmp_path))
