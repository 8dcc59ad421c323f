"""The agent's Kubernetes I/O: thin kubernetes_asyncio calls returning plain dicts.

Built-in DRA objects are read and written through the generic `/apis/{group}/{version}/...` paths of
CustomObjectsApi, so every field the API server has (partitionable devices included) survives the
round trip, whatever models this client version ships.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuslice import constants, logs

log = logs.get(__name__)

DRA = (constants.DRA_GROUP, constants.DRA_VERSION)
APPLY_PATCH = "application/apply-patch+yaml"


async def api_client(kubeconfig: Path | None) -> client.ApiClient:
    if kubeconfig is not None:
        return await config.new_client_from_config(config_file=str(kubeconfig))
    config.load_incluster_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            *DRA, namespace, "resourceclaims", name
        )
        return result

    async def list_pool_slices(self, node: str) -> list[dict[str, Any]]:
        result = await self.custom.list_cluster_custom_object(
            *DRA, "resourceslices", field_selector=f"spec.nodeName={node},spec.driver={constants.DRIVER_NAME}"
        )
        return list(result.get("items") or [])

    async def apply_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply; returns the object as the API server stored it (read from the raw
        response: the client does not deserialize the answer to an apply patch)."""
        response = await self.custom.patch_cluster_custom_object(
            *DRA,
            "resourceslices",
            body["metadata"]["name"],
            body,
            field_manager=constants.FIELD_MANAGER,
            force=True,
            _content_type=APPLY_PATCH,  # type: ignore[call-arg]
            _preload_content=False,
        )
        stored: dict[str, Any] = json.loads(await response.read())
        return stored

    async def delete_slice(self, name: str) -> None:
        try:
            await self.custom.delete_cluster_custom_object(*DRA, "resourceslices", name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # --- watches ---------------------------------------------------------------------------------

    async def _list_packages(self, **kw: Any) -> Any:
        return await self.custom.list_cluster_custom_object(
            constants.API_GROUP, constants.API_VERSION, constants.PACKAGE_PLURAL, **kw
        )

    def watch_packages(self) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
        return _watch(
            self._list_packages, lambda listing: (listing["items"], listing["metadata"]["resourceVersion"])
        )

    def watch_node(self, node: str) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
        async def list_node(**kw: Any) -> Any:
            return await self.core.list_node(field_selector=f"metadata.name={node}", **kw)

        def items(listing: Any) -> tuple[list[dict[str, Any]], str]:
            return self.api.sanitize_for_serialization(listing.items), listing.metadata.resource_version

        return _watch(list_node, items)


async def _watch(
    list_fn: Callable[..., Awaitable[Any]], items: Callable[[Any], tuple[list[dict[str, Any]], str]]
) -> AsyncIterator[tuple[str, list[dict[str, Any]] | dict[str, Any]]]:
    """List-then-watch forever. Yields ("LIST", items) after every (re)list, then (event type, object).

    The watch resumes from the last seen resourceVersion (bookmarks keep it fresh) and relists only
    when the API server says that version is gone (410) or the connection failed.
    """
    delay = 1.0
    missing = False
    while True:
        try:
            listing = await list_fn()
            objects, rv = items(listing)
            yield "LIST", objects
            delay, missing = 1.0, False
            while True:
                async with watch.Watch() as w:
                    stream = w.stream(
                        list_fn, resource_version=rv, timeout_seconds=300, allow_watch_bookmarks=True
                    )
                    async for event in stream:
                        if event["type"] != "BOOKMARK":
                            yield event["type"], event["raw_object"]
                    rv = w.resource_version or rv
        except ApiException as exc:
            if exc.status == 410:
                continue
            if exc.status == 404:
                # The resource is not served (GpuPackage CRD not installed yet): there is none of it.
                # Until it appears the node still publishes its cards, with no partitions.
                if not missing:
                    log.warning("resource not served yet; polling until it is", reason=exc.reason)
                missing = True
                yield "LIST", []
                await asyncio.sleep(5.0)
                continue
            log.warning("watch failed, relisting", status=exc.status, reason=exc.reason, retry_in=delay)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("watch connection failed, relisting", error=str(exc), retry_in=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)
