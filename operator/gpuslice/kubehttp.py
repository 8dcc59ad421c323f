"""A small Kubernetes REST client on aiohttp: JSON in, dicts out, generic paths.

The node agent makes a handful of calls (ResourceSlice CRUD, one claim read, GpuSlice status merge
patches, Events, two watches), and importing the whole generated kubernetes_asyncio client for them
costs about 60 MiB of resident memory per node. This module does those calls with what aiohttp
already gives: credentials from a kubeconfig (certificate/key files or data, bearer token, CA) or the
in-cluster service account, `ApiError` with the API server's own message, and list-then-watch.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gpuslice.logs import get

log = get(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    """A non-2xx answer: `status` (HTTP code), `reason`, and the API server's Status `message`."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status, self.reason, self.body = status, reason, body
        message = body
        with contextlib.suppress(ValueError, AttributeError):
            message = str(json.loads(body).get("message") or body)
        self.message = message or f"{status} {reason}"
        super().__init__(f"{status} {reason}: {self.message}")


def _material(user: Mapping[str, Any], key: str, base: Path, tmp: list[str]) -> str | None:
    """A file path for `<key>` or `<key>-data` (decoded into a private temporary file)."""
    if user.get(key):
        p = Path(str(user[key]))
        return str(p if p.is_absolute() else base / p)
    data = user.get(f"{key}-data")
    if not data:
        return None
    fd, path = tempfile.mkstemp(prefix="gpuslice-kube-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(base64.b64decode(data))
    tmp.append(path)
    return path


class Config:
    """Server URL, TLS context and headers of one identity."""

    def __init__(self, server: str, ssl_context: ssl.SSLContext | bool, token: str | None = None) -> None:
        self.server = server.rstrip("/")
        self.ssl = ssl_context
        self.token = token

    @classmethod
    def from_kubeconfig(cls, path: Path | str, context: str | None = None) -> Config:
        path = Path(path)
        doc = yaml.safe_load(path.read_text()) or {}
        ctx_name = context or doc.get("current-context")
        ctx = next((c["context"] for c in doc.get("contexts") or [] if c["name"] == ctx_name), None)
        if ctx is None:
            raise ValueError(f"kubeconfig {path}: no context {ctx_name!r}")
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
        users = doc.get("users") or []
        found = [u.get("user") or {} for u in users if u["name"] == ctx.get("user")]
        user: dict[str, Any] = found[0] if found else {}
        tmp: list[str] = []
        try:
            ca = _material(cluster, "certificate-authority", path.parent, tmp)
            if cluster.get("insecure-skip-tls-verify"):
                context_: ssl.SSLContext = ssl.create_default_context()
                context_.check_hostname = False
                context_.verify_mode = ssl.CERT_NONE
            else:
                context_ = ssl.create_default_context(cafile=ca)
            cert = _material(user, "client-certificate", path.parent, tmp)
            key = _material(user, "client-key", path.parent, tmp)
            if cert and key:
                context_.load_cert_chain(cert, key)
        finally:
            for p in tmp:
                os.unlink(p)
        token = user.get("token")
        if not token and user.get("tokenFile"):
            token = Path(user["tokenFile"]).read_text().strip()
        return cls(cluster["server"], context_, token)

    @classmethod
    def in_cluster(cls) -> Config:
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        if ":" in host:
            host = f"[{host}]"
        context_ = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return cls(f"https://{host}:{port}", context_, (SA_DIR / "token").read_text().strip())


def load(kubeconfig: Path | str | None) -> Config:
    """From `kubeconfig`, else in-cluster when running in a pod, else $KUBECONFIG or ~/.kube/config."""
    if kubeconfig is not None:
        return Config.from_kubeconfig(kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        return Config.in_cluster()
    first = (os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")).split(os.pathsep)[0]
    return Config.from_kubeconfig(first)


def path(group: str, version: str, plural: str, name: str | None = None, namespace: str | None = None) -> str:
    """`/api/v1/...` for the core group, `/apis/<group>/<version>/...` otherwise."""
    out = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace:
        out += f"/namespaces/{namespace}"
    out += f"/{plural}"
    return out + (f"/{name}" if name else "")


class Client:
    def __init__(self, config: Config, *, connections: int = 32) -> None:
        self.config = config
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Accept": "application/json", "User-Agent": "gpuslice"}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=self.config.ssl, limit=self._connections),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        seconds: float = 60.0,
    ) -> Any:
        # UTF-8, not \u escapes: an apply patch is read as YAML, which refuses the surrogate pair
        # JSON writes for a character past U+FFFF (an emoji in a package's gpuModel)
        data = None if body is None else json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        async with self.session.request(
            method,
            self.config.server + url_path,
            data=data,
            params=dict(params or {}),
            headers={"Content-Type": content_type} if data is not None else None,
            timeout=aiohttp.ClientTimeout(total=seconds),
        ) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.reason or "", text)
            return json.loads(text) if text else None

    async def text(self, url_path: str) -> str:
        """A non-JSON GET (the API server's /metrics)."""
        async with self.session.get(self.config.server + url_path, headers={"Accept": "text/plain"}) as resp:
            body = await resp.text()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.reason or "", body)
            return body

    async def get(self, url_path: str, **params: str) -> Any:
        return await self.request("GET", url_path, params=params)

    async def create(self, url_path: str, body: Any) -> Any:
        return await self.request("POST", url_path, body)

    async def apply(self, url_path: str, body: Any, field_manager: str, *, force: bool = True) -> Any:
        """Server-side apply of `body` at the object's own path."""
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.request("PATCH", url_path, body, params=params, content_type=APPLY_PATCH)

    async def merge_patch(self, url_path: str, body: Any) -> Any:
        return await self.request("PATCH", url_path, body, content_type=MERGE_PATCH)

    async def json_patch(self, url_path: str, ops: list[dict[str, Any]]) -> Any:
        return await self.request("PATCH", url_path, ops, content_type=JSON_PATCH)

    async def delete(self, url_path: str, *, missing_ok: bool = True, **params: str) -> bool:
        """False when it was already gone (with `missing_ok`)."""
        try:
            await self.request("DELETE", url_path, params=params)
        except ApiError as exc:
            if missing_ok and exc.status == 404:
                return False
            raise
        return True

    async def watch(
        self,
        url_path: str,
        resource_version: str,
        params: Mapping[str, str] | None = None,
        *,
        seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """One watch request: its events (BOOKMARKs included) until the server ends it. An ERROR
        event with code 410 raises ApiError(410): the caller relists."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
            **(params or {}),
        }
        async with self.session.get(
            self.config.server + url_path,
            params=query,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=seconds + 30),
        ) as resp:
            if resp.status >= 300:
                raise ApiError(resp.status, resp.reason or "", await resp.text())
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise ApiError(int(status.get("code") or 500), str(status.get("reason") or ""), "")
                    yield event


async def list_pages_and_watch(
    client: Client, url_path: str, params: Mapping[str, str] | None = None, *, page_size: int = 500
) -> AsyncIterator[tuple[str, Any]]:
    """List-then-watch, the list read a page at a time (a cluster's pods never sit in memory whole):
    ("RELIST", []) when a (re)list begins, ("PAGE", items) per page, ("SYNCED", []) when the list is
    complete, then (event type, object). BOOKMARKs only move the resourceVersion. Relists on 410
    (Gone, also an expired continue token); other failures propagate to the caller's retry."""
    while True:
        try:
            yield "RELIST", []
            token = ""
            while True:
                query = {**(params or {}), "limit": str(page_size)}
                if token:
                    query["continue"] = token
                listing = await client.get(url_path, **query)
                yield "PAGE", list(listing.get("items") or [])
                token = (listing.get("metadata") or {}).get("continue") or ""
                if not token:
                    break
            rv = listing["metadata"]["resourceVersion"]
            yield "SYNCED", []
            while True:
                async for event in client.watch(url_path, rv, params):
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event["type"] != "BOOKMARK":
                        yield event["type"], obj
        except ApiError as exc:
            if exc.status != 410:
                raise
        await asyncio.sleep(0)


async def list_and_watch(client: Client, url_path: str, **params: str) -> AsyncIterator[tuple[str, Any]]:
    """("LIST", items) after every (re)list, then (event type, object) (see `list_pages_and_watch`)."""
    items: list[Any] = []
    async for kind, obj in list_pages_and_watch(client, url_path, params):
        if kind == "RELIST":
            items = []
        elif kind == "PAGE":
            items.extend(obj)
        elif kind == "SYNCED":
            yield "LIST", items
        else:
            yield kind, obj


#: The longest wait between two tries of a failed watch. The wait after an outage is lost time for
#: whoever waits on the watch (an agent republishing its GPUs, slices' statuses): a try costs one
#: connection, so it is kept short. At 30 s, a retry refused while the API server was starting (403
#: before its authorizer is ready) pushed recovery past 30 s after a 5-minute outage
#: (tests/node/test_fault_apiserver_outage.py).
WATCH_RETRY_MAX_SECONDS = 8.0


async def watch_forever(
    client: Client, url_path: str, *, paged: bool = False, page_size: int = 500, **params: str
) -> AsyncIterator[tuple[str, Any]]:
    """`list_and_watch` (or, `paged`, `list_pages_and_watch`) that never ends: a failed connection or
    request relists after a backoff (1 s doubling to `WATCH_RETRY_MAX_SECONDS`, less a random tenth
    so that a node's agents do not come back in step). A resource that is not served (404: its CRD
    not installed yet) counts as empty, an empty listing every 5 s until it is."""
    delay = 1.0
    missing = False
    while True:
        try:
            source = (
                list_pages_and_watch(client, url_path, params, page_size=page_size)
                if paged
                else list_and_watch(client, url_path, **params)
            )
            async for kind, obj in source:
                if kind in ("LIST", "SYNCED"):
                    delay, missing = 1.0, False
                yield kind, obj
        except ApiError as exc:
            if exc.status == 404:
                if not missing:
                    log.warning(
                        "resource not served yet; polling until it is", url=url_path, reason=exc.reason
                    )
                missing = True
                empty: list[tuple[str, Any]] = [("RELIST", []), ("SYNCED", [])] if paged else [("LIST", [])]
                for event in empty:
                    yield event
                await asyncio.sleep(5.0)
                continue
            log.warning(
                "watch failed, relisting", url=url_path, status=exc.status, reason=exc.reason, retry_in=delay
            )
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            log.warning("watch connection failed, relisting", url=url_path, error=str(exc), retry_in=delay)
        await asyncio.sleep(delay * random.uniform(0.9, 1.0))
        delay = min(delay * 2, WATCH_RETRY_MAX_SECONDS)
