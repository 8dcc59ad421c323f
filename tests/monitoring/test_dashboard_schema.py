"""The Grafana dashboard against Grafana's own schema, through the Grafana Foundation SDK's models
(grafana-foundation-sdk, generated from Grafana's schemas; Apache-2.0): every field is one the
schema knows (decoding and encoding it again loses or changes nothing), every panel is a known
panel plugin whose options decode, every query is a Prometheus query on the `datasource`
variable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.runtime import Runtime
from grafana_foundation_sdk.models import prometheus
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

DASHBOARD = Path(__file__).resolve().parents[2] / "manifests/components/monitoring/dashboard.json"
plugins.register_default_plugins()


def _lost(before: Any, after: Any, path: str = "") -> list[str]:
    """What `after` (the model's encoding) dropped or changed of `before` (the file)."""
    if isinstance(before, dict):
        if not isinstance(after, dict):
            return [f"{path}: {before!r} became {after!r}"]
        out = []
        for key, value in before.items():
            if key not in after:
                out.append(f"{path}/{key}: not in Grafana's schema")
            else:
                out += _lost(value, after[key], f"{path}/{key}")
        return out
    if isinstance(before, list):
        if not isinstance(after, list) or len(after) != len(before):
            return [f"{path}: list changed"]
        return [
            line
            for i, (a, b) in enumerate(zip(before, after, strict=True))
            for line in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if before == after else [f"{path}: {before!r} became {after!r}"]


def _model() -> tuple[dict[str, Any], Dashboard]:
    raw = json.loads(DASHBOARD.read_text())
    return raw, Dashboard.from_json(raw)


def test_every_field_is_in_grafanas_dashboard_schema() -> None:
    raw, model = _model()
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    assert _lost(raw, again) == []


def test_every_panel_is_a_known_plugin_and_every_query_a_prometheus_one_on_the_variable() -> None:
    _, model = _model()
    known = set(Runtime().panelcfg_variants)
    panels = [p for p in model.panels or [] if isinstance(p, Panel)]
    assert panels and len(panels) + sum(isinstance(p, RowPanel) for p in model.panels or []) == len(
        model.panels or []
    )
    for panel in panels:
        assert panel.type_val in known, f"{panel.title}: panel type {panel.type_val!r} is no Grafana panel"
        assert panel.datasource is not None and panel.datasource.uid == "${datasource}", panel.title
        for target in panel.targets or []:
            assert isinstance(target, prometheus.Dataquery), f"{panel.title}: not a Prometheus query"
            assert target.expr, f"{panel.title}: empty expression"
    variables = {v.name: v for v in (model.templating.list_val or [])} if model.templating else {}
    assert variables["datasource"].type_val == "datasource" and variables["datasource"].query == "prometheus"
