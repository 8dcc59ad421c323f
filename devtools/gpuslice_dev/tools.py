"""Tools the tests and the deploy path need beyond the control plane, from Go modules like the rest.

- The Prometheus Operator's CRDs (ServiceMonitor, PodMonitor) come from its own Go module,
  github.com/prometheus-operator/prometheus-operator, whose `example/prometheus-operator-crd/`
  holds the CRD files it publishes: `go mod download -json` fetches (or finds) the module, and the
  files are copied under `${XDG_CACHE_HOME:-~/.cache}/gpuslice/share/prometheus-operator-<v>/`.
- helm is compiled from helm.sh/helm/v4 into `.../gpuslice/bin/helm-<v>/helm`, like kubectl.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from gpuslice_dev.devcluster.binaries import (
    BuildError,
    Component,
    Progress,
    build_component,
    build_lock,
    cache_root,
    default_progress,
    module_info,
)

PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
#: The kinds gpuslice's monitoring component uses (servicemonitor.yaml, prometheusrule.yaml) or documents.
PROMETHEUS_OPERATOR_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")
HELM_VERSION = "v4.3.2"
HELM = Component(
    "helm",
    "helm.sh/helm/v4",
    HELM_VERSION,
    ("helm.sh/helm/v4/cmd/helm",),
    ldflags=f"-s -w -X helm.sh/helm/v4/internal/version.version={HELM_VERSION}",
)


def prometheus_operator_crds(progress: Progress | None = None) -> list[Path]:
    """The ServiceMonitor and PodMonitor CRD files of the pinned Prometheus Operator release."""
    key = f"prometheus-operator-{PROMETHEUS_OPERATOR_VERSION}"
    out = cache_root() / "share" / key
    files = [out / f"monitoring.coreos.com_{kind}.yaml" for kind in PROMETHEUS_OPERATOR_CRDS]
    if all(f.exists() for f in files):
        return files
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; it fetches the Prometheus Operator's CRDs")
    (progress or default_progress)(f"{PROMETHEUS_OPERATOR_MODULE} {PROMETHEUS_OPERATOR_VERSION}: CRD files")
    with build_lock():
        work = cache_root() / "build" / key
        work.mkdir(parents=True, exist_ok=True)
        # `go mod download` wants a module to run in; this one requires nothing.
        (work / "go.mod").write_text("module gpuslice.local/build/prometheus-crds\n\ngo 1.26.0\n")
        log = work / "download.log"
        info = module_info(PROMETHEUS_OPERATOR_MODULE, PROMETHEUS_OPERATOR_VERSION, work, log)
        source = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for f in files:
            src = source / f.name
            if not src.exists():
                raise BuildError(f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION} has no {src}")
            shutil.copyfile(src, staging / f.name)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return files


def ensure_helm(progress: Progress | None = None) -> Path:
    """helm, built from its Go module on first use (a few minutes on 2 cores), then cached."""
    binary = cache_root() / "bin" / HELM.key / "helm"
    if binary.exists():
        return binary
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.26 to build helm")
    report = progress or default_progress
    with build_lock():
        if not binary.exists():
            started = time.monotonic()
            build_component(HELM, report)
            report(f"helm {HELM_VERSION} built in {time.monotonic() - started:.0f}s")
    return binary
