"""The operator's writes: server-side apply (field manager `gpuslice`), delete, status patches.

Reads come from Kopf's watch streams and indexes, never from here: this client only writes, so the
number of API calls per change stays bounded. It is `gpuslice.kubehttp` (aiohttp, which Kopf uses
too), not the generated kubernetes_asyncio client: its dynamic client parsed every answer into
objects, and importing it costs ~40 MiB (see `run.py`, which keeps Kopf from importing it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.metrics import WRITES

log = get(__name__)

#: kind -> resource (plural) of every kind the operator writes.
PLURALS: dict[str, str] = {
    "DeviceClass": "deviceclasses",
    "ResourceClaim": "resourceclaims",
    "ResourceClaimTemplate": "resourceclaimtemplates",
    "ResourceQuota": "resourcequotas",
    "Namespace": "namespaces",
    "Node": "nodes",
    "Lease": "leases",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
    c.SLICE_KIND: c.SLICE_PLURAL,
    c.PACKAGE_KIND: c.PACKAGE_PLURAL,
    c.USAGE_KIND: c.USAGE_PLURAL,
    # Kueue's, for sharing mode Kueue (gpuslice.operator.queues)
    "ResourceFlavor": "resourceflavors",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
}


def error_message(exc: ApiError) -> str:
    """The API server's own message (`status.message`), which is what a user should read."""
    return exc.message


def object_path(api_version: str, kind: str, name: str, namespace: str | None = None) -> str:
    group, _, version = api_version.rpartition("/")
    return kubehttp.path(group, version, PLURALS[kind], name, namespace)


async def load_config(kubeconfig: str | None) -> kubehttp.Client:
    return kubehttp.Client(kubehttp.load(kubeconfig), connections=32)


#: Writes in flight at once. A recheck tick refreshes every Pending slice: unbounded, thousands of
#: requests would queue in the API server's quota admission and outlive the client's timeout, and
#: their retries add load (bench/operator_scale.py at 5,000 slices). Queued here instead, a write
#: waits for a slot, not for a timeout.
MAX_WRITES_IN_FLIGHT = 32


class Kube:
    def __init__(self, api: kubehttp.Client, max_in_flight: int = MAX_WRITES_IN_FLIGHT) -> None:
        self.api = api
        self._slots = asyncio.Semaphore(max_in_flight)

    async def apply(self, body: dict[str, Any], *, status: bool = False) -> dict[str, Any]:
        """Server-side apply; identical content writes nothing (resourceVersion stays)."""
        meta = body["metadata"]
        url = object_path(body["apiVersion"], body["kind"], meta["name"], meta.get("namespace"))
        async with self._slots:
            WRITES.labels(body["kind"], "apply").inc()  # counted when sent: a refused write is a write too
            out: dict[str, Any] = await self.api.apply(
                url + ("/status" if status else ""), body, c.FIELD_MANAGER
            )
        return out

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST: refused (409) when an object of that name exists, whoever made it."""
        meta = body["metadata"]
        url = object_path(body["apiVersion"], body["kind"], meta["name"], meta.get("namespace"))
        async with self._slots:
            WRITES.labels(body["kind"], "create").inc()
            out: dict[str, Any] = await self.api.create(url.rsplit("/", 1)[0], body)
        return out

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """One object, or None; only for start-up checks, everything else reads Kopf's indexes."""
        try:
            out: dict[str, Any] = await self.api.get(object_path(api_version, kind, name, namespace))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return out

    async def list_all(self, api_version: str, kind: str, **params: str) -> list[dict[str, Any]]:
        """Every object of a kind in all namespaces; only for start-up reads (see `get`)."""
        group, _, version = api_version.rpartition("/")
        answer: dict[str, Any] = await self.api.get(kubehttp.path(group, version, PLURALS[kind]), **params)
        return list(answer.get("items") or [])

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """False when it was already gone."""
        async with self._slots:
            WRITES.labels(kind, "delete").inc()
            return await self.api.delete(object_path(api_version, kind, name, namespace))

    async def json_patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        ops: list[dict[str, Any]],
        namespace: str | None = None,
        *,
        missing_ok: bool = False,
    ) -> bool:
        """A JSON patch (RFC 6902); with `missing_ok`, a failed `test` op or a gone object is False."""
        try:
            async with self._slots:
                WRITES.labels(kind, "patch").inc()
                await self.api.json_patch(object_path(api_version, kind, name, namespace), ops)
        except ApiError as exc:
            if missing_ok and exc.status in (404, 422):
                return False
            raise
        return True

    async def patch_status(
        self, api_version: str, kind: str, name: str, namespace: str | None, status: Any
    ) -> None:
        """Merge-patch the status subresource (the operator owns every status field of its CRDs)."""
        async with self._slots:
            WRITES.labels(kind, "patch-status").inc()  # counted when sent: a refused write is a write too
            await self.api.merge_patch(
                object_path(api_version, kind, name, namespace) + "/status", {"status": status}
            )

    async def whoami(self) -> str:
        """The username the API server sees for these credentials (SelfSubjectReview)."""
        review = await self.api.create(
            kubehttp.path("authentication.k8s.io", "v1", "selfsubjectreviews"),
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        return str(review["status"]["userInfo"]["username"])

    async def close(self) -> None:
        await self.api.close()
