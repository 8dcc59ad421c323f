"""Who may read /metrics, decided the way Kubernetes' own components decide it (their delegated
authentication and authorization): the request's bearer token goes to the API server in a
TokenReview, and the user it names in a SubjectAccessReview of the non-resource URL /metrics, verb
get. The agent's series carry every tenant's namespace and memory use, the operator's every
allocated slice's namespace, name and pod; any pod that can reach either port must not read them.
Prometheus' service account gets the right from a ClusterRole (`nonResourceURLs: [/metrics]`,
`verbs: [get]`), as for the kubelet's and the API server's metrics.

With a serving certificate (`ServingCertificate`: a PEM certificate and key, e.g. a Secret of type
kubernetes.io/tls or cert-manager's `tls.crt`/`tls.key`, mounted as files) the port speaks only
HTTPS, as kube-apiserver's and the kubelet's do with `--tls-cert-file`: a plain HTTP request fails
the TLS handshake, and neither the token nor the series cross the network in clear. The files are
read again when they change (a rotated Secret), at the next connection, without a restart.

The HTTP server runs in its own thread; the reviews run on the process's event loop (its API client
lives there) and are cached for a minute per token (ten seconds when refused), so a scrape every 30 s
costs the API server two small requests a minute at most.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock, Thread
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from gpuslice import kubehttp, logs

log = logs.get(__name__)

#: (HTTP status, message): 200 to serve, 401 no or a bad token, 403 not allowed, 503 no answer.
Verdict = tuple[int, str]
Review = Callable[[str], Coroutine[Any, Any, Verdict]]

PATH = "/metrics"


def reviewer(api: kubehttp.Client) -> Review:
    """TokenReview, then SubjectAccessReview of GET /metrics, through `api` (the process's identity,
    which needs `create` on tokenreviews and subjectaccessreviews: system:auth-delegator)."""

    async def review(token: str) -> Verdict:
        answer = await api.create(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
        )
        status = (answer or {}).get("status") or {}
        if not status.get("authenticated"):
            return 401, "the bearer token is not valid: send a service account token"
        user = status.get("user") or {}
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "groups": user.get("groups") or [],
            "nonResourceAttributes": {"path": PATH, "verb": "get"},
        }
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        answer = await api.create(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
        )
        if ((answer or {}).get("status") or {}).get("allowed"):
            return 200, ""
        return 403, (
            f"{spec['user']} may not get {PATH}: grant it a ClusterRole with nonResourceURLs "
            f"[{PATH}] and verbs [get] (as for Prometheus)"
        )

    return review


@dataclass
class MetricsGate:
    """Decides each request from its Authorization header; called from the server's threads."""

    review: Review
    loop: asyncio.AbstractEventLoop
    allowed_ttl: float = 60.0
    refused_ttl: float = 10.0
    timeout: float = 10.0
    _cache: dict[str, tuple[float, Verdict]] = field(default_factory=dict)
    _lock: Lock = field(default_factory=Lock)

    def check(self, authorization: str | None) -> Verdict:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, f"{PATH} needs a bearer token (Authorization: Bearer <service account token>)"
        key = hashlib.sha256(token.encode()).hexdigest()  # tokens themselves are not kept
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached and cached[0] > now:
                return cached[1]
        try:
            verdict: Verdict = asyncio.run_coroutine_threadsafe(self.review(token), self.loop).result(
                self.timeout
            )
        except Exception as exc:  # the API server did not answer: refuse, do not cache
            log.warning("could not review a metrics request's token", error=str(exc))
            return 503, "the API server could not be asked whether this token may read metrics; try again"
        ttl = self.allowed_ttl if verdict[0] == 200 else self.refused_ttl
        with self._lock:
            if len(self._cache) > 1024:  # many tokens: start over rather than grow
                self._cache.clear()
            self._cache[key] = (now + ttl, verdict)
        return verdict


