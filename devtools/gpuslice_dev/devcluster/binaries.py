"""Build the control-plane binaries from their Go modules and cache them, keyed by version.

Nothing is downloaded but Go modules: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kubectl and kwok are compiled from `go.etcd.io/etcd/server/v3`, `k8s.io/kubernetes` and
`sigs.k8s.io/kwok`. Only the first run builds (tens of minutes on 2 cores); later runs find the
binaries under `${XDG_CACHE_HOME:-~/.cache}/gpuslice/bin/<component>-<version>/`.

The Kubernetes minor is chosen per call (`--kubernetes 1.36`) or by $GPUSLICE_KUBERNETES (what
`make test KUBERNETES=1.36` sets); each minor's patch release has its own cache folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: The supported minors and the patch release of each the devcluster builds (Go module proxy tags).
KUBERNETES_RELEASES: dict[str, str] = {"1.35": "v1.35.4", "1.36": "v1.36.3", "1.37": "v1.37.2"}
DEFAULT_KUBERNETES = "1.37"
#: The environment variable that picks the minor when no caller names one (the test suite's switch).
KUBERNETES_ENV = "GPUSLICE_KUBERNETES"
KUBERNETES_VERSION = KUBERNETES_RELEASES[DEFAULT_KUBERNETES]
#: Feature gates on top of the minor's own (e.g. a 1.35 platform that turned its alpha DRA gates on).
FEATURE_GATES_ENV = "GPUSLICE_FEATURE_GATES"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
#: Go directive of the generated build modules; the machine's Go must be at least this.
GO_DIRECTIVE = "1.26.0"

KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)


class BuildError(RuntimeError):
    """A component failed to build; the message names the module and the log file."""


@dataclass(frozen=True)
class Component:
    name: str  # cache folder prefix
    module: str  # Go module required by the build module
    version: str
    packages: tuple[str, ...]  # main packages to build, binary name = last path element
    ldflags: str = "-s -w"
    tags: str = ""  # Go build tags (e.g. "seccomp" for runc)

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    def binary_names(self) -> list[str]:
        return [p.rsplit("/", 1)[-1] if not p.endswith("/v3") else "etcd" for p in self.packages]


def k8s_ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return (
        f"-s -w -X {pkg}.gitVersion={version} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor}"
        f" -X {pkg}.gitTreeState=clean -X {pkg}.buildDate=1970-01-01T00:00:00Z"
    )


def kubernetes_release(wanted: str | None = None) -> str:
    """The patch release (v1.X.Y) for a minor ("1.36", "v1.36" or its exact release); None: the minor
    in $GPUSLICE_KUBERNETES, else the default. Anything else is an error that lists the choices."""
    raw = (wanted or os.environ.get(KUBERNETES_ENV) or DEFAULT_KUBERNETES).strip().lstrip("v")
    minor = ".".join(raw.split(".")[:2])
    release = KUBERNETES_RELEASES.get(minor)
    if release is None or raw not in (minor, release.lstrip("v")):
        source = "" if wanted else f" (from ${KUBERNETES_ENV})"
        choices = ", ".join(f"{k} ({v})" for k, v in KUBERNETES_RELEASES.items())
        raise BuildError(
            f"Kubernetes {raw!r}{source} is not one the devcluster builds; choose one of {choices}"
        )
    return release


def minor_of(release: str) -> str:
    """ "v1.36.3" -> "1.36"."""
    return ".".join(release.lstrip("v").split(".")[:2])


def kubernetes_component(release: str) -> Component:
    return Component(
        "kubernetes",
        "k8s.io/kubernetes",
        release,
        (
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubectl",
            # The real nodes' kubelet comes from the same module: one build compiles what they share.
            "k8s.io/kubernetes/cmd/kubelet",
        ),
        ldflags=k8s_ldflags(release),
    )


ETCD = Component("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION, ("go.etcd.io/etcd/server/v3",))
KWOK = Component("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, ("sigs.k8s.io/kwok/cmd/kwok",))


def components(release: str) -> tuple[Component, ...]:
    """What the control plane of Kubernetes `release` is built from (etcd and kwok: one each)."""
    return (ETCD, kubernetes_component(release), KWOK)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuslice"


@dataclass(frozen=True)
class Binaries:
    #: the Kubernetes release (v1.X.Y) kube-apiserver, kube-controller-manager, ... come from
    kubernetes: str
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    kwok_stages: Path


def _paths(release: str) -> Binaries:
    root = cache_root() / "bin"
    k8s = root / f"kubernetes-{release}"
    kwok = root / f"kwok-{KWOK_VERSION}"
    return Binaries(
        kubernetes=release,
        etcd=root / f"etcd-{ETCD_VERSION}" / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        kwok=kwok / "kwok",
        kwok_stages=kwok / "stages.yaml",
    )


def cached(kubernetes: str | None = None) -> Binaries | None:
    """The cached binaries of Kubernetes minor `kubernetes` (see `kubernetes_release`), or None when
    any is missing."""
    paths = _paths(kubernetes_release(kubernetes))
    if all(p.exists() for p in vars(paths).values() if isinstance(p, Path)):
        return paths
    return None


def staging_replaces(kubernetes_gomod: str, version: str) -> list[str]:
    """`replace` lines pinning every staging module of k8s.io/kubernetes to its published v0.X.Y.

    k8s.io/kubernetes points its staging modules at `./staging/...`, which does not exist in the
    module download, so a consumer must replace each one; the list comes from its own go.mod.
    """
    _major, minor, patch = version.lstrip("v").split(".")
    staged = f"v0.{minor}.{patch}"
    names = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", kubernetes_gomod, flags=re.MULTILINE)
    if not names:
        raise BuildError(f"k8s.io/kubernetes {version}: go.mod lists no staging modules; cannot build it")
    return [f"replace {name} => {name} {staged}" for name in sorted(set(names))]


Progress = Callable[[str], None]


def default_progress(msg: str) -> None:
    print(f"[devcluster build] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def _run_logged(cmd: list[str], cwd: Path, log: Path, what: str, module: str) -> None:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.call(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=_go_env())
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(
            f"building {what} from Go module {module} failed (exit {rc}); full log: {log}\n"
            + "\n".join(f"    {line}" for line in tail)
        )


@contextmanager
def build_lock() -> Iterator[None]:
    # Several test sessions may start at once on one machine: only one builds, the others wait.
    lock_path = cache_root() / "build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def module_info(module: str, version: str, cwd: Path, log: Path) -> dict[str, str]:
    cmd = ["go", "mod", "download", "-json", f"{module}@{version}"]
    with log.open("a") as fh:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=_go_env())
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise BuildError(f"downloading Go module {module}@{version} failed; log: {log}\n{proc.stderr[-800:]}")
    info: dict[str, str] = json.loads(proc.stdout)
    return info


def build_component(comp: Component, progress: Progress) -> None:
    work = cache_root() / "build" / comp.key
    work.mkdir(parents=True, exist_ok=True)
    log = cache_root() / "build" / f"{comp.key}.log"
    log.write_text(f"gpuslice-dev devcluster build of {comp.module} {comp.version}\n")
    gomod = [f"module gpuslice.local/build/{comp.name}", "", f"go {GO_DIRECTIVE}", ""]
    gomod.append(f"require {comp.module} {comp.version}")
    (work / "go.mod").write_text("\n".join(gomod) + "\n")
    (work / "go.sum").unlink(missing_ok=True)
    info = module_info(comp.module, comp.version, work, log)
    if comp.module == "k8s.io/kubernetes":
        replaces = staging_replaces(Path(info["GoMod"]).read_text(), comp.version)
        with (work / "go.mod").open("a") as fh:
            fh.write("\n" + "\n".join(replaces) + "\n")
    imports = "\n".join(f'\t_ "{p}"' for p in comp.packages)
    (work / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    progress(f"{comp.module} {comp.version}: resolving dependencies (log: {log})")
    _run_logged(["go", "mod", "tidy"], work, log, comp.name, comp.module)

    out = cache_root() / "bin" / comp.key
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # One `go build` for all of a module's binaries: the shared packages compile once, in parallel
    # across packages, and the links overlap (separate builds serialised them).
    started = time.monotonic()
    names = comp.binary_names()
    progress(f"compiling {', '.join(names)} from {comp.module} {comp.version} ...")
    tags = ["-tags", comp.tags] if comp.tags else []
    target = str(staging / names[0]) if len(comp.packages) == 1 else str(staging) + "/"
    cmd = ["go", "build", *tags, "-ldflags", comp.ldflags, "-o", target, *comp.packages]
    _run_logged(cmd, work, log, ", ".join(names), comp.module)
    progress(f"compiled {', '.join(names)} in {time.monotonic() - started:.0f}s")
    if comp.name == "kwok":
        moddir = Path(info["Dir"])
        stages = "\n---\n".join((moddir / f).read_text().strip() for f in KWOK_STAGE_FILES)
        (staging / "stages.yaml").write_text(stages + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def ensure_binaries(progress: Progress | None = None, kubernetes: str | None = None) -> Binaries:
    """Return the cached binaries of Kubernetes minor `kubernetes` (None: $GPUSLICE_KUBERNETES, else
    the default), building whichever component is missing."""
    report = progress or default_progress
    release = kubernetes_release(kubernetes)
    found = cached(release)
    if found:
        return found
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.26 to build the control plane")
    with build_lock():
        started = time.monotonic()
        paths = _paths(release)
        for comp in components(release):
            out = cache_root() / "bin" / comp.key
            if all((out / n).exists() for n in comp.binary_names()) and (
                comp.name != "kwok" or paths.kwok_stages.exists()
            ):
                continue
            build_component(comp, report)
        report(
            f"control plane binaries ready in {time.monotonic() - started:.0f}s under {cache_root() / 'bin'}"
        )
    found = cached(release)
    if found is None:
        raise BuildError(f"build finished but binaries are missing under {cache_root() / 'bin'}")
    return found
