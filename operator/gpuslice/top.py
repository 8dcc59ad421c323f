"""`gpuslice top`: each card's slices, memory and utilization, each namespace's slices held against
its entitlement and each package's capacity, read from the API (and from Prometheus with `--prometheus`).

From the API: GpuSlices (where each is allocated, and the usage the node agent writes into its
status), each tenant namespace's `gpuslice` ResourceQuota (slices held and entitled per package,
GpuSlices and `resources.limits` pods together) and, where these credentials may read them, the
ResourceSlices the agents publish (every card, its model, memory and health, also cards that hold
no slice). With `--prometheus URL` a slice's memory used and utilization and a card's health are
Prometheus' latest samples of the agents' series instead (what the dashboard shows; a template
slice's pods have usage only there). A tenant who may read neither sees their own slices and quota.
`--watch` redraws every `--interval` seconds until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.api.package import PackageCapacity
from gpuslice.api.quantity import parse_int_quantity
from gpuslice.api.resourceslice import PublishedSlice, newest_generation, parse_resource_slices
from gpuslice.domain.entitlement_use import entitlement_use
from gpuslice.domain.health import tainted_effect
from gpuslice.usage import add_namespace_arguments, namespace_of

GIB = 1024**3


class TopError(Exception):
    """Bad arguments or an unreadable API: printed as `gpuslice top: <message>`, exit 2."""


@dataclass
class SliceRow:
    """One allocation of a GpuSlice (a template slice has one per pod), or a slice still waiting."""

    namespace: str
    slice: str
    package: str
    phase: str
    node: str | None = None
    gpu_uuid: str | None = None
    pod: str | None = None
    memory_used_bytes: int | None = None
    memory_limit_bytes: int | None = None
    #: share of the card's compute used over the agent's last sampling interval, 0..1
    utilization: float | None = None
    #: where memory used and utilization come from: "status", "metrics" or None (no reading)
    source: str | None = None
    reason: str = ""


@dataclass
class CardRow:
    node: str
    gpu_uuid: str
    model: str | None = None
    #: False while the card's devices carry a NoSchedule/NoExecute taint, or Prometheus says 0
    healthy: bool = True
    memory_total_bytes: int | None = None
    slices: int = 0
    memory_held_bytes: int = 0
    memory_used_bytes: int | None = None
    utilization: float | None = None
    #: a card slices are allocated on that no ResourceSlice publishes any more
    published: bool = True


@dataclass
class NamespaceRow:
    namespace: str
    package: str
    held: int | None = None
    entitled: int | None = None
    #: GpuSlices of the namespace and package by phase
    phases: dict[str, int] = field(default_factory=dict)
    memory_used_bytes: int | None = None


@dataclass
class PackageRow:
    """A GpuPackage's capacity as the operator last wrote it (what `kubectl get gpupackages` shows)."""

    package: str
    gpus: int = 0
    total: int = 0
    allocated: int = 0
    free: int = 0
    unhealthy_gpus: int = 0


@dataclass
class View:
    slices: list[SliceRow]
    namespaces: list[NamespaceRow]
    #: None when the ResourceSlices are not readable with these credentials
    cards: list[CardRow] | None
    #: None when the GpuPackages are not readable with these credentials
    packages: list[PackageRow] | None = None
    notes: list[str] = field(default_factory=list)


#: (namespace, slice, gpu_uuid) -> value, from Prometheus' instant vectors
Samples = dict[tuple[str, str, str], float]


