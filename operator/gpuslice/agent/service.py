"""`gpuslice agent`: discover GPUs, publish them, serve the kubelet plugin, clean up on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

from gpuslice import __version__, kubehttp, logs, metrics, metrics_auth, platform
from gpuslice import constants as c
from gpuslice.agent import gpus as gpus_mod
from gpuslice.agent import plugin, toolkit
from gpuslice.agent.ahead import PrepareAhead
from gpuslice.agent.attribution import package_policy
from gpuslice.agent.health import HealthMonitor, checkpoint_claims, checkpoint_slices
from gpuslice.agent.kube import Kube, api_client
from gpuslice.agent.prepare import NodePaths, Preparer
from gpuslice.agent.publisher import Publisher
from gpuslice.agent.usage import UsageReporter
from gpuslice.agent.utilization import UtilizationFeedback
from gpuslice.agent.violations import ViolationEnforcer
from gpuslice.domain import features
from gpuslice.files import remove_stale_temp_files

log = logs.get(__name__)

#: sun_path of a unix socket address is 108 bytes including the terminating NUL
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class AgentOptions:
    node: str
    kubeconfig: Path | None
    plugins_dir: Path
    registry_dir: Path
    cdi_dir: Path
    state_dir: Path
    run_dir: Path
    shim_library: Path | None
    metrics_port: int
    usage_interval: float = 10.0
    metrics_tls_cert_file: Path | None = None
    metrics_tls_private_key_file: Path | None = None
    idle_after: float = 600.0
    stop_violators: bool = False  # deprecated, ignored: GpuPackage spec.isolation.onViolation decides
    nvidia_toolkit_config: Path = toolkit.DEFAULT_CONFIG
    #: "dynamic": MIG instances made at prepare; "static": the instances the platform made, sold as they are
    mig_layout: str = "dynamic"


class AgentError(RuntimeError):
    pass


def _shim_library(opts: AgentOptions) -> Path:
    if opts.shim_library is not None:
        return opts.shim_library
    return Path(c.HOST_SHIM_DIR) / "libgpuslice.so"


def check_socket_paths(opts: AgentOptions) -> None:
    for path in (
        plugin.dra_socket_path(opts.plugins_dir),
        plugin.registration_socket_path(opts.registry_dir),
    ):
        if len(str(path)) > MAX_SOCKET_PATH:
            raise AgentError(
                f"unix socket path {path} is {len(str(path))} bytes, over the {MAX_SOCKET_PATH}-byte limit; "
                "pass a shorter --plugins-dir / --registry-dir"
            )


async def _adapt_to_platform(api: kubehttp.Client, kube: Kube, publisher: Publisher) -> None:
    """What this API server keeps decides what may be published (domain.features): nothing where it
    drops the counters, no unhealthy card where it drops device taints. Unread: published as usual,
    and the publish itself still checks what came back."""
    try:
        # (DeviceClasses are the operator's: the agent may not write them, not even in a dry run)
        found = await platform.read_platform(api, device_class=False, node=publisher.node)
    except (kubehttp.ApiError, OSError, TimeoutError) as exc:
        log.warning("could not read what the API server serves; publishing as usual", error=str(exc))
        return
    platform.log_platform(found, "agent")
    publisher.taints_dropped = not found.on(features.DEVICE_TAINTS)
    if refusal := found.publish_refusal:
        publisher.refuse(refusal)
        record = toolkit.node_event_recorder(kube, publisher.node, lambda: None)
        await record("Warning", "GpuSlicePublishingRefused", refusal)


async def run(opts: AgentOptions) -> int:
    log.info("agent starting", version=__version__, node=opts.node)
    metrics.AGENT_BUILD_INFO.labels(*metrics.build_info_labels("agent")).set(1)
    check_socket_paths(opts)
    gpus = gpus_mod.with_remembered(gpus_mod.discover(static_mig=opts.mig_layout == "static"), opts.state_dir)
    log.info(
        "GPUs discovered", node=opts.node, count=len(gpus),
        gpus=[f"{g.index}:{g.product_name}:{g.uuid}:cc{g.cuda_compute_capability}" for g in gpus],
        driver=gpus[0].driver_version if gpus else None,
    )  # fmt: skip
    api = api_client(opts.kubeconfig)
    kube = Kube(api)
    # Zero from the start, so "no prepare failed" is a 0 on the dashboard and in alerts, not no data.
    metrics.PREPARE_ERRORS.labels(node=opts.node)
    if opts.metrics_port:
        # Every tenant's usage is in these series: readers are authenticated and authorized by the
        # API server, as for Kubernetes' own components.
        gate = metrics_auth.MetricsGate(metrics_auth.reviewer(api), asyncio.get_running_loop())
        tls = metrics_auth.serving_certificate(opts.metrics_tls_cert_file, opts.metrics_tls_private_key_file)
        metrics_auth.serve_protected(opts.metrics_port, metrics.AGENT_REGISTRY, gate, tls=tls)
    paths = NodePaths(opts.state_dir, opts.run_dir, opts.cdi_dir, _shim_library(opts))
    # An agent killed while writing a CDI spec leaves its temporary file beside the specs.
    if opts.cdi_dir.is_dir():
        for stale in remove_stale_temp_files(opts.cdi_dir, f"{c.CDI_VENDOR}-{c.CDI_CLASS}-"):
            log.info("removed a killed agent's temporary CDI file", file=str(stale))
    preparer = Preparer(opts.node, paths, kube.get_claim, lambda: kube.list_pool_slices(opts.node), gpus)
    servers = await plugin.start(preparer, opts.plugins_dir, opts.registry_dir)
    ahead = PrepareAhead(opts.node, preparer, kube.get_claim)
    publisher = Publisher(opts.node, gpus, kube)
    await _adapt_to_platform(api, kube, publisher)
    # no devices are published while the NVIDIA toolkit would hand cards to claim-less containers
    guard = toolkit.ToolkitGuard(
        opts.node, opts.nvidia_toolkit_config, publisher.set_blocked,
        toolkit.node_event_recorder(kube, opts.node, lambda: publisher.node_uid),
    )  # fmt: skip
    await guard.step()

    async def follow_packages() -> None:
        async for kind, obj in kube.watch_packages():
            if kind == "LIST":
                assert isinstance(obj, list)
                publisher.packages_listed(obj)
            else:
                assert isinstance(obj, dict)
                publisher.package_event(kind, obj)

    async def follow_node() -> None:
        async for kind, obj in kube.watch_node(opts.node):
            if kind == "LIST":
                assert isinstance(obj, list)
                publisher.node_seen(obj[0] if obj else None)
            else:
                assert isinstance(obj, dict)
                publisher.node_seen(None if kind == "DELETED" else obj)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    enforcer = ViolationEnforcer(
        opts.node, kube, policy=lambda name: package_policy(publisher.packages, name)
    )
    reporter = UsageReporter(opts.node, paths, kube, enforcer, opts.usage_interval, opts.idle_after)
    feedback = UtilizationFeedback(paths)
    monitor = HealthMonitor(
        opts.node, gpus, publisher.set_taints,
        toolkit.node_event_recorder(kube, opts.node, lambda: publisher.node_uid),
        checkpoint_slices(paths, kube, opts.node), kube, checkpoint_claims(paths),
    )  # fmt: skip
    tasks = [
        asyncio.create_task(coro)
        for coro in (
            follow_packages(), follow_node(), publisher.run(), reporter.run(), feedback.run(), guard.run(),
            monitor.run(), ahead.follow(kube.watch_node_pods(opts.node)),
        )
    ]  # fmt: skip
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper:
                task.result()  # a watcher or publisher ended: surface why
        log.info("stopping", node=opts.node)
        return 0
    finally:
        for task in [*tasks, stopper]:
            task.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)
        if servers.registration_service.registered:
            # A rollout stops this agent before the next one registers: the pool stays on sale
            # meanwhile, and kubelet deletes it itself if no plugin of the driver registers again
            # within its wiping delay (30 s), as for every DRA driver (uninstall).
            log.info("leaving the pool to kubelet", node=opts.node)
        else:
            try:
                await publisher.withdraw()
            except Exception as exc:  # shutdown goes on; the Node owns the slices anyway
                log.error("could not withdraw slices", error=str(exc))
        await servers.stop()
        await api.close()
