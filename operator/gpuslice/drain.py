"""`gpuslice drain` / `gpuslice uncordon`: take a node's GPUs (or one card) out of service for
maintenance with DRA DeviceTaintRules, and put them back.

    gpuslice drain --node N [--gpu UUID|INDEX] [--evict] [--wait] [--timeout S]
    gpuslice uncordon --node N [--gpu UUID|INDEX]

drain creates DeviceTaintRules with the taint gpuslice.io/drain=<reason>: NoSchedule (no new
slices; running ones go on) or, with --evict, NoExecute (kube-controller-manager evicts the pods
that use the devices, and the GpuSlice claims allocated there are released, so a workload's new pod
gets a slice elsewhere). --wait returns once no claim is
allocated on the drained devices. uncordon deletes the rules. A rule selects devices by name, so a
card's rules cover the devices it published at drain time (a package added later: drain again).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from gpuslice import constants as c
from gpuslice import kubehttp
from gpuslice.api.resourceclaim import allocated_devices
from gpuslice.api.resourceslice import newest_generation, parse_resource_slices
from gpuslice.domain.drains import LABEL_DRAIN_GPU, LABEL_DRAIN_NODE, drain_rules
from gpuslice.domain.ownership import slice_owner

RULES = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "devicetaintrules")
FIELD_MANAGER = "gpuslice-drain"


class DrainError(RuntimeError):
    pass


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, help_ in (
        ("drain", "take a node's GPUs (or one card) out of service with DeviceTaintRules"),
        ("uncordon", "put a drained node's GPUs (or one card) back in service"),
    ):
        p = sub.add_parser(name, help=help_, description=__doc__)
        p.add_argument("--node", required=True, help="the node (its DRA pool)")
        p.add_argument("--gpu", default=None, metavar="UUID|INDEX", help="only this card (default: all)")
        p.add_argument("--kubeconfig", default=None)
        if name == "drain":
            p.add_argument("--evict", action="store_true", help="NoExecute: evict the pods using the devices")
            p.add_argument("--wait", action="store_true", help="return once no slice is allocated on them")
            p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
            p.add_argument("--reason", default="maintenance", help="the taint's value (a label value)")
        p.set_defaults(func=_drain if name == "drain" else _uncordon)


def _card(devices: list[tuple[str, str]], gpu: str) -> str:
    """The card UUID `gpu` names (a UUID, or the NVML index in device names `gpu-<index>-...`)."""
    uuids = sorted({u for _, u in devices})
    if gpu in uuids:
        return gpu
    if gpu.isdigit():
        found = {u for n, u in devices if n.startswith(f"gpu-{gpu}-")}
        if len(found) == 1:
            return found.pop()
    raise DrainError(
        f"no card {gpu!r} among the node's published devices; its cards: {', '.join(uuids) or 'none'}"
    )


async def _devices(api: kubehttp.Client, node: str) -> list[tuple[str, str]]:
    url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceslices")
    items = (await api.get(url, fieldSelector=f"spec.nodeName={node}")).get("items") or []
    slices = newest_generation(s for s in parse_resource_slices(items) if s.pool == node)
    return [(d.name, d.uuid) for s in slices for d in s.devices if d.uuid]


async def _allocated_on(api: kubehttp.Client, node: str, names: set[str] | None) -> list[dict[str, Any]]:
    """Claims allocated on the node's (named) gpuslice devices."""
    items = (await api.get(kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims"))).get("items") or []
    return [
        claim
        for claim in items
        if any(pool == node and (names is None or d in names) for pool, d in allocated_devices(claim))
    ]


def _key(claim: dict[str, Any]) -> str:
    return f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"


async def _release(api: kubehttp.Client, claims: list[dict[str, Any]]) -> list[str]:
    """Delete the GpuSlice-owned claims among `claims` (not yet being deleted): kube-controller-manager
    evicts their pods, but a claim shared by name stays allocated while a workload's replacement pod
    reserves it again; the operator re-creates it unallocated, so the next pod lands elsewhere."""
    out = []
    for claim in claims:
        meta = claim["metadata"]
        if slice_owner(meta) is None or meta.get("deletionTimestamp"):
            continue
        url = kubehttp.path(c.DRA_GROUP, c.DRA_VERSION, "resourceclaims", meta["name"], meta["namespace"])
        await api.delete(url)
        out.append(_key(claim))
    return out


async def drain(args: argparse.Namespace) -> str:
    api = kubehttp.Client(kubehttp.load(args.kubeconfig))
    try:
        devices = await _devices(api, args.node)
        if not devices:
            raise DrainError(f"node {args.node} publishes no {c.DRIVER_NAME} devices (is its agent running?)")
        gpu = _card(devices, args.gpu) if args.gpu else None
        rules = drain_rules(args.node, devices, gpu, args.evict, args.reason)
        for rule in rules:
            await api.apply(f"{RULES}/{rule['metadata']['name']}", rule, FIELD_MANAGER)
        what = f"card {gpu} of node {args.node}" if gpu else f"node {args.node}"
        effect = rules[0]["spec"]["taint"]["effect"]
        lines = [
            f"drained {what}: {len(rules)} DeviceTaintRule(s), taint {rules[0]['spec']['taint']['key']}"
            f"={args.reason}:{effect}",
            "no new slices there; "
            + ("kube-controller-manager evicts the pods using it" if args.evict else "running ones go on"),
        ]
        names = {n for n, u in devices if u == gpu} if gpu else None
        if args.evict and (released := await _release(api, await _allocated_on(api, args.node, names))):
            lines.append(f"released GpuSlice claim(s) {', '.join(released[:10])}: re-created unallocated")
        if args.wait:
            deadline = time.monotonic() + args.timeout
            while left := [_key(cl) for cl in await _allocated_on(api, args.node, names)]:
                if time.monotonic() > deadline:
                    raise DrainError(f"still allocated after {args.timeout:.0f}s: {', '.join(left[:10])}")
                await asyncio.sleep(1)
            lines.append("no slice is allocated there any more")
        return "\n".join(lines)
    finally:
        await api.close()


async def uncordon(args: argparse.Namespace) -> str:
    api = kubehttp.Client(kubehttp.load(args.kubeconfig))
    try:
        selector = f"{LABEL_DRAIN_NODE}={args.node}"
        if args.gpu:
            selector += f",{LABEL_DRAIN_GPU}={_card(await _devices(api, args.node), args.gpu)}"
        rules = (await api.get(RULES, labelSelector=selector)).get("items") or []
        for rule in rules:
            await api.delete(f"{RULES}/{rule['metadata']['name']}")
        return f"uncordoned: {len(rules)} DeviceTaintRule(s) of {args.node} deleted"
    finally:
        await api.close()


def _drain(args: argparse.Namespace) -> int:
    return _report(drain(args))


def _uncordon(args: argparse.Namespace) -> int:
    return _report(uncordon(args))


def _report(work: Any) -> int:
    try:
        print(asyncio.run(work))
    except (DrainError, kubehttp.ApiError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if (
            isinstance(exc, kubehttp.ApiError)
            and exc.status == 404
            and "the server could not find" in str(exc)
        ):
            # Not the rule missing: the resource itself (Kubernetes 1.35/1.36, README "Kubernetes versions").
            print(
                f"  this API server does not serve {RULES}: DeviceTaintRules are GA from Kubernetes 1.37 "
                "(`gpuslice check` says what this cluster serves); cordon and drain the node instead",
                file=sys.stderr,
            )
        return 1
    return 0
