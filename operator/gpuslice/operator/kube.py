"""The operator's writes: server-side apply (field manager `gpuslice`), delete, status patches.

Reads come from Kopf's watch streams and indexes, never from here: this client only writes, so the
number of API calls per change stays bounded.
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.dynamic import DynamicClient
from kubernetes_asyncio.dynamic.exceptions import NotFoundError

from gpuslice import constants as c
from gpuslice.logs import get
from gpuslice.metrics import WRITES

log = get(__name__)


def error_message(exc: ApiException) -> str:
    """The API server's own message (`status.message`), which is what a user should read."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    if body:
        try:
            return str(json.loads(body).get("message") or body)
        except ValueError:
            return str(body)
    return f"{exc.status} {exc.reason}"


def _checked(out: Any) -> dict[str, Any]:
    """The dynamic client hands a failure back as a Status object instead of raising: raise it."""
    obj: dict[str, Any] = out.to_dict() if hasattr(out, "to_dict") else dict(out)
    if obj.get("kind") == "Status" and obj.get("status") == "Failure":
        exc = ApiException(status=int(obj.get("code") or 0), reason=str(obj.get("reason") or ""))
        exc.body = json.dumps(obj).encode()
        raise exc
    return obj


async def load_config(kubeconfig: str | None) -> client.ApiClient:
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
    else:
        await config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self._dyn: DynamicClient | None = None

    async def dyn(self) -> DynamicClient:
        if self._dyn is None:
            self._dyn = await DynamicClient(self.api)
        return self._dyn

    async def _resource(self, api_version: str, kind: str) -> Any:
        return await (await self.dyn()).resources.get(api_version=api_version, kind=kind)

    async def apply(self, body: dict[str, Any], *, status: bool = False) -> dict[str, Any]:
        """Server-side apply; identical content writes nothing (resourceVersion stays)."""
        dyn = await self.dyn()
        res = await self._resource(body["apiVersion"], body["kind"])
        if status:
            res = res.subresources["status"]
        meta = body["metadata"]
        out = await dyn.server_side_apply(
            res,
            body=body,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=c.FIELD_MANAGER,
            force_conflicts=True,
        )
        return _checked(out)

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """One object, or None; only for start-up checks, everything else reads Kopf's indexes."""
        dyn = await self.dyn()
        res = await self._resource(api_version, kind)
        try:
            return _checked(await dyn.get(res, name=name, namespace=namespace))
        except NotFoundError:
            return None
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """False when it was already gone."""
        dyn = await self.dyn()
        res = await self._resource(api_version, kind)
        try:
            _checked(await dyn.delete(res, name=name, namespace=namespace))
        except NotFoundError:
            return False
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

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
        dyn = await self.dyn()
        res = await self._resource(api_version, kind)
        try:
            _checked(
                await dyn.patch(
                    res,
                    body=cast(Any, ops),  # a JSON patch is a list; the stubs know only objects
                    name=name,
                    namespace=namespace,
                    content_type="application/json-patch+json",
                )
            )
        except NotFoundError:
            if missing_ok:
                return False
            raise
        except ApiException as exc:
            if missing_ok and exc.status in (404, 422):
                return False
            raise
        return True

    async def patch_status(
        self, api_version: str, kind: str, name: str, namespace: str | None, status: Any
    ) -> None:
        """Merge-patch the status subresource (the operator owns every status field of its CRDs)."""
        dyn = await self.dyn()
        res = (await self._resource(api_version, kind)).subresources["status"]
        WRITES.labels(kind, "patch-status").inc()  # counted when sent: a refused write is a write too
        _checked(
            await dyn.patch(
                res,
                body={"status": status},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
        )

    async def whoami(self) -> str:
        """The username the API server sees for these credentials (SelfSubjectReview)."""
        api = client.AuthenticationV1Api(self.api)
        body = client.V1SelfSubjectReview(api_version="authentication.k8s.io/v1", kind="SelfSubjectReview")
        review = await api.create_self_subject_review(body)
        return str(review.status.user_info.username)

    async def close(self) -> None:
        await self.api.close()
