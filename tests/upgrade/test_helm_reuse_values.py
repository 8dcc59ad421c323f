"""`helm upgrade --reuse-values` from 0.1.0 renders this tree's chart with 0.1.0's values alone: Helm
takes the last release's values and leaves out the new chart's `values.yaml`. Every value added since
0.1.0 is then missing (not null), and the chart must render as it does with that value's default."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from gpuslice_dev.tools import ensure_helm
from upgrade.rig import REPO, release_commit

CHART = REPO / "manifests/helm/gpuslice"


def missing(new: dict[str, Any], old: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of `new`'s keys that `old` lacks (the outermost such key only)."""
    out = []
    for key, value in new.items():
        if key not in old:
            out.append(prefix + key)
        elif isinstance(value, dict) and isinstance(old[key], dict):
            out += missing(value, old[key], f"{prefix}{key}.")
    return out


def render(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(ensure_helm()), "template", "gpuslice", str(CHART), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return sorted(
        (d for d in yaml.safe_load_all(proc.stdout) if d),
        key=lambda d: (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]),
    )


def test_the_chart_renders_with_0_1_0s_values_alone_as_with_the_defaults() -> None:
    proc = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{release_commit()}:manifests/helm/gpuslice/values.yaml"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"this clone lacks release 0.1.0's chart: {proc.stderr.strip()}")
    added = missing(yaml.safe_load((CHART / "values.yaml").read_text()), yaml.safe_load(proc.stdout))
    assert "metrics" in added, added  # what this release added: the test sees it missing
    # `--set k=null` deletes k from the merged values: what --reuse-values gives the new chart
    nulled = [a for k in added for a in ("--set", f"{k}=null")]
    assert render(*nulled) == render()
