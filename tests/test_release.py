"""A release has one number: the product package's, and everything that names a version follows it."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client import generate_latest

import gpuslice
from gpuslice import metrics

REPO = Path(__file__).resolve().parents[1]
VERSION = gpuslice.__version__
#: The first release: the last commit of main that CI landed before releases were numbered here.
FIRST_RELEASE = ("0.1.0", "4ff7adc9020e534cac8e7a17758cdd38992dd65f")


def test_the_version_is_a_semantic_version_and_the_installed_metadata_reads_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert importlib.metadata.version("gpuslice") == VERSION
    assert importlib.metadata.version("gpuslice-dev") == VERSION


def test_the_cli_prints_the_version():
    out = subprocess.run(
        [sys.executable, "-m", "gpuslice", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["gpuslice", VERSION]


def test_the_chart_and_every_image_reference_carry_the_version():
    chart = yaml.safe_load((REPO / "manifests/helm/gpuslice/Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    refs = {
        str(p.relative_to(REPO)): re.findall(r"ghcr\.io/gpuslice/gpuslice:([\w.-]+)", p.read_text())
        for p in [*REPO.glob("manifests/**/*.yaml"), REPO / "Dockerfile", REPO / "README.md"]
    }
    stale = {name: tags for name, tags in refs.items() if tags and set(tags) != {VERSION}}
    assert not stale, f"image tags that are not {VERSION}: {stale}"
    assert sum(len(t) for t in refs.values()) >= 3  # the operator, the agent and its init container
    values = (REPO / "manifests/helm/gpuslice/values.yaml").read_text()
    assert f"# base: {VERSION}" in values


def test_the_changelog_has_this_version_and_names_the_first_releases_commit():
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(VERSION)}\]", changelog, re.M), "no section for this version"
    version, commit = FIRST_RELEASE
    assert re.search(rf"^## \[{re.escape(version)}\].*{commit}", changelog, re.M | re.S)
    # A clone without tags still finds the first release by its commit (the upgrade path starts there).
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-t", commit], capture_output=True, text=True)
    assert found.stdout.strip() == "commit", f"release {version}'s commit {commit} is not in this clone"


def test_both_processes_export_build_info_with_the_version():
    for gauge, registry, component in (
        (metrics.OPERATOR_BUILD_INFO, metrics.OPERATOR_REGISTRY, "operator"),
        (metrics.AGENT_BUILD_INFO, metrics.AGENT_REGISTRY, "agent"),
    ):
        gauge.labels(*metrics.build_info_labels(component)).set(1)
        text = generate_latest(registry).decode()
        line = next(x for x in text.splitlines() if x.startswith("gpuslice_build_info{"))
        assert f'component="{component}"' in line and f'version="{VERSION}"' in line and line.endswith(" 1.0")
