"""`gpuslice usage`: slice-hours and cost per namespace and package, from the metering ledger (GpuUsage).

Reads the GpuUsage objects of the months asked for (a tenant can read its own namespace's), clips
their intervals to the period, and prints per namespace and package the slice-hours, the most slices
held at once and the cost (with `--intervals` every interval, with `--advice` which slices would fit
a smaller package, keep hitting their edge, or sit idle). An open interval counts up to now.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.api.package import GpuPackageSpec
from gpuslice.api.usage import GpuUsage
from gpuslice.domain.ledger import (
    Advice,
    Interval,
    Product,
    Total,
    advise,
    clip,
    load,
    money,
    month_end,
    month_of,
    month_start,
    months_between,
    totals,
)
from gpuslice.timefmt import parse_rfc3339, rfc3339


class UsageError(Exception):
    """Bad arguments or an unreadable ledger: printed as `gpuslice usage: <message>`, exit 2."""


def parse_when(value: str, *, end: bool = False) -> datetime:
    """RFC 3339 (2026-12-05T10:00:00Z, or with an offset), a date (2026-12-05: its start, UTC) or a
    month (2026-12)."""
    with contextlib.suppress(ValueError):
        return parse_rfc3339(value)
    for fmt in ("%Y-%m-%d", "%Y-%m"):
        try:
            return datetime.strptime(value, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise UsageError(
        f"{'--until' if end else '--since'} {value!r}: give 2026-12-05T10:00:00Z, 2026-12-05 or 2026-12"
    )


def period(args: argparse.Namespace, now: datetime) -> tuple[datetime, datetime]:
    if args.month and (args.since or args.until):
        raise UsageError("--month and --since/--until pick the period two ways: give one")
    if args.month:
        try:
            start = month_start(args.month)
        except ValueError as exc:
            raise UsageError(f"--month {args.month!r} is not YYYY-MM, e.g. 2026-12") from exc
        return start, min(month_end(args.month), now)
    since = parse_when(args.since) if args.since else month_start(month_of(now))
    until = parse_when(args.until, end=True) if args.until else now
    if until <= since:
        raise UsageError(f"--until {rfc3339(until)} is not after --since {rfc3339(since)}")
    return since, min(until, now)


def add_namespace_arguments(p: argparse.ArgumentParser) -> None:
    """-n/--namespace or -A/--all-namespaces, as kubectl takes them (`namespace_of` reads them)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)"
    )
    where.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace you may read")


def namespace_of(args: argparse.Namespace) -> str | None:
    """The namespace `add_namespace_arguments` asked for; None for every namespace."""
    return None if args.all_namespaces else (args.namespace or context_namespace(args.kubeconfig))