@dataclass
class Metrics:
    memory_used: Samples = field(default_factory=dict)
    utilization: Samples = field(default_factory=dict)
    #: (node, gpu_uuid) -> 1 healthy / 0 not
    healthy: dict[tuple[str, str], float] = field(default_factory=dict)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _add(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else a + b


def slice_rows(
    slices: Iterable[Mapping[str, Any]],
    published: Sequence[PublishedSlice],
    memory_per_slice: Mapping[str, int],
    metrics: Metrics | None,
) -> list[SliceRow]:
    """A row per allocation (where each slice is and what it uses), a row per slice not allocated."""
    devices = {(d.pool, d.name): d for s in newest_generation(published) for d in s.devices}
    rows = []
    for obj in slices:
        meta, spec, status = _meta(obj), obj.get("spec") or {}, obj.get("status") or {}
        ns, name, package = (
            str(meta.get("namespace", "")),
            str(meta.get("name", "")),
            str(spec.get("package")),
        )
        phase = str(status.get("phase") or "Pending")
        usage = status.get("usage") or {}
        allocations = status.get("allocations") or []
        if not allocations and status.get("node"):
            allocations = [
                {"node": status.get("node"), "gpuUUID": status.get("gpuUUID"), "device": status.get("device")}
            ]
        if not allocations:
            rows.append(SliceRow(ns, name, package, phase, reason=str(status.get("reason") or "")))
            continue
        for a in allocations:
            uuid = a.get("gpuUUID")
            dev = devices.get((str(a.get("pool") or a.get("node") or ""), str(a.get("device") or "")))
            limit = (
                dev.memory_bytes
                if dev is not None and dev.memory_bytes is not None
                else usage.get("memoryLimitBytes") or memory_per_slice.get(package)
            )
            row = SliceRow(
                ns, name, package, phase, node=a.get("node"), gpu_uuid=uuid, pod=a.get("pod"),
                memory_limit_bytes=limit, reason=str(status.get("reason") or ""),
            )  # fmt: skip
            key = (ns, name, str(uuid))
            if metrics is not None and key in metrics.memory_used:
                row.memory_used_bytes = int(metrics.memory_used[key])
                row.utilization = metrics.utilization.get(key)
                row.source = "metrics"
            elif len(allocations) == 1 and usage.get("memoryUsedBytes") is not None:
                # The agent writes one usage per GpuSlice: a template's pods have theirs in metrics only.
                row.memory_used_bytes = int(usage["memoryUsedBytes"])
                pct = usage.get("computeUtilizationPercent")
                row.utilization = None if pct is None else float(pct) / 100
                row.source = "status"
            rows.append(row)
    return sorted(rows, key=lambda r: (r.node or "~", r.gpu_uuid or "", r.namespace, r.slice, r.pod or ""))


def card_rows(
    published: Sequence[PublishedSlice], rows: Sequence[SliceRow], metrics: Metrics | None
) -> list[CardRow]:
    """Every published card (newest pool generation), with the slices allocated on it; a card that
    slices name but no ResourceSlice publishes (its agent withdrew it) too, marked unpublished."""
    live = newest_generation(published)
    # A pool's counter sets (each card's memory) may sit in a ResourceSlice of their own.
    counters = {(s.pool, name): values for s in live for name, values in s.counter_sets.items()}
    cards: dict[tuple[str, str], CardRow] = {}
    for s in live:
        for d in s.devices:
            if d.uuid is None:
                continue
            card = cards.setdefault(
                (s.node or s.pool, d.uuid), CardRow(s.node or s.pool, d.uuid, d.product_name)
            )
            if tainted_effect(d.taints):
                card.healthy = False
            if card.memory_total_bytes is None and d.counter_set:
                card.memory_total_bytes = counters.get((s.pool, d.counter_set), {}).get("memory")
    for r in rows:
        if r.node is None or r.gpu_uuid is None:
            continue
        card = cards.setdefault((r.node, r.gpu_uuid), CardRow(r.node, r.gpu_uuid, published=False))
        card.slices += 1
        card.memory_held_bytes += r.memory_limit_bytes or 0
        card.memory_used_bytes = _add(card.memory_used_bytes, r.memory_used_bytes)
        if r.utilization is not None:
            card.utilization = (card.utilization or 0.0) + r.utilization
    if metrics is not None:
        for (node, uuid), value in metrics.healthy.items():
            if (node, uuid) in cards and value == 0:
                cards[(node, uuid)].healthy = False
    return sorted(cards.values(), key=lambda k: (k.node, k.gpu_uuid))


def namespace_rows(quotas: Iterable[Mapping[str, Any]], rows: Sequence[SliceRow]) -> list[NamespaceRow]:
    """Per namespace and package: slices held and entitled (its gpuslice quota), GpuSlices by phase."""
    out: dict[tuple[str, str], NamespaceRow] = {}
    for q in quotas:
        ns = str(_meta(q).get("namespace", ""))
        status = q.get("status") or {}
        for package, (entitled, held) in entitlement_use(
            status.get("hard") or {}, status.get("used") or {}
        ).items():
            out[(ns, package)] = NamespaceRow(ns, package, held=held, entitled=entitled)
    seen: set[tuple[str, str]] = set()
    for r in rows:
        row = out.setdefault((r.namespace, r.package), NamespaceRow(r.namespace, r.package))
        if (r.namespace, r.slice) not in seen:  # a template slice's pods are one GpuSlice
            seen.add((r.namespace, r.slice))
            row.phases[r.phase] = row.phases.get(r.phase, 0) + 1
        row.memory_used_bytes = _add(row.memory_used_bytes, r.memory_used_bytes)
    return sorted(out.values(), key=lambda r: (r.namespace, r.package))


def build(
    slices: Iterable[Mapping[str, Any]],
    quotas: Iterable[Mapping[str, Any]],
    resource_slices: Iterable[Mapping[str, Any]] | None,
    packages: Iterable[Mapping[str, Any]] | None,
    metrics: Metrics | None = None,
) -> View:
    published = parse_resource_slices(resource_slices or [])
    per_slice = {
        str(_meta(p).get("name")): parse_int_quantity(str(m))
        for p in packages or []
        if (m := (p.get("status") or {}).get("memoryPerSlice"))
    }
    rows = slice_rows(slices, published, per_slice, metrics)
    cards = card_rows(published, rows, metrics) if resource_slices is not None else None
    notes = []
    if resource_slices is None:
        notes.append("(ResourceSlices not readable with these credentials: no card view)")
    return View(rows, namespace_rows(quotas, rows), cards, package_rows(packages), notes)


def package_rows(packages: Iterable[Mapping[str, Any]] | None) -> list[PackageRow] | None:
    if packages is None:
        return None
    out = []
    for p in packages:
        cap = PackageCapacity.model_validate((p.get("status") or {}).get("capacity") or {})
        out.append(
            PackageRow(
                str(_meta(p).get("name", "")),
                cap.gpus,
                cap.slices_total,
                cap.slices_allocated,
                cap.slices_free,
                cap.unhealthy_gpus or 0,
            )
        )
    return sorted(out, key=lambda r: r.package)


# --- rendering ----------------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.1f}Gi"


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r * 100:.0f}%"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    cells = [list(header), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["   ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def render(view: View, output: str = "table") -> str:
    if output == "json":
        return json.dumps(
            {
                "cards": None if view.cards is None else [asdict(k) for k in view.cards],
                "slices": [asdict(r) for r in view.slices],
                "namespaces": [asdict(n) for n in view.namespaces],
                "packages": None if view.packages is None else [asdict(p) for p in view.packages],
                "notes": view.notes,
            },
            indent=2,
        )
    lines: list[str] = []
    if view.cards is not None:
        lines += _table(
            ("NODE", "GPU", "MODEL", "HEALTH", "SLICES", "MEMORY HELD", "MEMORY USED", "UTIL"),
            (
                (
                    k.node,
                    k.gpu_uuid,
                    k.model or "-",
                    ("ok" if k.healthy else "UNHEALTHY") + ("" if k.published else " (not published)"),
                    str(k.slices),
                    f"{_gib(k.memory_held_bytes)}/{_gib(k.memory_total_bytes)}",
                    _gib(k.memory_used_bytes),
                    _pct(k.utilization),
                )
                for k in view.cards
            ),
        )
        lines.append("")
    if view.slices:
        lines += _table(
            ("NAMESPACE", "SLICE", "PACKAGE", "PHASE", "NODE", "GPU", "POD", "MEMORY", "UTIL"),
            (
                (
                    r.namespace,
                    r.slice,
                    r.package,
                    r.phase
                    + (f" ({r.reason})" if r.node is None and r.reason and r.reason != r.phase else ""),
                    r.node or "-",
                    r.gpu_uuid or "-",
                    r.pod or "-",
                    f"{_gib(r.memory_used_bytes)}/{_gib(r.memory_limit_bytes)}",
                    _pct(r.utilization),
                )
                for r in view.slices
            ),
        )
    else:
        lines.append("no GpuSlices")
    if view.namespaces:
        lines.append("")
        lines += _table(
            ("NAMESPACE", "PACKAGE", "HELD", "ENTITLED", "SLICES", "MEMORY USED"),
            (
                (
                    n.namespace,
                    n.package,
                    "-" if n.held is None else str(n.held),
                    "-" if n.entitled is None else str(n.entitled),
                    ", ".join(f"{v} {k}" for k, v in sorted(n.phases.items())) or "-",
                    _gib(n.memory_used_bytes),
                )
                for n in view.namespaces
            ),
        )
    if view.packages:
        lines.append("")
        lines += _table(
            ("PACKAGE", "GPUS", "SLICES", "ALLOCATED", "FREE", "UNHEALTHY GPUS"),
            (
                (p.package, str(p.gpus), str(p.total), str(p.allocated), str(p.free), str(p.unhealthy_gpus))
                for p in view.packages
            ),
        )
    lines += view.notes
    return "\n".join(lines)


