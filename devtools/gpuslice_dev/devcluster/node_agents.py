"""One simulated node agent per node, so the whole allocation path runs on one machine.

On kwok nodes the agent only publishes (nothing calls its kubelet sockets). On real nodes it
registers with the real kubelet through its plugins_registry, writes CDI specs where that node's
containerd reads them, and
the NVIDIA side is simulated as on a GPU node: the toolkit's CDI spec (gpusim.nvidia_cdi) and the
driver test double's host daemon (the kernel module's part: host PIDs, memory of dead processes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from gpuslice_dev.devcluster.cluster import DevCluster, DevClusterError

REGISTERED_MESSAGE = "registered with kubelet"


def agent_process_name(node: str) -> str:
    return f"agent/{node}"


def driverd_process_name(node: str) -> str:
    return f"driverd/{node}"


def _registered(log: Path) -> bool:
    if not log.exists():
        return False
    for line in log.read_text(errors="replace").splitlines():
        try:
            if json.loads(line).get("event") == REGISTERED_MESSAGE:
                return True
        except ValueError:
            continue
    return False


def fake_gpu_config(cluster: DevCluster, node: str) -> Path:
    """The simulated GPUs of a real node, as the driver test double reads them (host path)."""
    from gpuslice_dev.devcluster.realnode import dirs_of

    return dirs_of(cluster, node).base / "gpu" / "driver" / "fake-gpus.conf"


def start_real_node_gpus(cluster: DevCluster, node: str, spec: str) -> tuple[dict[str, Path], Path]:
    """The simulated GPUs of a real node: description, host daemon, NVIDIA CDI spec."""
    from gpuslice_dev.devcluster.realnode import dirs_of
    from gpuslice_dev.gpusim import nvidia_cdi, simulate
    from gpuslice_dev.gpusim.build import ensure_built

    d = dirs_of(cluster, node)
    fake_config = fake_gpu_config(cluster, node)
    driver_dir = fake_config.parent
    gpu_dir = driver_dir.parent
    simulate.write_node_config(spec, node, driver_dir)
    name = driverd_process_name(node)
    if not cluster.status().get(name):
        rec = cluster.start_process(name, [str(ensure_built().driverd), "--config", str(fake_config)])
        deadline = time.monotonic() + 15
        while not simulate.driver_socket(fake_config).exists():
            if time.monotonic() > deadline or not rec.alive():
                raise DevClusterError(f"{name} did not start serving; log: {rec.log}")
            time.sleep(0.1)
    nvidia_cdi.write_spec(
        simulate.parse_gpu_spec(spec, seed=node),
        gpu_dir=gpu_dir,
        driver_dir=driver_dir,
        cdi_dir=d.cdi_dirs[1],
    )
    agent = d.base / "agent"
    dirs = {
        "state": agent / "state",
        "run": agent / "run",
        "cdi": d.cdi_dirs[0],
        # the toolkit's spec, read by the agent for a MIG claim's driver libraries
        "nvidia-cdi": d.cdi_dirs[1],
        "plugins": d.plugins_dir,
        "registry": d.registry_dir,
    }
    return dirs, fake_config


def start_agents(
    cluster: DevCluster, spec: str, progress: Callable[[str], None] | None = None, *, metrics: bool = False
) -> list[str]:
    """Start `gpuslice agent` over simulated GPUs `spec` for every node without a running agent: the
    real nodes when there are any, otherwise the kwok nodes.

    Each agent runs as its own client-certificate user that may write only its node's
    ResourceSlices. Returns the nodes whose agent was started now.
    """
    from gpuslice_dev.agents import agent_command, agent_kubeconfig, install_agent_rbac

    say = progress or (lambda _m: None)
    st = cluster.state()
    if st is None:
        raise DevClusterError(f"no devcluster in {cluster.dir}; run `gpuslice-dev devcluster up` first")
    nodes = st.real_nodes or st.nodes
    running = cluster.status()
    started: list[str] = []
    if any(not running.get(agent_process_name(n)) for n in nodes):
        install_agent_rbac(cluster)
    for node in nodes:
        name = agent_process_name(node)
        if running.get(name):
            continue
        kubeconfig = agent_kubeconfig(cluster, node, install=False)
        log = cluster.dir / "logs" / f"agent-{node}.log"
        dirs, fake_config = (
            start_real_node_gpus(cluster, node, spec) if node in st.real_nodes else (None, None)
        )
        log.unlink(missing_ok=True)
        metrics_port = 0
        if metrics:  # recorded for `devcluster up --with-prometheus` (prometheus.expose_agents)
            from gpuslice_dev.devcluster.cluster import free_port

            metrics_port = free_port()
            current = cluster.state()  # start_process saves the state too: add to the saved one
            assert current is not None
            current.ports[f"agent-metrics/{node}"] = metrics_port
            current.save()
        cmd, env = agent_command(
            node, spec, kubeconfig, cluster.dir / "agents", dirs=dirs, fake_config=fake_config,
            metrics_port=metrics_port,
        )  # fmt: skip
        rec = cluster.start_process(name, cmd, env)
        if node in st.real_nodes:
            deadline = time.monotonic() + 60
            while not _registered(log):
                if time.monotonic() > deadline or not rec.alive():
                    raise DevClusterError(f"the agent on {node} did not register with kubelet; log: {log}")
                time.sleep(0.2)
        started.append(node)
        say(f"started agent for {node} ({spec}), log {log}")
    return started


def stop_agents(cluster: DevCluster) -> list[str]:
    """Stop every agent of the cluster (SIGTERM; one that no kubelet registered withdraws its pool)."""
    return cluster.stop_processes(lambda name: name.startswith("agent/"))
