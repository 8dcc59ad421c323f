"""One simulated node agent per kwok node, so the whole allocation path runs on one machine."""

from __future__ import annotations

from collections.abc import Callable

from gpuslice.dev.devcluster.cluster import DevCluster, DevClusterError


def agent_process_name(node: str) -> str:
    return f"agent/{node}"


def start_agents(cluster: DevCluster, spec: str, progress: Callable[[str], None] | None = None) -> list[str]:
    """Start `gpuslice agent --simulate-gpus SPEC` for every node that has no running agent yet.

    Each agent runs as its own client-certificate user that may write only its node's
    ResourceSlices. Returns the nodes whose agent was started now.
    """
    from gpuslice.dev.agents import agent_kubeconfig, install_agent_rbac, spawn_agent

    say = progress or (lambda _m: None)
    st = cluster.state()
    if st is None:
        raise DevClusterError(f"no devcluster in {cluster.dir}; run `gpuslice devcluster up` first")
    running = cluster.status()
    started: list[str] = []
    if any(not running.get(agent_process_name(n)) for n in st.nodes):
        install_agent_rbac(cluster)
    for node in st.nodes:
        name = agent_process_name(node)
        if running.get(name):
            continue
        kubeconfig = agent_kubeconfig(cluster, node, install=False)
        log = cluster.dir / "logs" / f"agent-{node}.log"
        proc = spawn_agent(node, spec, kubeconfig, cluster.dir / "agents", log)
        cluster.register_process(name, proc, log, [str(a) for a in proc.args])  # type: ignore[union-attr]
        started.append(node)
        say(f"started agent for {node} ({spec}), log {log}")
    return started


def stop_agents(cluster: DevCluster) -> list[str]:
    """Stop every agent of the cluster (SIGTERM: each withdraws its ResourceSlices first)."""
    return cluster.stop_processes(lambda name: name.startswith("agent/"))
