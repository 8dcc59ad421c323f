"""Run a command as a container of a pod on a simulated node would run: the kubelet's and the
container runtime's part of the allocation path, which kwok does not play.

1. As kubelet, call the node agent's NodePrepareResources over its real DRA socket for the pod's
   gpuslice claims (the agent writes the CDI spec and the slice's limits file).
2. As a CDI-aware runtime, apply the spec's edits to a host process. There are no mount namespaces
   here, so container paths are translated to their host paths instead of bind-mounted: the shim is a
   private copy patched to read the host limits file (see gpuslice.dev.gpusim.patch), whose usage_dir is
   rewritten to the host usage dir; the shim comes in through LD_PRELOAD instead of /etc/ld.so.preload.
   The NVIDIA device is the driver test double with the node's simulated GPUs.

Used by `gpuslice demo` and the end-to-end tests; never by the product on a real node.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslice import constants
from gpuslice.api.pod import resolved_claims
from gpuslice.api.resourceclaim import allocation_results
from gpuslice.dev.devcluster.cluster import DevCluster, DevClusterError


@dataclass(frozen=True)
class PreparedPod:
    node: str
    claims: list[str]
    cdi_devices: list[str]
    env: dict[str, str]
    workdir: Path


def _get(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _translate(path: str, mounts: Sequence[dict[str, Any]]) -> str:
    """Host path of a container path through the CDI mounts (longest containerPath prefix wins)."""
    best: dict[str, Any] | None = None
    for m in mounts:
        cp = m["containerPath"].rstrip("/")
        if (path == cp or path.startswith(cp + "/")) and (
            best is None or len(cp) > len(best["containerPath"])
        ):
            best = m
    if best is None:
        return path
    return best["hostPath"] + path[len(best["containerPath"].rstrip("/")) :]


def prepare_pod(cluster: DevCluster, namespace: str, pod_name: str) -> PreparedPod:
    """Play kubelet for a scheduled pod: prepare its gpuslice claims on its node's agent."""
    import grpc

    from gpuslice.agent.plugin import dra_socket_path
    from gpuslice.agent.proto import dra_v1_pb2 as dra
    from gpuslice.agent.proto import dra_v1_pb2_grpc as dra_grpc
    from gpuslice.dev.agents import agent_dirs
    from gpuslice.dev.gpusim import patch, simulate
    from gpuslice.dev.gpusim.build import ensure_built
    from gpuslice.shim.config import SliceConfig

    pod = _get(cluster, "pod", pod_name, "-n", namespace)
    node = pod["spec"].get("nodeName")
    if not node:
        raise DevClusterError(f"pod {namespace}/{pod_name} is not scheduled yet")
    claims = [_get(cluster, "resourceclaim", n, "-n", namespace) for n in resolved_claims(pod).values() if n]
    ours = [c for c in claims if allocation_results(c)]
    if not ours:
        raise DevClusterError(f"pod {namespace}/{pod_name} holds no allocated gpuslice claim")
    dirs = agent_dirs(cluster.dir / "agents", node)
    request = dra.NodePrepareResourcesRequest(
        claims=[
            dra.Claim(namespace=namespace, name=c["metadata"]["name"], uid=c["metadata"]["uid"]) for c in ours
        ]
    )
    with grpc.insecure_channel(f"unix://{dra_socket_path(dirs['plugins'])}") as channel:
        reply = dra_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=30)
    cdi_ids: list[str] = []
    for c in ours:
        result = reply.claims[c["metadata"]["uid"]]
        if result.error:
            raise DevClusterError(
                f"agent on {node} failed to prepare claim {c['metadata']['name']}: {result.error}"
            )
        for dev in result.devices:
            cdi_ids.extend(dev.cdi_device_ids)

    # Apply the CDI edits of our devices (the first claim's slice: one slice per container here).
    mounts: list[dict[str, Any]] = []
    env: dict[str, str] = {}
    for spec_file in sorted(dirs["cdi"].glob("*.json")):
        spec = json.loads(spec_file.read_text())
        for dev in spec.get("devices", []):
            if f"{spec['kind']}={dev['name']}" in cdi_ids:
                edits = dev.get("containerEdits", {})
                mounts.extend(edits.get("mounts", []))
                env.update(e.split("=", 1) for e in edits.get("env", []))
    limits_host = _translate(constants.CONTAINER_CONFIG_PATH, mounts)
    if limits_host == constants.CONTAINER_CONFIG_PATH:
        raise DevClusterError(
            f"the CDI spec for {cdi_ids} mounts no limits file at {constants.CONTAINER_CONFIG_PATH}"
        )
    config = SliceConfig.parse(Path(limits_host).read_text())
    config = config.model_copy(update={"usage_dir": _translate(config.usage_dir, mounts)})
    workdir = cluster.dir / "containers" / namespace / pod_name
    workdir.mkdir(parents=True, exist_ok=True)
    config.write(workdir / "slice.conf")
    built = ensure_built()
    shim = patch.write_private_shim(built.shim, workdir / "slice.conf", workdir)
    fake_config = dirs["state"] / "simulated" / "fake-gpus.conf"
    env.update(simulate.fake_driver_env(fake_config, built.fake_dir))
    env["LD_PRELOAD"] = str(shim)
    return PreparedPod(node, [c["metadata"]["name"] for c in ours], cdi_ids, env, workdir)


def run_in_pod(
    cluster: DevCluster, namespace: str, pod_name: str, command: Sequence[str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Prepare the pod's slice (as kubelet) and run `command` the way its container would."""
    prepared = prepare_pod(cluster, namespace, pod_name)
    return subprocess.run(
        list(command),
        env={**os.environ, **prepared.env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
