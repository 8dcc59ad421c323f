"""Starting simulated agents as child processes (devcluster, tests, bench)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gpuslice import constants as c
from gpuslice_dev.paths import MANIFESTS

if TYPE_CHECKING:
    from gpuslice_dev.devcluster.cluster import DevCluster


#: Longest socket directory we accept under the state root; sun_path holds 107 bytes, and the DRA
#: socket adds "/gpuslice.io/dra.sock".
_MAX_SOCKET_DIR = 80


def agent_dirs(state_root: Path, node: str) -> dict[str, Path]:
    """The per-node directories an agent under `state_root` uses.

    Unix socket paths are limited to 107 bytes: when `state_root` is deep (a pytest tmp dir), the
    kubelet-facing socket dirs move to a short, stable dir under the system temp dir instead.
    """
    base = state_root / node
    sockets = base
    if len(str(base / "registry")) > _MAX_SOCKET_DIR:
        digest = hashlib.sha256(str(base.resolve()).encode()).hexdigest()[:12]
        sockets = Path(tempfile.gettempdir()) / f"gpuslice-{digest}"
    return {
        "state": base / "state",
        "run": base / "run",
        "cdi": base / "cdi",
        "plugins": sockets / "plugins",
        "registry": sockets / "registry",
    }


#: Seconds between the dev cluster's usage readings (the agent's default is 10): the demo and the tests
#: wait for readings, and a dev cluster of a few slices can afford a write every few seconds.
DEV_USAGE_INTERVAL = 3.0


def agent_command(
    node: str,
    simulate_spec: str,
    kubeconfig: Path,
    state_root: Path,
    *,
    metrics_port: int = 0,
    dirs: dict[str, Path] | None = None,
    fake_config: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """`gpuslice agent` for one node, simulating its GPUs with the driver test double: (argv, env).

    node: the Node name (also the DRA pool name). simulate_spec: e.g. "4x Tesla V100-PCIE-32GB".
    kubeconfig: credentials the agent uses. state_root: parent of every agent's files; this one's live
    in `<state_root>/<node>/` (see agent_dirs): checkpoint, CDI specs, kubelet sockets; it logs JSON
    lines and stops on SIGTERM (withdrawing its ResourceSlices first). On a real node, `dirs` names
    the kubelet's plugin dirs and containerd's CDI dir, and `fake_config` the node's GPU description
    (see realnode).
    """
    # Build the shim and the driver test double once here, not racing in every child.
    from gpuslice_dev.gpusim import simulate
    from gpuslice_dev.gpusim.build import ensure_built

    built = ensure_built()
    dirs = dirs or agent_dirs(state_root, node)
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    # The agent is the product's, unchanged: it finds the driver test double on its library path
    # as it would find the real libnvidia-ml.so.1.
    if fake_config is None:
        fake_config = simulate.write_node_config(simulate_spec, node, dirs["state"] / "simulated")
    env = {**os.environ, **simulate.fake_driver_env(fake_config, built.fake_dir)}
    if "nvidia-cdi" in dirs:  # a real node: the simulated NVIDIA toolkit's spec is there
        env[c.NVIDIA_CDI_DIRS_ENV] = str(dirs["nvidia-cdi"])
    cmd = [
        sys.executable, "-m", "gpuslice", "agent",
        "--node", node,
        "--shim-library", str(built.shim),
        "--kubeconfig", str(kubeconfig),
        "--state-dir", str(dirs["state"]),
        "--run-dir", str(dirs["run"]),
        "--cdi-dir", str(dirs["cdi"]),
        "--plugins-dir", str(dirs["plugins"]),
        "--registry-dir", str(dirs["registry"]),
        "--metrics-port", str(metrics_port),
        "--usage-interval", str(DEV_USAGE_INTERVAL),
    ]  # fmt: skip
    return cmd, env


def spawn_agent(
    node: str,
    simulate_spec: str,
    kubeconfig: Path,
    state_root: Path,
    log_path: Path,
    *,
    metrics_port: int = 0,
) -> subprocess.Popen[bytes]:
    """Start the agent of `agent_command` as a child process logging to `log_path` (tests that kill
    and restart it; devcluster starts it through its process supervisor instead)."""
    cmd, env = agent_command(node, simulate_spec, kubeconfig, state_root, metrics_port=metrics_port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


#: The deployment's agent role and own-node admission policy (a source checkout's manifests/, like crds/).
DEPLOY_MANIFESTS = MANIFESTS / "base" / "agent"
DEV_BINDING = Path(__file__).resolve().parent / "manifests" / "dev-agent-binding.yaml"
AGENT_NAMESPACE = c.SYSTEM_NAMESPACE
AGENT_GROUP = "gpuslice:agents"


def agent_user(node: str) -> str:
    """The client-certificate user a dev-cluster agent runs as; the own-node admission policy reads
    the node name from it."""
    return f"gpuslice:agent:{node}"


def install_agent_rbac(cluster: DevCluster) -> None:
    """Apply the agent's role, own-node policy and dev binding (idempotent; once per cluster)."""
    cluster.create_namespace(AGENT_NAMESPACE)  # rbac.yaml holds the DaemonSet's service account
    for manifest in (DEPLOY_MANIFESTS / "rbac.yaml", DEPLOY_MANIFESTS / "own-node-policy.yaml", DEV_BINDING):
        cluster.apply(manifest)


def agent_kubeconfig(cluster: DevCluster, node: str, *, install: bool = True) -> Path:
    """A kubeconfig for `node`'s agent that can write only that node's ResourceSlices
    (`install=False` when install_agent_rbac already ran for this cluster)."""
    if install:
        install_agent_rbac(cluster)
    return cluster.tenant_kubeconfig(agent_user(node), groups=(AGENT_GROUP,))
