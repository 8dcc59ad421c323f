"""Running the deploy manifests for real on a devcluster's real node (manifests/overlays/devcluster).

The devcluster differs from a GPU cluster in three ways, and this module bridges each:

- **The API server** listens on 127.0.0.1 only and there is no kube-proxy, so the `kubernetes`
  Service's ClusterIP leads nowhere. Instead of putting the pods on the host network (two operator
  replicas on one node would fight over their ports, and the agent's metrics port would be the
  machine's), pods stay on the node's pod network and reach the API server through a TCP relay on
  the node's bridge address (`apiserver-proxy`, a process of the devcluster, the stand-in for
  kube-proxy). The pods resolve `kubernetes`, a name the API server's certificate carries, to that
  address (`hostAliases`), with `KUBERNETES_SERVICE_HOST=kubernetes` and `KUBERNETES_SERVICE_PORT`
  set to the relay's port: the product's in-cluster configuration, TLS verified, unchanged.
- **kubelet's root dir** is the node's own, not /var/lib/kubelet, and containerd reads CDI specs
  from the node's dirs: the agent's host paths and arguments are generated for the node.
- **The GPUs are simulated**: the agent gets the driver test double (libnvidia-ml.so.1 from
  shim/build/fake on its LD_LIBRARY_PATH), the node's GPU description (GPUSLICE_FAKE_GPU_CONFIG)
  and the double's host daemon socket next to it; the simulated NVIDIA toolkit's CDI spec is written
  where the node's containerd reads it.

`write_overlay` writes a kustomization next to the cluster's state that takes the checked-in
overlay and adds those path- and port-dependent patches; apply it after the CRDs:

    python -m gpuslice_dev.devcluster.deploy --dir DIR --gpus "2x Tesla V100-PCIE-32GB"  # prints its dir
    kubectl apply --server-side -k manifests/crds && kubectl apply --server-side -k <that dir>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice_dev.devcluster.cluster import DevCluster, DevClusterError, free_port
from gpuslice_dev.gpusim.simulate import FAKE_GPU_CONFIG_ENV, PROC_ROOT_ENV, SYS_ROOT_ENV, proc_root, sys_root
from gpuslice_dev.paths import REPO_ROOT

OVERLAY = REPO_ROOT / "manifests" / "overlays" / "devcluster"
PROXY_PROCESS = "apiserver-proxy"
#: a name in the API server's serving certificate (devcluster pki), resolved by the pods' /etc/hosts
API_HOST = "kubernetes"
GPU_NODE_LABEL = ("nvidia.com/gpu.present", "true")
NAMESPACE = c.SYSTEM_NAMESPACE


# ------------------------------------------------------------------------- the API server relay


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _relay(listen: tuple[str, int], target: tuple[str, int]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    print(f"relaying {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def start_apiserver_proxy(cluster: DevCluster, host: str) -> int:
    """Start (or find running) the relay host:<port> -> the API server; returns the port."""
    st = cluster.state()
    if st is None:
        raise DevClusterError(f"no devcluster in {cluster.dir}")
    port = st.ports.get(PROXY_PROCESS)
    if cluster.status().get(PROXY_PROCESS) and port and _accepts(host, port):
        return port
    port = free_port()
    target = f"127.0.0.1:{st.ports['kube-apiserver']}"
    rec = cluster.start_process(
        PROXY_PROCESS,
        [sys.executable, "-m", "gpuslice_dev.devcluster.deploy", "relay", f"{host}:{port}", target],
    )
    st = cluster.state() or st
    st.ports[PROXY_PROCESS] = port
    st.save()
    deadline = time.monotonic() + 20
    while not _accepts(host, port):
        if time.monotonic() > deadline or not rec.alive():
            raise DevClusterError(f"{PROXY_PROCESS} did not start; log: {rec.log}")
        time.sleep(0.1)
    return port


# --------------------------------------------------------------------------- the generated overlay


def _agent_paths(cluster: DevCluster, node: str, gpus: str) -> tuple[dict[str, Path], Path]:
    """The node's agent dirs and its GPU description; starts the simulated driver's host daemon and
    writes the simulated NVIDIA CDI spec (what a GPU node's driver and toolkit provide)."""
    from gpuslice_dev.devcluster.node_agents import start_real_node_gpus

    dirs, fake_config = start_real_node_gpus(cluster, node, gpus)
    dirs = {**dirs, "shim": dirs["state"].parent / "shim"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return dirs, fake_config


def _hostpath(name: str, path: Path, kind: str = "DirectoryOrCreate") -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": str(path), "type": kind}}


def agent_patch(dirs: dict[str, Path], fake_config: Path, fake_dir: Path) -> list[dict[str, Any]]:
    """JSON patch ops for the agent DaemonSet: the node's own dirs (each mounted at its host path,
    as in the base: the CDI specs the agent writes name them), the simulated driver."""
    plugin = dirs["plugins"] / "gpuslice.io"
    driver_dir = fake_config.parent
    volumes = [
        _hostpath("kubelet-plugin", plugin),
        _hostpath("kubelet-registry", dirs["registry"], "Directory"),
        _hostpath("cdi", dirs["cdi"]),
        _hostpath("state", dirs["state"]),
        _hostpath("run", dirs["run"]),
        _hostpath("shim", dirs["shim"]),
        _hostpath("fake-driver-libs", fake_dir, "Directory"),
        _hostpath("fake-driver", driver_dir, "Directory"),
        _hostpath("nvidia-cdi", dirs["nvidia-cdi"]),
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    mounts = [
        {"name": "kubelet-plugin", "mountPath": str(plugin)},
        {"name": "kubelet-registry", "mountPath": str(dirs["registry"])},
        {"name": "cdi", "mountPath": str(dirs["cdi"])},
        {"name": "state", "mountPath": str(dirs["state"])},
        {"name": "run", "mountPath": str(dirs["run"])},
        {"name": "shim", "mountPath": str(dirs["shim"]), "readOnly": True},
        {"name": "fake-driver-libs", "mountPath": str(fake_dir), "readOnly": True},
        # the GPU description and the double's host daemon socket (<config>.state/driver.sock); the
        # double's state is the daemon's: read-only here as in every container
        {"name": "fake-driver", "mountPath": str(driver_dir), "readOnly": True},
        # the simulated toolkit's CDI spec: a MIG claim's spec takes the driver's libraries from it
        {"name": "nvidia-cdi", "mountPath": str(dirs["nvidia-cdi"]), "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    args = [
        "--node=$(NODE_NAME)",
        "--metrics-port=8080",
        f"--plugins-dir={dirs['plugins']}",
        f"--registry-dir={dirs['registry']}",
        f"--cdi-dir={dirs['cdi']}",
        f"--state-dir={dirs['state']}",
        f"--run-dir={dirs['run']}",
        f"--shim-library={dirs['shim'] / 'libgpuslice.so'}",
    ]
    env = {
        FAKE_GPU_CONFIG_ENV: str(fake_config),
        "LD_LIBRARY_PATH": str(fake_dir),
        PROC_ROOT_ENV: str(proc_root(fake_config)),
        SYS_ROOT_ENV: str(sys_root(fake_config)),
        c.NVIDIA_CDI_DIRS_ENV: str(dirs["nvidia-cdi"]),
    }
    agent = "/spec/template/spec/containers/0"
    return [
        {"op": "test", "path": f"{agent}/name", "value": "agent"},
        {"op": "replace", "path": "/spec/template/spec/volumes", "value": volumes},
        {"op": "replace", "path": f"{agent}/volumeMounts", "value": mounts},
        {"op": "replace", "path": f"{agent}/args", "value": args},
        *({"op": "add", "path": f"{agent}/env/-", "value": {"name": k, "value": v}} for k, v in env.items()),
    ]  # fmt: skip


def api_patch(kind: str, name: str, host_ip: str, port: int) -> dict[str, Any]:
    """Strategic merge patch: the pods reach the API server through the relay."""
    container = "operator" if kind == "Deployment" else "agent"
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "hostAliases": [{"ip": host_ip, "hostnames": [API_HOST]}],
                    "containers": [
                        {"name": container, "env": [{"name": "KUBERNETES_SERVICE_PORT", "value": str(port)}]}
                    ],
                }
            }
        },
    }


