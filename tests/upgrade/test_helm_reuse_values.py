"""The README's Helm upgrade from 0.1.0.

`helm upgrade --reuse-values` renders this tree's chart with 0.1.0's values alone: Helm takes the last
release's values and leaves out the new chart's `values.yaml`. Every value added since 0.1.0 is then
missing (not null), and the chart must render as it does with that value's default."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
import yaml

import gpuslice
from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.tools import ensure_helm
from upgrade.rig import REPO, release_commit

CHART = REPO / "manifests/helm/gpuslice"
README = REPO / "README.md"


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


#: the README's CRD step of an upgrade (Helm does not upgrade a chart's crds/)
CRD_STEP = "kubectl apply --server-side --force-conflicts -f crds/"


@pytest.mark.cluster
def test_helm_upgrade_from_0_1_0_the_readme_way_on_a_control_plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """0.1.0's chart installed (Helm applies its CRDs server-side, as field manager `helm`), then the
    README's upgrade: the CRDs by kubectl, `helm upgrade --reuse-values`, `helm rollback`. No node:
    the real-node test (test_upgrade_helm_real_node.py) runs the pods; this one the commands."""
    assert CRD_STEP in " ".join(README.read_text().split()), "README's upgrade step changed"
    old = tmp_path_factory.mktemp("release")
    subprocess.run(
        f"git -C '{REPO}' archive {release_commit()} | tar -x -C '{old}'", shell=True, check=True, timeout=120
    )
    c = DevCluster(tmp_path_factory.mktemp("helm-upgrade"))
    env = {**os.environ, "KUBECONFIG": str(c.kubeconfig), "HELM_CONFIG_HOME": str(c.dir / "helm")}

    def helm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ensure_helm()), *args], env=env, capture_output=True, text=True, timeout=180, check=False
        )

    def served() -> list[str]:
        crd = json.loads(c.kubectl("get", "crd", "gpuslices.gpuslice.io", "-o", "json").stdout)
        return [v["name"] for v in crd["spec"]["versions"] if v.get("served")]

    try:
        c.up(nodes=0, crds=False)
        proc = helm("install", "gpuslice", str(old / "manifests/helm/gpuslice"))
        assert proc.returncode == 0, proc.stderr
        assert served() == ["v1alpha1"]
        # without --force-conflicts kubectl may not take over .spec.versions from Helm's apply
        plain = c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"), check=False)
        assert plain.returncode != 0 and 'conflict with "helm"' in plain.stderr, plain.stderr
        c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        assert served() == ["v1alpha1", "v1beta1"]
        proc = helm("upgrade", "gpuslice", str(CHART), "--reuse-values")
        assert proc.returncode == 0, proc.stderr
        assert "STATUS: deployed" in proc.stdout
        proc = helm("rollback", "gpuslice", "1")
        assert proc.returncode == 0, proc.stderr
        history = json.loads(helm("history", "gpuslice", "-o", "json").stdout)
        assert [(h["app_version"], h["status"]) for h in history] == [
            ("0.1.0", "superseded"),
            (gpuslice.__version__, "superseded"),
            ("0.1.0", "deployed"),
        ], history
        assert served() == ["v1alpha1", "v1beta1"]  # Helm leaves the CRDs on rollback
    finally:
        c.down()
