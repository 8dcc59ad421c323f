"""`gpuslice operator`: run the operator against the current kubeconfig (in-cluster config in a pod)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from pydantic import ValidationError

from gpuslice import constants as c
from gpuslice.metrics_auth import metrics_auth_flags


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "operator",
        help="run the gpuslice operator (GpuPackage/GpuSlice -> DeviceClasses, quotas, policies, claims)",
        description=__doc__,
    )
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)",
    )
    p.add_argument(
        "--operator-identity",
        action="append",
        default=[],
        metavar="USER",
        help="a username (e.g. system:serviceaccount:gpuslice-system:gpuslice-operator) allowed to "
        "write gpuslice-owned objects besides the operator's own identity, which it asks the API server "
        "for; repeatable",
    )
    p.add_argument(
        "--memory-floor",
        default=os.environ.get("GPUSLICE_MEMORY_FLOOR", "1Gi"),
        help="warn at admission when a container holding a slice has a memory limit below this (default 1Gi)",
    )
    p.add_argument(
        "--pod-security",
        choices=("baseline", "restricted"),
        default="baseline",
        help="Pod Security level enforced on every tenant namespace (default baseline; never weaker)",
    )
    p.add_argument(
        "--exempt-namespace",
        action="append",
        default=None,
        metavar="NS",
        help="a platform namespace whose pods may tolerate the GPU node taint; repeatable (default: "
        "kube-system; the operator's own namespace is always exempt)",
    )
    p.add_argument(
        "--max-gpuslices-per-namespace",
        type=int,
        default=c.DEFAULT_MAX_SLICES_PER_NAMESPACE,
        metavar="N",
        help="GpuSlice objects a tenant namespace may hold, whatever its entitlements (ResourceQuota "
        f"{c.COUNT_QUOTA_NAME}; default {c.DEFAULT_MAX_SLICES_PER_NAMESPACE}): a slice waiting past the "
        "entitlement still costs the operator work",
    )
    p.add_argument(
        "--tenant-priority-class",
        action="append",
        default=[],
        metavar="NAME",
        help="a PriorityClass pods in tenant namespaces may use; repeatable (default: none, so a tenant "
        "cannot preempt another tenant's pods). List the cluster's globalDefault class, if it has one",
    )
    p.add_argument(
        "--gpu-node-label",
        default="nvidia.com/gpu.present=true",
        metavar="KEY=VALUE",
        help="nodes with this label are GPU nodes: the operator keeps the taint gpuslice.io/gpu="
        "present:NoExecute on them (default nvidia.com/gpu.present=true; empty: no tainting)",
    )
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="Kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port, to bearer tokens the API server allows GET /metrics",
    )
    metrics_auth_flags(p)
    p.add_argument(
        "--peering", action="store_true", help="use Kopf peering (needs its ClusterKopfPeering CRD) for HA"
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=10,
        metavar="SECONDS",
        help="how long a replica's peering record lives without a keep-alive, so how long a standby "
        "waits for an active replica that died (default 10; Kopf's own default is 60)",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="Kopf peering priority; the replica with the highest is active (default: random per start, "
        "so two replicas never tie)",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="safety-net resync of every GpuSlice's status (default 30)",
    )
    p.add_argument(
        "--recheck-seconds",
        type=float,
        default=5.0,
        help="re-read of what no event announces (capacity for Pending slices and package status) and "
        "retry delay of a refused write (default 5)",
    )
    p.add_argument(
        "--ledger-checkpoint-seconds",
        type=float,
        default=900.0,
        help="how often a GpuUsage object with slices still held is rewritten with its totals so far "
        "(default 900; every change is written at once)",
    )
    p.add_argument(
        "--ledger-heartbeat-seconds",
        type=float,
        default=10.0,
        help="how often, while slices are held, Lease gpuslice-ledger records that every open interval "
        "was still held; a slice released while no operator runs is billed until then (default 10)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Kopf imports the generated kubernetes_asyncio models when they are installed (~40 MiB resident)
    # only to recognise their objects and for a login handler the operator does not use: keep it out.
    sys.modules.setdefault("kubernetes_asyncio", None)  # type: ignore[arg-type]
    from gpuslice import logs
    from gpuslice.operator.config import OperatorConfig
    from gpuslice.operator.run import run

    logs.configure(args.log_level)
    try:
        config = OperatorConfig(
            kubeconfig=args.kubeconfig,
            operator_identities=tuple(args.operator_identity),
            memory_floor=args.memory_floor,
            pod_security=args.pod_security,
            exempt_namespaces=tuple(args.exempt_namespace or ("kube-system",)),
            gpu_node_label=args.gpu_node_label,
            tenant_priority_classes=tuple(args.tenant_priority_class),
            max_slices_per_namespace=args.max_gpuslices_per_namespace,
            resync_seconds=args.resync_seconds,
            recheck_seconds=args.recheck_seconds,
            ledger_checkpoint_seconds=args.ledger_checkpoint_seconds,
            ledger_heartbeat_seconds=args.ledger_heartbeat_seconds,
            liveness_endpoint=args.liveness,
            metrics_port=args.metrics_port,
            metrics_tls_cert_file=args.metrics_tls_cert_file,
            metrics_tls_private_key_file=args.metrics_tls_private_key_file,
            standalone=not args.peering,
            peering_lifetime=args.peering_lifetime,
            priority=args.priority if args.priority is not None else secrets.randbelow(1_000_000) + 1,
        )
    except ValidationError as exc:
        for err in exc.errors():
            flag = "--" + "-".join(str(x) for x in err["loc"]).replace("_", "-")
            msg = err["msg"] if "--" in err["msg"] else f"{flag}: {err['msg']}"
            print(f"gpuslice operator: {msg}", file=sys.stderr)
        return 2
    if config.kubeconfig and not os.path.isfile(config.kubeconfig):
        print(
            f"gpuslice operator: kubeconfig {config.kubeconfig} does not exist; pass an existing file",
            file=sys.stderr,
        )
        return 2
    try:
        return run(config)
    except (ValueError, KeyError, OSError) as exc:
        print(
            f"gpuslice operator: cannot reach the cluster ({exc}); check --kubeconfig / $KUBECONFIG, "
            "or run it in a pod with a service account",
            file=sys.stderr,
        )
        return 1
