"""The agent's Kubernetes I/O: a few calls over `gpuslice.kubehttp`, returning plain dicts.

Built-in DRA objects are read and written through their generic `/apis/{group}/{version}/...` paths,
so every field the API server has (partitionable devices included) survives the round trip. The
agent does not import the generated kubernetes_asyncio client: it would cost ~60 MiB per node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gpuslice import constants as c
from gpuslice import kubehttp, logs

log = logs.get(__name__)

DRA = (c.DRA_GROUP, c.DRA_VERSION)
GPUSLICE = (c.API_GROUP, c.API_VERSION)


def api_client(kubeconfig: Path | None) -> kubehttp.Client:
    """From `kubeconfig`, or the in-cluster service account."""
    config = kubehttp.Config.from_kubeconfig(kubeconfig) if kubeconfig else kubehttp.Config.in_cluster()
    return kubehttp.Client(config, connections=8)


class Kube:
    def __init__(self, api: kubehttp.Client) -> None:
        self.api = api

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.api.get(kubehttp.path(*DRA, "resourceclaims", name, namespace))
        return result

    async def get_gpuslice(self, namespace: str, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.api.get(kubehttp.path(*GPUSLICE, c.SLICE_PLURAL, name, namespace))
        return result

    async def list_pool_slices(self, node: str) -> list[dict[str, Any]]:
        result = await self.api.get(
            kubehttp.path(*DRA, "resourceslices"),
            fieldSelector=f"spec.nodeName={node},spec.driver={c.DRIVER_NAME}",
        )
        return list(result.get("items") or [])

    async def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        """The pods bound to `node` (one LIST by field selector), as plain JSON."""
        result = await self.api.get(kubehttp.path("", "v1", "pods"), fieldSelector=f"spec.nodeName={node}")
        return list(result.get("items") or [])

    async def apply_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply; returns the object as the API server stored it (the apply's answer)."""
        url = kubehttp.path(*DRA, "resourceslices", body["metadata"]["name"])
        stored: dict[str, Any] = await self.api.apply(url, body, c.FIELD_MANAGER)
        return stored

    async def delete_slice(self, name: str) -> None:
        await self.api.delete(kubehttp.path(*DRA, "resourceslices", name))

    async def patch_slice_usage(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        """A JSON patch of a GpuSlice's status subresource (`usage.usage_patch`)."""
        url = kubehttp.path(*GPUSLICE, c.SLICE_PLURAL, name, namespace)
        await self.api.json_patch(f"{url}/status", ops)

    async def apply_claim_device_status(
        self, namespace: str, name: str, devices: list[dict[str, Any]]
    ) -> None:
        """Server-side apply of `status.devices` entries of a claim (DRA device status: the health
        condition of each allocated device, for the pod that uses it)."""
        url = kubehttp.path(*DRA, "resourceclaims", name, namespace) + "/status"
        body = {
            "apiVersion": f"{DRA[0]}/{DRA[1]}",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"devices": devices},
        }
        await self.api.apply(url, body, c.FIELD_MANAGER)

    async def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        await self.api.create(kubehttp.path("", "v1", "events", namespace=namespace), body)

    # --- watches ---------------------------------------------------------------------------------

    def watch_packages(self) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
        return kubehttp.watch_forever(self.api, kubehttp.path(*GPUSLICE, c.PACKAGE_PLURAL))

    def watch_node_pods(self, node: str) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
        """The pods bound to `node`, as kubelet follows them (the API server indexes this selector)."""
        return kubehttp.watch_forever(
            self.api, kubehttp.path("", "v1", "pods"), fieldSelector=f"spec.nodeName={node}"
        )

    def watch_node(self, node: str) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
        return kubehttp.watch_forever(
            self.api, kubehttp.path("", "v1", "nodes"), fieldSelector=f"metadata.name={node}"
        )
