"""Build what a real node runs, from Go modules (and one C file), cached like the control plane.

kubelet (k8s.io/kubernetes), containerd with its runc shim and `ctr` (github.com/containerd/containerd/v2),
runc (github.com/opencontainers/runc, with seccomp: needs Debian's libseccomp-dev), the CNI plugins a
bridge network needs (github.com/containernetworking/plugins), crane to write OCI images
(github.com/google/go-containerregistry), crictl (sigs.k8s.io/cri-tools) and the pause binary,
compiled statically from the Kubernetes module's own `build/pause/linux/pause.c`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpuslice_dev.devcluster.binaries import (
    KUBERNETES_VERSION,
    BuildError,
    Component,
    Progress,
    build_component,
    build_lock,
    cache_root,
    default_progress,
    ensure_binaries,
    kubernetes_release,
)

CONTAINERD_VERSION = "v2.4.2"
RUNC_VERSION = "v1.5.3"
CNI_PLUGINS_VERSION = "v1.10.0"
CRANE_VERSION = "v0.22.1"
CRI_TOOLS_VERSION = "v1.37.0"

_CONTAINERD = "github.com/containerd/containerd/v2"
_CNI = "github.com/containernetworking/plugins"

NODE_COMPONENTS: tuple[Component, ...] = (
    Component(
        "containerd",
        _CONTAINERD,
        CONTAINERD_VERSION,
        (
            f"{_CONTAINERD}/cmd/containerd",
            f"{_CONTAINERD}/cmd/containerd-shim-runc-v2",
            f"{_CONTAINERD}/cmd/ctr",
        ),
        ldflags=f"-s -w -X {_CONTAINERD}/version.Version={CONTAINERD_VERSION}",
        # Snapshotters that need their own kernel headers or tools; overlayfs is the one used here.
        tags="no_btrfs,no_zfs,no_devmapper",
    ),
    Component(
        "runc",
        "github.com/opencontainers/runc",
        RUNC_VERSION,
        ("github.com/opencontainers/runc",),
        ldflags=f"-s -w -X main.version={RUNC_VERSION.lstrip('v')}",
        # RuntimeDefault seccomp profiles (Pod Security "restricted") need runc built with seccomp.
        tags="seccomp",
    ),
    Component(
        "cni-plugins",
        _CNI,
        CNI_PLUGINS_VERSION,
        (f"{_CNI}/plugins/main/bridge", f"{_CNI}/plugins/main/loopback", f"{_CNI}/plugins/ipam/host-local"),
    ),
    Component(
        "crane",
        "github.com/google/go-containerregistry",
        CRANE_VERSION,
        ("github.com/google/go-containerregistry/cmd/crane",),
    ),
    # crictl: `down` removes pod sandboxes through CRI, so CNI releases addresses and netns go.
    Component("cri-tools", "sigs.k8s.io/cri-tools", CRI_TOOLS_VERSION, ("sigs.k8s.io/cri-tools/cmd/crictl",)),
)


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    runc: Path
    cni_dir: Path
    crane: Path
    crictl: Path
    pause: Path

    @property
    def bin_dirs(self) -> list[Path]:
        """Directories containerd needs on PATH (it finds its shim and runc there)."""
        return [self.containerd.parent, self.runc.parent]


def _dir(comp: Component) -> Path:
    return cache_root() / "bin" / comp.key


def _paths(release: str) -> NodeBinaries:
    containerd, runc, cni, crane, cri_tools = (_dir(c) for c in NODE_COMPONENTS)
    return NodeBinaries(
        # kubelet is built with the control plane (binaries.components), from the same module and
        # release; the rest (and pause, from the default release's source) is one build for every minor.
        kubelet=cache_root() / "bin" / f"kubernetes-{release}" / "kubelet",
        containerd=containerd / "containerd",
        containerd_shim=containerd / "containerd-shim-runc-v2",
        ctr=containerd / "ctr",
        runc=runc / "runc",
        cni_dir=cni,
        crane=crane / "crane",
        crictl=cri_tools / "crictl",
        pause=cache_root() / "bin" / f"pause-{KUBERNETES_VERSION}" / "pause",
    )


def _complete(comp: Component) -> bool:
    return all((_dir(comp) / n).exists() for n in comp.binary_names())


def cached_node_binaries(kubernetes: str | None = None) -> NodeBinaries | None:
    paths = _paths(kubernetes_release(kubernetes))
    if all(_complete(c) for c in NODE_COMPONENTS) and paths.pause.exists() and paths.kubelet.exists():
        return paths
    return None


def _build_pause(out: Path, progress: Progress) -> None:
    """pause.c from the Kubernetes module itself, static, as the pause image ships it."""
    work = cache_root() / "build" / f"pause-{KUBERNETES_VERSION}"
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        cwd=work, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BuildError(
            f"downloading k8s.io/kubernetes {KUBERNETES_VERSION} for pause.c failed:\n{proc.stderr}"
        )
    source = Path(json.loads(proc.stdout)["Dir"]) / "build" / "pause" / "linux" / "pause.c"
    progress(f"compiling pause from {source}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name("pause.partial")
    cc = subprocess.run(
        ["gcc", "-Os", "-Wall", "-static", f"-DVERSION={KUBERNETES_VERSION}", "-o", str(partial),
         str(source)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if cc.returncode != 0:
        raise BuildError(f"compiling {source} failed (is libc6-dev installed?):\n{cc.stderr}")
    partial.rename(out)


def ensure_node_binaries(progress: Progress | None = None, kubernetes: str | None = None) -> NodeBinaries:
    """The cached node binaries (the kubelet of Kubernetes minor `kubernetes`, see
    `binaries.kubernetes_release`), building whichever is missing (tens of minutes the first time)."""
    report = progress or default_progress
    release = kubernetes_release(kubernetes)
    found = cached_node_binaries(release)
    if found:
        return found
    if shutil.which("go") is None:
        raise BuildError("the `go` command is not on PATH; install Go >= 1.26 to build the node binaries")
    if not _paths(release).kubelet.exists():
        ensure_binaries(report, release)
    with build_lock():
        started = time.monotonic()
        for comp in NODE_COMPONENTS:
            if not _complete(comp):
                build_component(comp, report)
        paths = _paths(release)
        if not paths.pause.exists():
            _build_pause(paths.pause, report)
        report(f"node binaries ready in {time.monotonic() - started:.0f}s under {cache_root() / 'bin'}")
    found = cached_node_binaries(release)
    if found is None:
        raise BuildError(f"build finished but node binaries are missing under {cache_root() / 'bin'}")
    return found