# --- reading ------------------------------------------------------------------------------------------


async def _query(session: aiohttp.ClientSession, base: str, promql: str) -> list[dict[str, Any]]:
    async with session.get(f"{base.rstrip('/')}/api/v1/query", params={"query": promql}) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise TopError(f"Prometheus at {base} answered {resp.status} to {promql!r}: {body[:200]}")
    doc = json.loads(body)
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


async def read_metrics(base: str, namespace: str | None) -> Metrics:
    """The agents' latest per-slice samples (of `namespace`, or all) and every card's health."""
    sel = f'{{namespace="{namespace}"}}' if namespace else ""
    out = Metrics()
    timeout = aiohttp.ClientTimeout(total=15)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for name, target in (
                ("gpuslice_slice_memory_used_bytes", out.memory_used),
                ("gpuslice_slice_compute_utilization_ratio", out.utilization),
            ):
                # `max by`: one value per slice and card, whichever target or instance exported it
                for s in await _query(session, base, f"max by (namespace, slice, gpu_uuid) ({name}{sel})"):
                    m = s["metric"]
                    target[(m.get("namespace", ""), m.get("slice", ""), m.get("gpu_uuid", ""))] = float(
                        s["value"][1]
                    )
            for s in await _query(session, base, "min by (node, gpu_uuid) (gpuslice_gpu_healthy)"):
                m = s["metric"]
                out.healthy[(m.get("node", ""), m.get("gpu_uuid", ""))] = float(s["value"][1])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        raise TopError(f"cannot read Prometheus at {base}: {exc!r}") from exc
    return out


