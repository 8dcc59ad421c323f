"""Start the operator: Kopf settings under gpuslice's own names, credentials, policies, then handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

import kopf

from gpuslice import __version__, metrics, metrics_auth
from gpuslice import constants as c
from gpuslice.logs import get
from gpuslice.operator import nodes
from gpuslice.operator.config import OperatorConfig
from gpuslice.operator.kube import Kube, load_config
from gpuslice.operator.state import OperatorState

log = get(__name__)

#: Events posted at once (see `configure_kopf`).
POSTING_WORKERS = 8


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Everything Kopf writes to objects carries gpuslice's names, not kopf.zalando.org."""
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.KOPF_PROGRESS_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.KOPF_PROGRESS_PREFIX, key=c.KOPF_DIFFBASE_ANNOTATION.split("/", 1)[1]
    )
    settings.peering.name = c.PEERING_NAME
    settings.peering.clusterwide = True
    settings.peering.mandatory = False
    # Keep-alives come every 1-5 s at 10 s; a standby takes over that long after the active one died.
    settings.peering.lifetime = config.peering_lifetime
    # Only warnings become Kubernetes Events automatically; transitions are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "gpuslice-operator"
    settings.posting.event_name_prefix = "gpuslice-"
    # Kopf posts each object's Events from a worker of its own, on a connection pool without a limit:
    # a burst of slices opened one TLS connection per posting slice (each holds ~0.2 MiB of buffers
    # until it is closed). A few workers that exit soon after their last Event post as fast.
    settings.posting.worker_limit = POSTING_WORKERS
    settings.posting.idle_timeout = 0.1
    settings.watching.server_timeout = 300
    # A per-object worker keeps the last event's body while it idles; Kopf's 5 s default kept a
    # decoded body per slice and per claim alive through a whole burst.
    settings.queueing.idle_timeout = 0.5
    # "Handler succeeded" for every watch event is noise at 5,000 slices; warnings and errors stay.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    nodes.select(settings, config)
    # No queueing.worker_limit: Kopf indexes objects inside their workers and holds every handler until
    # all indexes are filled, so a limit below the number of objects deadlocks the start-up.


def own_namespace(username: str) -> list[str]:
    """The namespace of a service account user (`system:serviceaccount:<ns>:<name>`); none otherwise."""
    parts = username.split(":")
    return [parts[2]] if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"] else []


async def _prepare(config: OperatorConfig) -> OperatorState:
    api = await load_config(config.kubeconfig)
    kube = Kube(api)
    me = await kube.whoami()
    identities = tuple(dict.fromkeys([me, *config.operator_identities]))
    exempt = tuple(dict.fromkeys([*config.exempt_namespaces, *own_namespace(me)]))
    update = {
        "operator_identities": identities,
        "exempt_namespaces": exempt,
        "ledger_namespace": (own_namespace(me) or [config.ledger_namespace])[0],
    }
    state = OperatorState(config=config.model_copy(update=update), kube=kube)
    return state


def _in_cluster(info: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo | None:
    """Kopf's service-account login names the API server `https://kubernetes.default.svc` (cluster
    DNS); client-go and kubernetes_asyncio use KUBERNETES_SERVICE_HOST/PORT, which kubelet sets in
    every pod. Use those too, so both clients reach the same address, with or without cluster DNS."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is None or not host or not port:
        return info
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    return dataclasses.replace(info, server=server)


async def adapt_to_platform(state: OperatorState) -> None:
    """Read what the API server serves (domain.features) and switch off what it lacks, saying so in the
    log and in every GpuPackage's KubernetesFeatures condition; a version outside the tested ones is
    logged, never fatal. Unread (a refused probe): every feature stays on, and the writes still see."""
    from gpuslice import kubehttp, platform
    from gpuslice.domain import features

    try:
        # ResourceSlices are the agents' to write: they probe the counters (and refuse to publish).
        found = await platform.read_platform(state.kube.api, slices=False)
    except (kubehttp.ApiError, OSError, TimeoutError) as exc:
        log.warning("could not read what the API server serves; assuming every feature", error=str(exc))
        return
    state.platform = found
    platform.log_platform(found, "operator")
    if not found.on(features.EXTENDED_RESOURCES):
        state.extended_resource_dropped = True


def _register_startup(state: OperatorState) -> None:
    from gpuslice.operator import ledger, packages, policies, slices, tenancy  # noqa: F401  (registers handlers)

    # Timers take their intervals from the configuration, so they are registered now, not at import.
    slices.register(state.config)
    packages.register(state.config)
    nodes.register(state.config)

    @kopf.on.startup()
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, state.config)
        state.workloads.start(state.kube.api)
        await adapt_to_platform(state)
        await policies.apply_policies(state)

    @kopf.on.login()
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Kopf's default login handlers read KUBECONFIG when their client library is imported, which
        # is too early for --kubeconfig; its own parser reads it now.
        if state.config.kubeconfig or os.environ.get("KUBECONFIG"):
            return kopf.login_with_kubeconfig(**kwargs)
        return _in_cluster(kopf.login_with_service_account(**kwargs)) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup()
    async def cleanup(**_: Any) -> None:
        await state.workloads.stop()
        await state.kube.close()


async def run_async(config: OperatorConfig, stop_flag: asyncio.Event | None = None) -> None:
    if config.kubeconfig:
        # Kopf's own login reads KUBECONFIG; both clients must talk to the same cluster.
        os.environ["KUBECONFIG"] = config.kubeconfig
    state = await _prepare(config)
    log.info("operator starting", version=__version__, identities=list(state.config.operator_identities))
    metrics.OPERATOR_BUILD_INFO.labels(*metrics.build_info_labels("operator")).set(1)
    _register_startup(state)
    if config.metrics_port is not None:
        # The series name tenants' namespaces, slices and pods: readers are authenticated and
        # authorized by the API server, as for the agent's and Kubernetes' own components' metrics.
        gate = metrics_auth.MetricsGate(metrics_auth.reviewer(state.kube.api), asyncio.get_running_loop())
        tls = metrics_auth.serving_certificate(
            config.metrics_tls_cert_file, config.metrics_tls_private_key_file
        )
        metrics_auth.serve_protected(config.metrics_port, metrics.OPERATOR_REGISTRY, gate, tls=tls)
    await kopf.operator(
        clusterwide=True,
        standalone=config.standalone,
        priority=config.priority,
        peering_name=c.PEERING_NAME,
        liveness_endpoint=config.liveness_endpoint,
        memo=kopf.Memo(state=state),
        stop_flag=stop_flag,
    )


def run(config: OperatorConfig) -> int:
    asyncio.run(run_async(config))
    return 0