@dataclass
class ServingCertificate:
    """A certificate and key in PEM files; `context()` loads them again whenever either changes."""

    cert_file: Path
    key_file: Path
    _stamp: tuple[int, ...] | None = None
    _context: ssl.SSLContext | None = None
    _lock: Lock = field(default_factory=Lock)

    def _read_stamp(self) -> tuple[int, ...]:
        a, b = os.stat(self.cert_file), os.stat(self.key_file)
        return (a.st_mtime_ns, a.st_size, a.st_ino, b.st_mtime_ns, b.st_size, b.st_ino)

    def context(self) -> ssl.SSLContext:
        """The context for the next connection. A rotation caught half-written (the new certificate
        with the old key) keeps the previous context until both files agree."""
        with self._lock:
            try:
                stamp = self._read_stamp()
            except OSError as exc:
                if self._context is None:
                    raise
                log.warning("metrics serving certificate unreadable; keeping the loaded one", error=str(exc))
                return self._context
            if stamp != self._stamp or self._context is None:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                try:
                    ctx.load_cert_chain(self.cert_file, self.key_file)
                except (OSError, ssl.SSLError) as exc:
                    if self._context is None:
                        raise ValueError(
                            f"metrics serving certificate {self.cert_file} / key {self.key_file}: {exc}"
                        ) from exc
                    log.warning("new metrics serving certificate not loadable yet", error=str(exc))
                    return self._context
                if self._context is not None:
                    log.info("metrics serving certificate reloaded", cert=str(self.cert_file))
                self._context, self._stamp = ctx, stamp
            return self._context


def serving_certificate(cert_file: Path | None, key_file: Path | None) -> ServingCertificate | None:
    """The certificate of `--metrics-tls-cert-file`/`--metrics-tls-private-key-file`: both or none."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("--metrics-tls-cert-file and --metrics-tls-private-key-file go together: give both")
    return ServingCertificate(cert_file, key_file) if cert_file and key_file else None


def metrics_auth_flags(parser: argparse.ArgumentParser) -> None:
    """The serving-certificate flags of both processes (named as kube-apiserver's --tls-cert-file)."""
    parser.add_argument(
        "--metrics-tls-cert-file",
        type=Path,
        default=None,
        help="PEM certificate (chain) of the metrics port, e.g. a kubernetes.io/tls Secret's tls.crt: "
        "the port then speaks only HTTPS, and the file is read again when it changes",
    )
    parser.add_argument(
        "--metrics-tls-private-key-file", type=Path, default=None, help="its PEM private key (tls.key)"
    )


class _TlsWSGIServer(ThreadingWSGIServer):
    """Wraps each accepted connection in TLS; the handshake runs in the request's own thread (on
    its first read), so a slow or plain-HTTP client never holds up the accept loop."""

    serving: ServingCertificate

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        try:
            wrapped = self.serving.context().wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        except Exception:
            sock.close()
            raise
        return wrapped, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A plain HTTP request or a client that does not trust the certificate: refused, logged once.
        log.info("metrics connection refused in the TLS handshake", client=str(client_address))


def serve_protected(
    port: int,
    registry: CollectorRegistry,
    gate: MetricsGate,
    addr: str = "0.0.0.0",
    tls: ServingCertificate | None = None,
) -> tuple[WSGIServer, Thread]:
    """Serve `registry` on http(s)://addr:port/metrics to those `gate` lets through; HTTPS only
    when `tls` is given."""
    if not 0 < port < 65536:
        raise ValueError(f"metrics port {port} is not a TCP port (1..65535); pass 0 to the caller to disable")
    inner = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        status, message = gate.check(environ.get("HTTP_AUTHORIZATION"))
        if status != 200:
            reason = {401: "Unauthorized", 403: "Forbidden"}.get(status, "Service Unavailable")
            headers = [("Content-Type", "text/plain; charset=utf-8")]
            if status == 401:
                headers.append(("WWW-Authenticate", 'Bearer realm="gpuslice metrics"'))
            start_response(f"{status} {reason}", headers)
            return [message.encode() + b"\n"]
        result: Iterable[bytes] = inner(environ, start_response)
        return result

    server_class: type[WSGIServer] = ThreadingWSGIServer
    if tls is not None:
        tls.context()  # a bad certificate fails at start, not at the first scrape
        serving = tls

        class _Server(_TlsWSGIServer):
            pass

        _Server.serving = serving

        server_class = _Server
    server = make_server(addr, port, app, server_class, handler_class=_SilentHandler)
    thread = Thread(target=server.serve_forever, daemon=True, name="metrics")
    thread.start()
    return server, thread
