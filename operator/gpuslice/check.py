"""`gpuslice check`: is this cluster ready for gpuslice? One line per prerequisite, with the fix.

Like `linkerd check`: reads the cluster (and writes nothing: the probe ResourceSlices are created
with a server-side dry run, which returns what the API server would store), prints a check mark or a
cross per check and what to do about each failure, and exits 1 when any check failed.

The decisions are pure functions of what was read (`evaluate_*`); `_gather` does the reading.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from gpuslice import constants as c
from gpuslice import platform as platform_probe
from gpuslice.api.resourceslice import GATED_FIELDS, dropped_fields, dropped_gates, gates_fix
from gpuslice.domain import features
from gpuslice.timefmt import parse_rfc3339

MIN_MINOR = 36  # partitionable devices and consumable capacity on by default
DRA_GA_MINOR = 34  # resource.k8s.io/v1
RUNTIME_CLASS = "nvidia"
NAMESPACE = c.SYSTEM_NAMESPACE
CRDS = (
    f"{c.PACKAGE_PLURAL}.{c.API_GROUP}",
    f"{c.SLICE_PLURAL}.{c.API_GROUP}",
    f"{c.USAGE_PLURAL}.{c.API_GROUP}",
    "clusterkopfpeerings.kopf.dev",
)
PROBE_DRIVER = platform_probe.PROBE_DRIVER
INSTALL = "kubectl apply --server-side -k manifests/crds && kubectl apply --server-side -k manifests"


class Outcome(StrEnum):
    OK = "√"
    FAIL = "\u00d7"  # a cross, as linkerd prints it
    SKIP = "-"  # could not be checked (the line says why); not a failure


@dataclass(frozen=True)
class Result:
    name: str
    outcome: Outcome
    detail: str = ""
    fix: str = ""


def ok(name: str, detail: str = "") -> Result:
    return Result(name, Outcome.OK, detail)


def fail(name: str, detail: str, fix: str) -> Result:
    return Result(name, Outcome.FAIL, detail, fix)


def skip(name: str, detail: str) -> Result:
    return Result(name, Outcome.SKIP, detail)


# --- decisions --------------------------------------------------------------------------------------


def evaluate_version(git_version: str) -> Result:
    name = "Kubernetes version"
    problem = features.version_problem(git_version)
    minor = features.parse_minor(git_version)
    tested = ", ".join(f"1.{m}" for m in features.SUPPORTED_MINORS)
    if problem:
        older = minor is not None and minor < (1, features.SUPPORTED_MINORS[0])
        return fail(
            name,
            problem,
            f"upgrade the cluster to {tested}"
            if older
            else f"run gpuslice on {tested}, or a gpuslice release "
            "tested on this version; the feature lines below say what works here",
        )
    if minor is not None and minor < (1, MIN_MINOR):
        return ok(
            name,
            f"{git_version}: DRA is GA, but partitionable devices and consumable capacity are alpha "
            "gates here (see the probe below)",
        )
    return ok(name, f"{git_version} (gpuslice is tested on {tested})")


def evaluate_features(platform: features.Platform) -> list[Result]:
    """One line per feature the probe above does not cover: what is off, and what gpuslice does."""
    out = []
    for f in platform.features:
        if f.name == features.PARTITIONABLE:
            continue  # evaluate_probe names its dropped fields
        name = f"{f.name}" + (f" ({f.gate})" if f.gate else "")
        if f.unknown:
            out.append(skip(name, f.reason))
        elif f.on:
            out.append(ok(name, "served"))
        else:
            out.append(fail(name, f"off on Kubernetes {platform.version}: {f.reason}", features.fix(f)))
    return out


def evaluate_dra_served(group_versions: Sequence[str]) -> Result:
    name = f"{c.DRA_GROUP}/{c.DRA_VERSION} (DRA) is served"
    if c.DRA_GROUP_VERSION in group_versions:
        return ok(name)
    served = ", ".join(group_versions) or "no version"
    return fail(
        name,
        f"the API server serves {served} of {c.DRA_GROUP}",
        f"use Kubernetes 1.{DRA_GA_MINOR}+ and leave --runtime-config for {c.DRA_GROUP}/{c.DRA_VERSION} on",
    )


def probe_slices() -> list[dict[str, Any]]:
    return platform_probe.probe_slices()


def evaluate_probe(sent: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]) -> list[Result]:
    """One result per gated feature: kept, or dropped (and which gate turns it on)."""
    dropped = [
        p for s, b in zip(sent, stored, strict=True) for p in dropped_fields(s["spec"], b.get("spec") or {})
    ]
    out = []
    for what in dict.fromkeys(w for _, w in GATED_FIELDS.values()):
        gate = next(g for g, w in GATED_FIELDS.values() if w == what)
        name = f"{what} ({gate}) kept by the API server"
        mine = [p for p in dropped if GATED_FIELDS[p.rsplit(".", 1)[-1]][1] == what]
        if mine:
            out.append(
                fail(
                    name,
                    f"a probe ResourceSlice came back without {', '.join(mine)}",
                    gates_fix(dropped_gates(mine)),
                )
            )
        else:
            out.append(ok(name, "a probe ResourceSlice (server dry run) came back with every field"))
    return out


def evaluate_crds(crds: Mapping[str, Mapping[str, Any] | None]) -> Result:
    name = "CRDs installed and Established"
    missing = [n for n, crd in crds.items() if crd is None]
    pending = [
        n
        for n, crd in crds.items()
        if crd is not None
        and not any(
            x.get("type") == "Established" and x.get("status") == "True"
            for x in (crd.get("status") or {}).get("conditions") or []
        )
    ]
    if missing:
        return fail(name, f"missing: {', '.join(missing)}", INSTALL)
    if pending:
        return fail(name, f"not Established yet: {', '.join(pending)}", "wait a moment, then check again")
    return ok(name, ", ".join(crds))


def live_peers(peering: Mapping[str, Any] | None, now: datetime) -> list[str]:
    """Kopf peers whose last keep-alive is within their lifetime (ClusterKopfPeering status)."""
    out = []
    for peer, info in ((peering or {}).get("status") or {}).items():
        if not isinstance(info, Mapping) or "lastseen" not in info:
            continue
        try:
            # Kopf writes it with its offset; a zone-less one (older Kopf wrote utcnow()) is UTC.
            seen = parse_rfc3339(str(info["lastseen"]), assume_utc=True)
        except ValueError:
            continue
        if seen + timedelta(seconds=int(info.get("lifetime", 60))) >= now:
            out.append(peer)
    return sorted(out)


def evaluate_operator(
    peering: Mapping[str, Any] | None, deployment: Mapping[str, Any] | None, now: datetime
) -> Result:
    name = "operator running"
    peers = live_peers(peering, now)
    available = ((deployment or {}).get("status") or {}).get("availableReplicas") or 0
    if peers:
        return ok(name, f"{len(peers)} replica(s) keep ClusterKopfPeering {c.PEERING_NAME} alive")
    if available:
        return ok(name, f"Deployment {NAMESPACE}/gpuslice-operator has {available} available replica(s)")
    why = (
        f"no ClusterKopfPeering {c.PEERING_NAME}"
        if peering is None
        else f"no replica renewed ClusterKopfPeering {c.PEERING_NAME} within its lifetime"
    )
    return fail(
        name,
        why,
        f"kubectl -n {NAMESPACE} rollout status deploy/gpuslice-operator; its logs: "
        f"kubectl -n {NAMESPACE} logs deploy/gpuslice-operator",
    )


def evaluate_agents(gpu_nodes: Iterable[str], slices: Iterable[Mapping[str, Any]]) -> Result:
    name = "agents publish GPUs"
    publishing: dict[str, int] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != c.DRIVER_NAME or not spec.get("nodeName"):
            continue
        node = spec["nodeName"]
        publishing[node] = publishing.get(node, 0) + len(spec.get("sharedCounters") or [])
    silent = sorted(set(gpu_nodes) - set(publishing))
    if silent:
        return fail(
            name,
            f"GPU node(s) without gpuslice ResourceSlices: {', '.join(silent[:5])}"
            + (f" and {len(silent) - 5} more" if len(silent) > 5 else ""),
            f"kubectl -n {NAMESPACE} get pods -l app.kubernetes.io/name=gpuslice-agent -o wide; "
            f"kubectl -n {NAMESPACE} logs ds/gpuslice-agent",
        )
    if not publishing:
        return fail(
            name,
            f"no node publishes GPUs of driver {c.DRIVER_NAME}; none is labelled {c.GPU_NODE_LABEL}",
            f"label your GPU nodes: kubectl label node <node> {c.GPU_NODE_LABEL}",
        )
    gpus = sum(publishing.values())
    return ok(name, f"{gpus} GPU(s) on {len(publishing)} node(s)")


def evaluate_packages(packages: Iterable[Mapping[str, Any]], models: Iterable[str]) -> Result:
    name = "packages match published GPUs"
    offered = set(models)
    items = list(packages)
    if not items:
        return skip(name, "no GpuPackage defined yet (kubectl apply -f manifests/samples/)")
    unmatched = sorted(
        f"{p['metadata']['name']} ({p.get('spec', {}).get('gpuModel')!r})"
        for p in items
        if p.get("spec", {}).get("gpuModel") not in offered
    )
    if unmatched:
        return fail(
            name,
            f"no node publishes the gpuModel of {', '.join(unmatched)}",
            "gpuModel must equal the NVML product name exactly: "
            "kubectl get resourceslices -o yaml | grep productName",
        )
    return ok(name, f"{len(items)} package(s), each offered by at least one GPU")


def agent_runtime_class(daemonset: Mapping[str, Any] | None) -> str | None:
    """The RuntimeClass the agent pods ask for: the deployed DaemonSet's, or, before it is deployed,
    the base manifests' (nvidia). None: the deployed agent names none."""
    if daemonset is None:
        return RUNTIME_CLASS
    pod = ((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}
    name = pod.get("runtimeClassName")
    return str(name) if name else None


def evaluate_runtime_class(wanted: str | None, present: bool | None, deployed: bool) -> Result:
    """`wanted` (agent_runtime_class) exists? `present`: None when RuntimeClasses may not be read."""
    if wanted is None:
        return ok("RuntimeClass", "the deployed agent uses none (its pods get NVML without one)")
    name = f"RuntimeClass {wanted}"
    if present is None:
        return skip(name, "you may not read RuntimeClasses")
    if present:
        return ok(name)
    whose = "the deployed agent's pods use it" if deployed else "the agent pods of the base manifests use it"
    return fail(
        name,
        f"no RuntimeClass {wanted}: {whose} to get NVML",
        "install the NVIDIA GPU Operator, or kubectl apply -f - <<<"
        f'\'{{"apiVersion":"node.k8s.io/v1","kind":"RuntimeClass","metadata":{{"name":"{wanted}"}},'
        '"handler":"nvidia"}\'',
    )


def evaluate_access(denied: Sequence[str]) -> Result:
    name = "your RBAC allows the checks"
    if denied:
        return fail(
            name,
            f"you may not {'; '.join(denied)}",
            "run gpuslice check as a cluster administrator (the probe needs create on resourceslices)",
        )
    return ok(name)


def render(server: str, results: Sequence[Result]) -> str:
    lines = [f"gpuslice check against {server}"]
    for r in results:
        lines.append(f"{r.outcome.value} {r.name}" + (f": {r.detail}" if r.detail else ""))
        if r.outcome == Outcome.FAIL and r.fix:
            lines.append(f"    fix: {r.fix}")
    failed = sum(1 for r in results if r.outcome == Outcome.FAIL)
    lines.append(f"{failed} check(s) failed" if failed else "all checks passed")
    return "\n".join(lines)


def exit_code(results: Sequence[Result]) -> int:
    return 1 if any(r.outcome == Outcome.FAIL for r in results) else 0


# --- reading the cluster ------------------------------------------------------------------------------

#: (verb, group, resource) the checks need; each denied one is named.
ACCESS = (
    ("create", c.DRA_GROUP, "resourceslices"),
    ("list", c.DRA_GROUP, "resourceslices"),
    ("get", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("list", "", "nodes"),
    ("list", c.API_GROUP, c.PACKAGE_PLURAL),
    ("get", "kopf.dev", "clusterkopfpeerings"),
)


async def _gather(kubeconfig: str | None) -> tuple[str, list[Result]]:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.exceptions import ApiException

    await config.load_kube_config(config_file=kubeconfig)
    async with client.ApiClient() as api:
        server = api.configuration.host
        results: list[Result] = []
        try:
            version = await client.VersionApi(api).get_code()
        except (ApiException, OSError) as exc:
            return server, [
                fail(
                    "API server reachable", str(exc)[:300], "check KUBECONFIG / --kubeconfig and the network"
                )
            ]
        results.append(evaluate_version(version.git_version))

        authz = client.AuthorizationV1Api(api)
        denied = []
        for verb, group, resource in ACCESS:
            review = await authz.create_self_subject_access_review(
                client.V1SelfSubjectAccessReview(
                    spec=client.V1SelfSubjectAccessReviewSpec(
                        resource_attributes=client.V1ResourceAttributes(
                            verb=verb, group=group, resource=resource
                        )
                    )
                )
            )
            if not review.status.allowed:
                denied.append(f"{verb} {resource}" + (f".{group}" if group else ""))
        results.append(evaluate_access(denied))

        groups = await client.ApisApi(api).get_api_versions()
        dra = next((g for g in groups.groups if g.name == c.DRA_GROUP), None)
        served = [v.group_version for v in dra.versions] if dra else []
        results.append(evaluate_dra_served(served))

        objs = client.CustomObjectsApi(api)
        if served and c.DRA_GROUP_VERSION in served:
            sent = probe_slices()
            try:
                stored = [
                    await objs.create_cluster_custom_object(
                        c.DRA_GROUP, c.DRA_VERSION, "resourceslices", body, dry_run="All"
                    )
                    for body in sent
                ]
                results.extend(evaluate_probe(sent, stored))
            except ApiException as exc:
                results.append(
                    fail(
                        "probe ResourceSlice",
                        f"the API server refused it: {exc.status} {exc.reason}",
                        "see above",
                    )
                )

        from gpuslice import kubehttp

        raw = kubehttp.Client(kubehttp.load(kubeconfig), connections=2)
        try:
            platform = await platform_probe.read_platform(raw)
            # the version the server behaves as: /version's emulation fields, which the typed
            # client's VersionInfo leaves out (a 1.37 binary emulating 1.34 is a 1.34 here)
            results[0] = evaluate_version(platform.version)
            results.extend(evaluate_features(platform))
        except (kubehttp.ApiError, OSError) as exc:
            results.append(skip("Kubernetes features", f"could not be read: {exc}"))
        finally:
            await raw.close()

        ext = client.ApiextensionsV1Api(api)
        crds: dict[str, dict[str, Any] | None] = {}
        for name in CRDS:
            try:
                crds[name] = api.sanitize_for_serialization(await ext.read_custom_resource_definition(name))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                crds[name] = None
        results.append(evaluate_crds(crds))

        async def get_or_none(coro: Any) -> Any:
            try:
                return await coro
            except ApiException as exc:
                if exc.status in (403, 404):
                    return None
                raise

        peering = await get_or_none(
            objs.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", c.PEERING_NAME)
        )
        deployment = await get_or_none(
            client.AppsV1Api(api).read_namespaced_deployment("gpuslice-operator", NAMESPACE)
        )
        results.append(
            evaluate_operator(
                peering,
                api.sanitize_for_serialization(deployment) if deployment is not None else None,
                datetime.now(UTC),
            )
        )

        nodes = await client.CoreV1Api(api).list_node(label_selector=c.GPU_NODE_LABEL)
        slices = (await objs.list_cluster_custom_object(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")).get(
            "items"
        ) or []
        results.append(evaluate_agents([n.metadata.name for n in nodes.items], slices))

        models = {
            str(((d.get("attributes") or {}).get("productName") or {}).get("string"))
            for s in slices
            if (s.get("spec") or {}).get("driver") == c.DRIVER_NAME
            for d in (s.get("spec") or {}).get("devices") or []
        }
        packages: list[dict[str, Any]] = []
        if crds.get(CRDS[0]) is not None:
            packages = (
                await objs.list_cluster_custom_object(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL)
            ).get("items") or []
        results.append(evaluate_packages(packages, models))

        agents = await get_or_none(
            client.AppsV1Api(api).read_namespaced_daemon_set("gpuslice-agent", NAMESPACE)
        )
        wanted = agent_runtime_class(api.sanitize_for_serialization(agents) if agents is not None else None)
        runtime_class = (
            await get_or_none(client.NodeV1Api(api).read_runtime_class(wanted))
            if wanted is not None
            else None
        )
        results.append(evaluate_runtime_class(wanted, runtime_class is not None, agents is not None))
        results.append(
            skip(
                "CDI in the container runtime, NVIDIA toolkit settings",
                "not checked yet: the agents do not report their node's runtime configuration",
            )
        )
        return server, results


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check", help="check that a cluster meets gpuslice's prerequisites", description=__doc__
    )
    p.add_argument("--kubeconfig", default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    server, results = asyncio.run(_gather(args.kubeconfig))
    print(render(server, results))
    return exit_code(results)
