"""`gpuslice-dev devcluster up|down|status|load-image|build|gpu-fault`: the local control plane."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gpuslice_dev.devcluster.binaries import (
    DEFAULT_KUBERNETES,
    KUBERNETES_ENV,
    KUBERNETES_RELEASES,
    BuildError,
    ensure_binaries,
)
from gpuslice_dev.devcluster.cluster import DevCluster, DevClusterError, default_dir


def _progress(msg: str) -> None:
    print(f"[devcluster] {msg}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "devcluster",
        help="a real local Kubernetes control plane (etcd, apiserver, controller-manager, scheduler, kwok)",
        description=__doc__,
    )
    cmds = p.add_subparsers(dest="devcluster_command", metavar="ACTION", required=True)

    def with_dir(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--dir", type=Path, default=None, help=f"state directory (default: {default_dir()})")

    # --- Kubernetes versions: which minor the binaries and the cluster are -------------------------
    def with_kubernetes(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--kubernetes",
            choices=sorted(KUBERNETES_RELEASES),
            default=None,
            metavar="MINOR",
            help="Kubernetes minor: "
            + ", ".join(f"{k} ({v})" for k, v in KUBERNETES_RELEASES.items())
            + f" (default: ${KUBERNETES_ENV}, else {DEFAULT_KUBERNETES})",
        )

    up = cmds.add_parser("up", help="build (first time) and start the control plane")
    with_dir(up)
    with_kubernetes(up)
    up.add_argument(
        "--feature-gates",
        default="",
        metavar="GATES",
        help="feature gates on top of the minor's own set, for every component and kubelet, e.g. "
        "DRADeviceTaints=false (a platform that turned one off)",
    )
    up.add_argument(
        "--emulated-version",
        default="",
        metavar="MINOR",
        help="kube-apiserver emulates this older minor (1.34 to the binaries' own), with its default "
        "gates: a platform on a minor older than the ones built here, e.g. 1.34 (unsupported)",
    )
    up.add_argument(
        "--nodes", type=int, default=1, help="number of kwok fake nodes that stay Ready (default 1)"
    )
    up.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        metavar="M",
        help="also start M real nodes (kubelet + containerd + runc on this machine; needs root)",
    )
    up.add_argument(
        "--simulate-gpus",
        default=None,
        metavar="SPEC",
        help='start one node agent per node over simulated GPUs, e.g. "2x Tesla V100-PCIE-32GB"',
    )
    # --- Prometheus (gpuslice_dev.devcluster.prometheus) ---
    up.add_argument(
        "--with-prometheus",
        action="store_true",
        help="also a real Prometheus on loopback, scraping the way the shipped ServiceMonitor says",
    )
    # --- Kueue (gpuslice_dev.devcluster.kueue) ---
    up.add_argument(
        "--with-kueue",
        action="store_true",
        help="also a real Kueue (built from sigs.k8s.io/kueue): its CRDs, RBAC, webhooks and controller",
    )
    up.add_argument(
        "--kueue-fair-sharing",
        action="store_true",
        help="with --with-kueue: Kueue's Configuration enables fair sharing (ClusterQueue weights "
        "decide how borrowers split a cohort's idle quota; off by default, as Kueue ships it)",
    )
    up.set_defaults(func=_up)

    down = cmds.add_parser("down", help="stop every process of the control plane")
    with_dir(down)
    down.set_defaults(func=_down)

    status = cmds.add_parser("status", help="say which components run")
    with_dir(status)
    status.set_defaults(func=_status)

    load = cmds.add_parser(
        "load-image", help="import an OCI or docker image archive into every real node (no registry)"
    )
    with_dir(load)
    load.add_argument("archive", type=Path, metavar="PATH", help="e.g. build/gpuslice-image.oci.tar")
    load.set_defaults(func=_load_image)

    build = cmds.add_parser("build", help="only build (or find cached) control-plane binaries")
    with_kubernetes(build)
    build.add_argument(
        "--with-node",
        action="store_true",
        help="also the real nodes' binaries (kubelet, containerd, runc, CNI, crictl, crane) and images",
    )
    build.set_defaults(func=_build)

    from gpuslice_dev.devcluster import gpu_fault

    gpu_fault.register(cmds, with_dir)


def _up(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.real_nodes < 0:
        print("error: --real-nodes must be 0 or more", file=sys.stderr)
        return 1
    if args.simulate_gpus:
        from gpuslice_dev.gpusim.simulate import GpuSpecError, parse_gpu_spec

        try:  # a bad spec fails before anything starts
            parse_gpu_spec(args.simulate_gpus, seed="check")
        except GpuSpecError as exc:
            print(f"error: --simulate-gpus: {exc}", file=sys.stderr)
            return 1
    try:
        cluster = DevCluster(
            args.dir,
            progress=_progress,
            kubernetes=args.kubernetes,
            extra_feature_gates=args.feature_gates,
            emulated_version=args.emulated_version,
        )
        cluster.up(nodes=args.nodes)
        if args.real_nodes:
            from gpuslice_dev.devcluster.realnode import start_real_nodes

            start_real_nodes(cluster, args.real_nodes)
        if args.simulate_gpus:
            from gpuslice_dev.devcluster.node_agents import start_agents

            start_agents(cluster, args.simulate_gpus, progress=_progress, metrics=args.with_prometheus)
        if args.with_prometheus:
            from gpuslice_dev.devcluster.prometheus import start_devcluster_prometheus

            _progress(f"prometheus on {start_devcluster_prometheus(cluster, progress=_progress)}")
        if args.with_kueue:
            from gpuslice_dev.devcluster.kueue import start_devcluster_kueue

            start_devcluster_kueue(cluster, progress=_progress, fair_sharing=args.kueue_fair_sharing)
            _progress("kueue ready")
    except (BuildError, DevClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _progress(f"ready in {time.monotonic() - started:.1f}s; logs in {cluster.dir / 'logs'}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


def _down(args: argparse.Namespace) -> int:
    cluster = DevCluster(args.dir, progress=_progress)
    stopped = cluster.down()
    _progress(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = DevCluster(args.dir)
    st = cluster.state()
    if st is None:
        print(f"no devcluster in {cluster.dir}")
        return 1
    running = cluster.status()
    for name, alive in running.items():
        rec = st.processes[name]
        extra = f"pid {rec.pid}, rss {rec.rss_bytes() / 2**20:.0f} MiB" if alive else "stopped"
        print(f"{name:26} {'running' if alive else 'NOT RUNNING':12} {extra}")
    if not running:
        print("nothing running (run `gpuslice-dev devcluster up`)")
    else:
        print(f"kubeconfig: {cluster.kubeconfig}")
        if "prometheus" in st.ports and running.get("prometheus"):
            print(f"prometheus: http://127.0.0.1:{st.ports['prometheus']}")
    return 0 if running and all(running.values()) else 1


def _load_image(args: argparse.Namespace) -> int:
    from gpuslice_dev.devcluster.realnode import import_image

    cluster = DevCluster(args.dir, progress=_progress)
    try:
        nodes = import_image(cluster, args.archive)
    except (BuildError, DevClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _progress(f"imported {args.archive} into {', '.join(nodes)}")
    return 0


def _build(args: argparse.Namespace) -> int:
    built: dict[str, object] = {}
    try:
        built.update(vars(ensure_binaries(_progress, args.kubernetes)))
        if args.with_node:
            from gpuslice_dev.devcluster.images import ensure_images
            from gpuslice_dev.devcluster.node_binaries import ensure_node_binaries

            built.update(vars(ensure_node_binaries(_progress, args.kubernetes)))
            built.update({img.ref: img.path for img in ensure_images(_progress)})
            # The tools tests use besides the cluster, built once here rather than inside a test.
            from gpuslice_dev.tools import ensure_helm, prometheus_operator_crds

            built["helm"] = ensure_helm(_progress)
            from gpuslice_dev.devcluster.prometheus import ensure_prometheus

            built.update(vars(ensure_prometheus(_progress)))
            from gpuslice_dev.devcluster.kueue import ensure_kueue

            built.update(vars(ensure_kueue(_progress)))
            built.update({p.name: p for p in prometheus_operator_crds(_progress)})
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in built.items():
        print(f"{name:30} {path}")
    return 0
