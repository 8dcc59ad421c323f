"""The monitoring component's PrometheusRule: Prometheus accepts its rules (`promtool check rules`),
each alert fires on the series it should and stays silent on the others (`promtool test rules`,
tests/monitoring/alerts_test.yaml), and each has a runbook in the README."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from gpuslice_dev.devcluster import prometheus as prom

REPO = Path(__file__).resolve().parents[2]
RULE = REPO / "manifests/components/monitoring/prometheusrule.yaml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")


def rule_groups() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(RULE.read_text()) if d]
    assert doc["kind"] == "PrometheusRule"
    return {"groups": doc["spec"]["groups"]}


def alert_names() -> list[str]:
    return [r["alert"] for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r]


def _promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    shutil.copyfile(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    tool = prom.ensure_prometheus().promtool
    return subprocess.run([str(tool), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    out = _promtool(tmp_path, "check", "rules", "rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_each_alert_fires_when_it_should_and_stays_silent_otherwise(tmp_path: Path) -> None:
    out = _promtool(tmp_path, "test", "rules", UNIT_TESTS.name)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    silent = {a["alertname"] for t in tests for a in t["alert_rule_test"] if not a["exp_alerts"]}
    assert set(alert_names()) == fired == silent


def test_every_alert_has_a_runbook_line_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    for name in alert_names():
        assert f"| `{name}` |" in readme, f"README has no runbook row for {name}"