def write_overlay(cluster: DevCluster, node: str, gpus: str, out: Path | None = None) -> Path:
    """Prepare `node` (GPU label, simulated driver, API relay) and write the overlay for it; returns
    its directory (default `<cluster dir>/deploy`)."""
    from gpuslice_dev.devcluster.realnode import dirs_of
    from gpuslice_dev.gpusim.build import ensure_built

    st = cluster.state()
    if st is None or node not in st.real_nodes:
        raise DevClusterError(f"{node} is not a real node of {cluster.dir}")
    host_ip = dirs_of(cluster, node).node_ip
    port = start_apiserver_proxy(cluster, host_ip)
    dirs, fake_config = _agent_paths(cluster, node, gpus)
    key, value = GPU_NODE_LABEL
    cluster.kubectl("label", "node", node, f"{key}={value}", "--overwrite")
    out = out or cluster.dir / "deploy"
    out.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes relative paths only (a base outside the kustomization's dir is fine)
        "resources": [os.path.relpath(OVERLAY, out)],
        "patches": [
            {"patch": yaml.safe_dump(api_patch("Deployment", "gpuslice-operator", host_ip, port))},
            {"patch": yaml.safe_dump(api_patch("DaemonSet", "gpuslice-agent", host_ip, port))},
            {
                "target": {"kind": "DaemonSet", "name": "gpuslice-agent"},
                "patch": yaml.safe_dump(agent_patch(dirs, fake_config, ensure_built().fake_dir)),
            },
        ],
    }
    header = f"# Generated by gpuslice_dev.devcluster.deploy for {node} of {cluster.dir}; do not edit.\n"
    (out / "kustomization.yaml").write_text(header + yaml.safe_dump(kustomization, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuslice_dev.devcluster.deploy", description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    relay = sub.add_parser("relay", help="(internal) the API server relay process")
    relay.add_argument("listen")
    relay.add_argument("target")
    parser.add_argument("--dir", type=Path, default=None, help="the devcluster's state directory")
    parser.add_argument("--node", default="real-node-0")
    parser.add_argument("--gpus", default="2x Tesla V100-PCIE-32GB", help="the simulated GPUs")
    parser.add_argument("--out", type=Path, default=None, help="overlay dir (default <dir>/deploy)")
    args = parser.parse_args(argv)
    if args.cmd == "relay":
        lhost, lport = args.listen.rsplit(":", 1)
        thost, tport = args.target.rsplit(":", 1)
        asyncio.run(_relay((lhost, int(lport)), (thost, int(tport))))
        return 0
    try:
        print(write_overlay(DevCluster(args.dir), args.node, args.gpus, args.out))
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
