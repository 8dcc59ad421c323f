"""`gpuslice agent`: the node agent (GPU discovery, DRA ResourceSlices, kubelet DRA plugin)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from gpuslice import constants as c
from gpuslice.metrics_auth import metrics_auth_flags


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "agent",
        help="run the node agent",
        description="Discover GPUs with NVML, publish them as DRA ResourceSlices of driver "
        f"{c.DRIVER_NAME} and serve the kubelet DRA plugin.",
    )
    p.add_argument("--node", required=True, help="name of the Node this agent runs on (the pool name)")
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--plugins-dir", type=Path, default=Path(c.KUBELET_PLUGINS_DIR),
                   help="kubelet plugins dir; the DRA socket is <dir>/gpuslice.io/dra.sock")  # fmt: skip
    p.add_argument("--registry-dir", type=Path, default=Path(c.KUBELET_REGISTRY_DIR),
                   help="kubelet plugin registry dir (registration socket)")  # fmt: skip
    p.add_argument("--cdi-dir", type=Path, default=Path(c.CDI_DIR), help="where CDI specs are written")
    p.add_argument("--state-dir", type=Path, default=Path(c.HOST_STATE_DIR),
                   help="checkpoint and per-claim files")  # fmt: skip
    p.add_argument("--run-dir", type=Path, default=Path(c.HOST_RUN_DIR), help="per-slice usage regions")
    p.add_argument(
        "--shim-library",
        type=Path,
        help="libgpuslice.so on the host (default: the installed one)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)"
    )
    metrics_auth_flags(p)
    p.add_argument(
        "--usage-interval",
        type=float,
        default=10.0,
        help="seconds between usage readings written into GpuSlice status (at most one write per slice each)",
    )
    p.add_argument(
        "--idle-after",
        type=float,
        default=600.0,
        help="seconds a prepared slice may go without any process using the GPU before status.usage "
        "says so (gpuIdleSince: software that fell back to the CPU)",
    )
    p.add_argument(
        "--stop-violators",
        action="store_true",
        help="deprecated, ignored: each GpuPackage's spec.isolation.onViolation (Report|Stop, default "
        "Stop) decides whether a process past its slice is stopped",
    )
    p.add_argument(
        "--nvidia-toolkit-config",
        type=Path,
        default=None,
        help="the NVIDIA container toolkit config to check (default: $GPUSLICE_NVIDIA_TOOLKIT_CONFIG, "
        "else /etc/nvidia-container-runtime/config.toml); while it lets containers take GPUs outside "
        "CDI claims the agent publishes no devices. An absent file (no NVIDIA runtime) is safe",
    )
    p.add_argument(
        "--mig-layout",
        choices=("dynamic", "static"),
        default=os.environ.get(c.MIG_LAYOUT_ENV) or "dynamic",
        help="cards in MIG mode: dynamic (default) makes each claim's instance at prepare at the placement "
        "kube-scheduler chose; static sells the instances the platform made (read at start), as they are "
        f"(default: ${c.MIG_LAYOUT_ENV}, else dynamic)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from gpuslice import logs
    from gpuslice.agent import toolkit
    from gpuslice.agent.gpus import DiscoveryError
    from gpuslice.agent.service import AgentError, AgentOptions, run

    logs.configure(args.log_level)
    opts = AgentOptions(
        node=args.node,
        kubeconfig=args.kubeconfig,
        plugins_dir=args.plugins_dir,
        registry_dir=args.registry_dir,
        cdi_dir=args.cdi_dir,
        state_dir=args.state_dir,
        run_dir=args.run_dir,
        shim_library=args.shim_library,
        metrics_port=args.metrics_port,
        metrics_tls_cert_file=args.metrics_tls_cert_file,
        metrics_tls_private_key_file=args.metrics_tls_private_key_file,
        usage_interval=args.usage_interval,
        idle_after=args.idle_after,
        stop_violators=args.stop_violators,
        nvidia_toolkit_config=args.nvidia_toolkit_config or toolkit.default_config_path(),
        mig_layout=args.mig_layout,
    )
    if args.stop_violators:
        logs.get("gpuslice.agent").warning(
            "--stop-violators is ignored: GpuPackage spec.isolation.onViolation decides (default Stop)"
        )
    try:
        return asyncio.run(run(opts))
    except (AgentError, DiscoveryError) as exc:
        logs.get("gpuslice.agent").error(str(exc))
        return 1
