"""kubectl against the devcluster: the one client the dev tooling and the tests use."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from gpuslice_dev.devcluster.binaries import Binaries
from gpuslice_dev.devcluster.supervisor import DevClusterError
from gpuslice_dev.paths import CRD_DIR

#: gpuslice's CRDs in a source checkout


class KubectlClient:
    """kubectl with the cluster's admin kubeconfig (or another user's); a mixin of DevCluster."""

    @property
    def bins(self) -> Binaries:  # the cluster's binaries (DevCluster builds them on first use)
        raise NotImplementedError

    @property
    def kubeconfig(self) -> Path:  # the admin kubeconfig
        raise NotImplementedError

    def kubectl_argv(self, *args: str, kubeconfig: Path | None = None) -> list[str]:
        """The kubectl command line, for a process the caller runs itself (a watch, a long exec)."""
        return [str(self.bins.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        cmd = self.kubectl_argv(*args, kubeconfig=kubeconfig)
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def apply(self, manifest: str | Path, *, kubeconfig: Path | None = None) -> None:
        """Server-side apply a file, a directory of YAML, or YAML text (the dev tool owns what it applies)."""
        source = ["-f", str(manifest)] if isinstance(manifest, Path) else ["-f", "-"]
        text = None if isinstance(manifest, Path) else manifest
        self.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=gpuslice-devcluster", *source,
            input=text, kubeconfig=kubeconfig,
        )  # fmt: skip

    def apply_crds(self, crd_dir: Path | None = None) -> None:
        """Apply gpuslice's CRDs and wait until the API server serves them."""
        directory = crd_dir or CRD_DIR
        if not directory.is_dir():
            raise DevClusterError(f"CRD directory {directory} not found")
        self.apply(directory)
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(directory))

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create (or update) a namespace and wait for its default service account, so pods can be created."""
        doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        # JSON, not YAML: a label value like "12e456" must stay a string for kubectl's YAML parser.
        self.apply(json.dumps(doc))
        self.wait_default_service_account(name)
        return name

    def wait_default_service_account(self, namespace: str, timeout: float = 60) -> None:
        """Pods are rejected until kube-controller-manager has created the namespace's `default`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise DevClusterError(f"namespace {namespace}: no default service account after {timeout:.0f}s")