def context_namespace(kubeconfig: str | None) -> str:
    """The kubeconfig context's namespace, as kubectl takes it; `default` without one."""
    path = (
        kubeconfig
        or (os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")).split(os.pathsep)[0]
    )
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except OSError:
        return "default"
    ctx: dict[str, Any] = next(
        (x["context"] for x in doc.get("contexts") or [] if x["name"] == doc.get("current-context")), {}
    )
    return str(ctx.get("namespace") or "default")


async def fetch(
    kubeconfig: str | None, namespace: str | None, months: Sequence[str]
) -> tuple[list[tuple[str, GpuUsage]], list[Product] | None, dict[str, set[str]] | None]:
    """The GpuUsage objects of `months` ((namespace, object)), the products and, per namespace, the
    packages its gpuslice quota entitles it to (each None when unreadable with these credentials)."""
    client = kubehttp.Client(kubehttp.load(kubeconfig), connections=4)
    try:
        url = kubehttp.path(c.API_GROUP, c.API_VERSION, c.USAGE_PLURAL, namespace=namespace)
        selector = f"{c.LABEL_MONTH} in ({','.join(months)})"
        try:
            listing = await client.get(url, labelSelector=selector)
        except kubehttp.ApiError as exc:
            where = f"namespace {namespace}" if namespace else "all namespaces"
            raise UsageError(f"cannot read GpuUsage in {where}: {exc.message}") from exc
        found = [
            ((item.get("metadata") or {}).get("namespace", ""), GpuUsage.model_validate(item))
            for item in listing.get("items") or []
        ]
        entitled: dict[str, set[str]] | None = None
        try:
            quotas = await client.get(
                kubehttp.path("", "v1", "resourcequotas", namespace=namespace),
                fieldSelector=f"metadata.name={c.QUOTA_NAME}",
            )
        except kubehttp.ApiError:
            pass  # not readable: every package of the model may be advised
        else:
            entitled = {}
            for item in quotas.get("items") or []:
                ns = (item.get("metadata") or {}).get("namespace", "")
                hard = (item.get("spec") or {}).get("hard") or {}
                entitled.setdefault(ns, set()).update(
                    k.removesuffix(c.QUOTA_DEVICES_SUFFIX).removesuffix(c.DEVICE_CLASS_SUFFIX)
                    for k, v in hard.items()
                    if k.endswith(c.QUOTA_DEVICES_SUFFIX) and str(v) not in ("0", "")
                )
        try:
            packages = await client.get(kubehttp.path(c.API_GROUP, c.API_VERSION, c.PACKAGE_PLURAL))
        except kubehttp.ApiError:
            products = None
        else:
            products = []
            for item in packages.get("items") or []:
                spec = GpuPackageSpec.model_validate(item.get("spec") or {})
                name = (item.get("metadata") or {}).get("name", "")
                products.append(Product(name, spec.gpu_model, spec.fraction, spec.price))
        return found, products, entitled
    finally:
        await client.close()


def intervals_of(found: Sequence[tuple[str, GpuUsage]]) -> list[tuple[str, Interval]]:
    groups: dict[tuple[str, str], list[GpuUsage]] = {}
    for namespace, usage in found:
        groups.setdefault((namespace, usage.month), []).append(usage)
    rows: list[tuple[str, Interval]] = []
    for (namespace, _month), shards in sorted(groups.items()):
        rows.extend((namespace, iv) for iv in load(namespace, shards).intervals)
    return rows


def usage_rows(rows: Sequence[Total]) -> list[dict[str, Any]]:
    return [
        {
            "namespace": t.namespace,
            "package": t.package,
            "sliceSeconds": t.slice_seconds,
            "sliceHours": round(t.slice_seconds / 3600, 4),
            # Hours held times the cards each product takes (a 2-card product 2, a 25 % slice 0.25).
            "cardSeconds": t.card_seconds,
            "cardHours": round(t.card_seconds / 3600, 4) if t.card_seconds is not None else None,
            "peakSlices": t.peak_slices,
            "intervals": t.intervals,
            "cost": money(t.cost) if t.cost is not None else None,
            "currency": t.currency,
            # Of the above, held on quota Kueue lent from the cohort (sharing mode Kueue).
            "borrowedSliceSeconds": t.borrowed_seconds,
            "borrowedCost": money(t.borrowed_cost) if t.borrowed_cost is not None else None,
        }
        for t in rows
    ]


def interval_rows(
    rows: Sequence[tuple[str, Interval]], since: datetime, until: datetime
) -> list[dict[str, Any]]:
    out = []
    for namespace, iv in rows:
        part = clip(iv, since, until)
        if part is None:
            continue
        cost = part.cost(until)
        out.append(
            {
                "namespace": namespace,
                "package": iv.package,
                "slice": iv.slice,
                "claim": iv.claim,
                "claimUID": iv.claim_uid,
                "pod": iv.pod,
                "node": iv.node,
                "gpu": iv.gpu,
                "start": rfc3339(part.start),
                "end": rfc3339(iv.end) if iv.end is not None and part.end == iv.end else None,
                "sliceSeconds": part.seconds(until),
                "cards": iv.cards,
                "cardSeconds": part.card_seconds(until),
                "pricePerHour": iv.price.rate(iv.borrowed) if iv.price else None,  # the rate it is billed at
                "currency": iv.price.currency if iv.price else None,
                "cost": money(cost) if cost is not None else None,
                "peakMemoryBytes": iv.peak_memory_bytes,
                "meanUtilizationPercent": iv.mean_utilization_percent,
                "refusedAllocations": iv.refused_allocations,
                "borrowed": iv.borrowed,
            }
        )
    return out


def advice_rows(advice: Sequence[Advice]) -> list[dict[str, Any]]:
    return [
        {
            "namespace": a.namespace,
            "slice": a.slice,
            "package": a.package,
            "advice": a.kind,
            "suggest": a.suggest,
            "reason": a.reason,
        }
        for a in advice
    ]


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    cells = [[h for h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else str(r[k]) for _, k in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "   ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _csv(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def render(
    output: str,
    since: datetime,
    until: datetime,
    usage: list[dict[str, Any]],
    intervals: list[dict[str, Any]] | None,
    advice: list[dict[str, Any]] | None,
    note: str | None = None,
) -> str:
    if output == "json":
        doc: dict[str, Any] = {"since": rfc3339(since), "until": rfc3339(until), "usage": usage}
        if intervals is not None:
            doc["intervals"] = intervals
        if advice is not None:
            doc["advice"] = advice
        return json.dumps(doc, indent=2)
    if output == "csv":
        parts = [_csv(usage)]
        if intervals is not None:
            parts.append(_csv(intervals))
        if advice is not None:
            parts.append(_csv(advice))
        return "\n".join(p for p in parts if p).rstrip("\n")
    table = [
        dict(
            r,
            sliceHours=f"{r['sliceSeconds'] / 3600:.2f}",
            cardHours=f"{r['cardSeconds'] / 3600:.2f}" if r["cardSeconds"] is not None else None,
            cost=f"{float(r['cost']):.2f}" if r["cost"] else None,
            borrowedSliceHours=f"{r['borrowedSliceSeconds'] / 3600:.2f}",
            borrowedCost=f"{float(r['borrowedCost']):.2f}" if r["borrowedCost"] else None,
        )
        for r in usage
    ]
    # Borrowed hours get their own columns where any were borrowed (sharing mode Kueue).
    borrowed = [("BORROWED-HOURS", "borrowedSliceHours"), ("BORROWED-COST", "borrowedCost")]
    lent = any(r["borrowedSliceSeconds"] for r in usage)
    lines = [f"{rfc3339(since)} .. {rfc3339(until)}"]
    if table:
        lines.append(
            _table(
                table,
                [
                    ("NAMESPACE", "namespace"),
                    ("PACKAGE", "package"),
                    ("SLICE-HOURS", "sliceHours"),
                    ("CARD-HOURS", "cardHours"),
                    ("PEAK", "peakSlices"),
                    ("INTERVALS", "intervals"),
                    ("COST", "cost"),
                    ("CURRENCY", "currency"),
                    *(borrowed if lent else []),
                ],
            )
        )
    else:
        lines.append("no slice was held in this period")
    if intervals is not None:
        lines.append("")
        lines.append(
            _table(
                intervals,
                [
                    ("NAMESPACE", "namespace"),
                    ("SLICE", "slice"),
                    ("PACKAGE", "package"),
                    ("POD", "pod"),
                    ("NODE", "node"),
                    ("GPU", "gpu"),
                    ("START", "start"),
                    ("END", "end"),
                    ("SECONDS", "sliceSeconds"),
                    ("PRICE/H", "pricePerHour"),
                    ("CURRENCY", "currency"),
                ],
            )
        )
    if advice is not None:
        lines.append("")
        if advice:
            lines.extend(
                f"{a['namespace']}/{a['slice']} ({a['package']}): "
                + {"smaller": "use a smaller package", "larger": "use a larger package", "idle": "idle"}[
                    a["advice"]
                ]
                + (f" {a['suggest']}" if a["suggest"] else "")
                + f": {a['reason']}"
                for a in advice
            )
        else:
            lines.append("no advice: every slice seen fits its package")
    if note:
        lines.append(note)
    return "\n".join(lines)


def run(args: argparse.Namespace, now: datetime | None = None) -> str:
    now = now or datetime.now(UTC).replace(microsecond=0)
    since, until = period(args, now)
    namespace = namespace_of(args)
    months = months_between(since, until - timedelta(seconds=1))  # until is exclusive
    found, products, entitled = asyncio.run(fetch(args.kubeconfig, namespace, months))
    rows = intervals_of(found)
    usage = usage_rows(totals(rows, until, since))
    intervals = interval_rows(rows, since, until) if args.intervals else None
    advice = None
    note = None
    if args.advice:
        inside = [(ns, part) for ns, iv in rows if (part := clip(iv, since, until)) is not None]
        advice = advice_rows(advise(inside, products or [], until, entitled))
        if products is None:
            note = (
                "(GpuPackages not readable with these credentials: no package to suggest, idle slices only)"
            )
    return render(args.output, since, until, usage, intervals, advice, note)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "usage",
        help="slice-hours and cost per namespace and package, from the metering ledger",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_namespace_arguments(p)
    p.add_argument(
        "--month", default=None, metavar="YYYY-MM", help="a UTC calendar month (default: this one)"
    )
    p.add_argument(
        "--since", default=None, metavar="T", help="from T: 2026-12-05T10:00:00Z, 2026-12-05 or 2026-12"
    )
    p.add_argument("--until", default=None, metavar="T", help="until T (default: now)")
    p.add_argument("-o", "--output", choices=("table", "csv", "json"), default="table")
    p.add_argument("--intervals", action="store_true", help="every interval too")
    p.add_argument(
        "--advice",
        action="store_true",
        help="slices that would fit a smaller package, keep hitting their edge, or sit idle",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        print(run(args))
    except UsageError as exc:
        print(f"gpuslice usage: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(
            f"gpuslice usage: cannot reach the cluster ({exc}); check --kubeconfig / $KUBECONFIG",
            file=sys.stderr,
        )
        return 1
    return 0