async def fetch(
    kubeconfig: str | None, namespace: str | None
) -> tuple[
    list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]] | None, list[dict[str, Any]] | None
]:
    """GpuSlices and gpuslice quotas of `namespace` (None: all), and the ResourceSlices and
    GpuPackages (each None when not readable with these credentials)."""
    client = kubehttp.Client(kubehttp.load(kubeconfig), connections=4)
    where = f"namespace {namespace}" if namespace else "all namespaces"
    try:
        try:
            slices = await client.get(
                kubehttp.path(c.API_GROUP, c.API_VERSION, c.SLICE_PLURAL, namespace=namespace)
            )
        except kubehttp.ApiError as exc:
            raise TopError(f"cannot list GpuSlices in {where}: {exc.message}") from exc
        try:
            quotas = (
                await client.get(
                    kubehttp.path("", "v1", "resourcequotas", namespace=namespace),
                    fieldSelector=f"metadata.name={c.QUOTA_NAME}",
                )
            ).get("items") or []
        except kubehttp.ApiError:
            quotas = []  # held/entitled shown as "-": the slices themselves are still counted
        optional: list[list[dict[str, Any]] | None] = []
        for url in (
            kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceslices"),
            kubehttp.path(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL),
        ):
            try:
                optional.append((await client.get(url)).get("items") or [])
            except kubehttp.ApiError as exc:
                if exc.status not in (401, 403):
                    raise TopError(f"cannot list {url}: {exc.message}") from exc
                optional.append(None)
        return list(slices.get("items") or []), list(quotas), optional[0], optional[1]
    finally:
        await client.close()


async def snapshot(args: argparse.Namespace, namespace: str | None) -> View:
    slices, quotas, resource_slices, packages = await fetch(args.kubeconfig, namespace)
    metrics = await read_metrics(args.prometheus, namespace) if args.prometheus else None
    return build(slices, quotas, resource_slices, packages, metrics)


def run(args: argparse.Namespace) -> int:
    namespace = namespace_of(args)
    clear = args.watch and sys.stdout.isatty()
    while True:
        text = render(asyncio.run(snapshot(args, namespace)), args.output)
        if clear:
            sys.stdout.write("\x1b[H\x1b[2J")
        print(text, flush=True)
        if not args.watch:
            return 0
        if not clear:
            print(flush=True)  # frames of a piped --watch apart
        time.sleep(args.interval)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top",
        help="each card's slices, memory and utilization, and slices held against entitlements",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_namespace_arguments(p)
    p.add_argument(
        "--prometheus",
        default=None,
        metavar="URL",
        help="read memory used, utilization and card health from this Prometheus (e.g. http://localhost:9090)",
    )
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("-w", "--watch", action="store_true", help="redraw until interrupted")
    p.add_argument("--interval", type=float, default=5.0, metavar="S", help="seconds between redraws (5)")
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print(f"gpuslice top: --interval {args.interval}: give a number of seconds above 0", file=sys.stderr)
        return 2
    try:
        return run(args)
    except TopError as exc:
        print(f"gpuslice top: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, aiohttp.ClientError) as exc:
        print(
            f"gpuslice top: cannot reach the cluster ({exc}); check --kubeconfig / $KUBECONFIG",
            file=sys.stderr,
        )
        return 1
