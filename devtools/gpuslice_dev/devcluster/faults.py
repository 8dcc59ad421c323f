"""Break a running dev cluster's processes on purpose and bring them back as they were: the fault
tests' handle on etcd, kube-apiserver, the controllers, kubelet, containerd and the node agents.

A process is killed by the name it is recorded under (`etcd`, `kube-apiserver`, `kubelet/real-node-0`,
...) and started again with the argv it was recorded with, so it comes back on the same ports, data
and certificates, as a process restarted by systemd or the kubelet would.
"""

from __future__ import annotations

import os
import signal
import time

from gpuslice_dev.devcluster.cluster import DevCluster
from gpuslice_dev.devcluster.supervisor import DevClusterError, ProcessRecord


def record(cluster: DevCluster, name: str) -> ProcessRecord:
    st = cluster.state()
    if st is None or name not in st.processes:
        raise DevClusterError(f"{cluster.dir} records no process {name!r}")
    return st.processes[name]


def kill(cluster: DevCluster, name: str, sig: int = signal.SIGKILL, timeout: float = 30) -> ProcessRecord:
    """Send `sig` to the recorded process and wait until it is gone; returns its record (argv)."""
    rec = record(cluster, name)
    if not rec.alive():
        raise DevClusterError(f"{name} (pid {rec.pid}) is not running")
    os.kill(rec.pid, sig)
    deadline = time.monotonic() + timeout
    while rec.alive():
        if time.monotonic() > deadline:
            raise DevClusterError(f"{name} (pid {rec.pid}) still runs {timeout:.0f}s after signal {sig}")
        time.sleep(0.05)
    return rec


def _env(name: str) -> dict[str, str] | None:
    """kubelet and containerd find runc, the CNI plugins and each other on the node binaries' PATH."""
    if name.split("/")[0] in ("kubelet", "containerd"):
        from gpuslice_dev.devcluster import realnode
        from gpuslice_dev.devcluster.node_binaries import ensure_node_binaries

        return realnode._env(ensure_node_binaries(lambda _m: None))
    return None


def start_again(cluster: DevCluster, name: str, rec: ProcessRecord) -> ProcessRecord:
    """Start a killed process again with its recorded argv (same ports, data dir, certificates)."""
    if record(cluster, name).alive():
        raise DevClusterError(f"{name} already runs again")
    return cluster.start_process(name, list(rec.argv), _env(name))


def restart(cluster: DevCluster, name: str, sig: int = signal.SIGKILL, down_for: float = 0) -> float:
    """Kill `name` with `sig`, leave it down `down_for` seconds, start it again; returns the
    monotonic time it was started again (the fault's end)."""
    rec = kill(cluster, name, sig)
    if down_for:
        time.sleep(down_for)
    start_again(cluster, name, rec)
    return time.monotonic()
