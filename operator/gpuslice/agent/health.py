"""Card health: NVML XID events and probes -> DRA device taints on the card's devices, Events, metrics.

A thread of its own blocks in `nvmlEventSetWait_v2` (never the event loop that serves kubelet) and
hands each XID to the loop; the loop also probes every card every few seconds and right after an
XID (lost? a retirement/remap pending?). What that means for the card is
`gpuslice.domain.health`; on a change the card's devices are republished with (or without) the
taint `gpuslice.io/gpu-unhealthy`, kube-controller-manager evicts the pods of a NoExecute device,
and the Node and the GpuSlices on the card get an Event.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gpuslice import constants as c
from gpuslice import logs, metrics
from gpuslice.agent import nvml
from gpuslice.agent.checkpoint import CheckpointStore, ClaimRecord
from gpuslice.agent.events import slice_event
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.kube import Kube
from gpuslice.agent.owners import lookup_owner
from gpuslice.agent.prepare import NodePaths
from gpuslice.domain import health as dh
from gpuslice.kubehttp import ApiError
from gpuslice.timefmt import rfc3339

log = logs.get(__name__)

#: the reasons of the Events the agent records for a card
REASON_UNHEALTHY = "GpuUnhealthy"
REASON_HEALTHY = "GpuHealthy"
#: on a GpuSlice whose card failed (NoExecute) or waits for a reset (NoSchedule)
REASON_SLICE_FAILED = "GpuFailed"
REASON_SLICE_DEGRADED = "GpuPendingReset"

NodeEvent = Callable[[str, str, str], Awaitable[None]]
#: the GpuSlices (namespace/name) holding a prepared claim on the card with this UUID
SlicesOnCard = Callable[[str], Awaitable[list[str]]]
#: (card UUID, XID, when) from the watching thread to the loop
XidQueue = asyncio.Queue[tuple[str, int, str]]


def now_iso() -> str:
    return rfc3339(dt.datetime.now(dt.UTC))


def records_on_card(paths: NodePaths, uuid: str) -> list[ClaimRecord]:
    """The checkpointed claims with any device on the card with this UUID: a multi-GPU product is on
    each of its cards, and a fault on any of them is the product's."""
    checkpoint = CheckpointStore(paths.state_dir / "checkpoint.json").load()
    return [r for r in checkpoint.claims.values() if any(d.gpu_uuid == uuid for d in r.devices)]


def checkpoint_slices(paths: NodePaths, kube: Kube, node: str) -> SlicesOnCard:
    """GpuSlices of the claims prepared on a card, from the checkpoint and the claims' owners."""

    async def on_card(uuid: str) -> list[str]:
        out = []
        for record in records_on_card(paths, uuid):
            owner = await lookup_owner(kube, node, record)
            if owner.key:
                out.append(owner.key)
        return sorted(set(out))

    return on_card


#: (pool, device, card UUID) of one device of a claim
ClaimDevice = tuple[str, str, str]
#: (namespace, name, every device of the claim) of each claim prepared on the card with this UUID
ClaimsOnCard = Callable[[str], list[tuple[str, str, list[ClaimDevice]]]]


def checkpoint_claims(paths: NodePaths) -> ClaimsOnCard:
    def on_card(uuid: str) -> list[tuple[str, str, list[ClaimDevice]]]:
        return [
            (r.namespace, r.name, [(d.pool, d.device, d.gpu_uuid) for d in r.devices])
            for r in records_on_card(paths, uuid)
        ]

    return on_card


def device_status(pool: str, device: str, h: dh.CardHealth, card: str, now: str) -> dict[str, object]:
    """A claim's `status.devices` entry for a device of a card in health `h` (DRA device status)."""
    if h.healthy:
        reason, message = "Healthy", f"{card} is healthy"
    else:
        reason = (
            dh.REASON_GPU_PENDING_RESET if h.condition is dh.Condition.PENDING_REMAP else dh.REASON_GPU_FAILED
        )
        message = f"{card}: {dh.describe(h)}"
    return {
        "driver": c.DRIVER_NAME, "pool": pool, "device": device,
        "conditions": [{"type": dh.SLICE_CONDITION, "status": "True" if h.healthy else "False",
                        "reason": reason, "message": message[:1024],
                        "lastTransitionTime": h.since or now}],
    }  # fmt: skip


@dataclass
class HealthMonitor:
    node: str
    gpus: Sequence[GpuInfo]
    set_taints: Callable[[dict[str, list[dict[str, object]]]], None]
    node_event: NodeEvent
    slices_on_card: SlicesOnCard
    kube: Kube | None = None  # for Events on GpuSlices and the claims' device status
    claims_on_card: ClaimsOnCard | None = None
    probe_interval: float = 5.0
    wait_ms: int = 2000
    health: dict[str, dh.CardHealth] = field(default_factory=dict)
    #: set once the first probe has decided every card (tests and start-up wait on it)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._index = {g.uuid: g.index for g in self.gpus}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        queue: XidQueue = asyncio.Queue()
        stop = threading.Event()
        thread = threading.Thread(
            target=self._watch, args=(loop, queue, stop), name="gpuslice-xid-watch", daemon=True
        )
        thread.start()
        try:
            await self._probe(list(self._index))
            self.ready.set()
            next_probe = time.monotonic() + self.probe_interval
            while True:
                try:
                    uuid, xid, at = await asyncio.wait_for(
                        queue.get(), timeout=max(0.0, next_probe - time.monotonic())
                    )
                except TimeoutError:
                    await self._guarded(self._probe(list(self._index)))
                    next_probe = time.monotonic() + self.probe_interval
                    continue
                await self._guarded(self._on_xid(uuid, xid, at))
        finally:
            stop.set()

    def claim_device_status(self, devices: Sequence[ClaimDevice], now: str) -> list[dict[str, object]]:
        """`status.devices` of a claim: every one of its devices, each with its own card's health. All
        of them in each apply: an apply without an entry this agent applied before removes it, and a
        multi-GPU product's other cards keep what they said."""
        return [
            device_status(pool, device, self.health.get(uuid, dh.HEALTHY),
                          f"GPU {self._index.get(uuid, -1)} ({uuid})", now)
            for pool, device, uuid in devices
        ]  # fmt: skip

    async def _claim_status(self, uuid: str) -> None:
        """The health condition of the devices of each claim prepared on the card, in its status."""
        if self.kube is None or self.claims_on_card is None:
            return
        now = now_iso()
        for namespace, name, devices in self.claims_on_card(uuid):
            try:
                await self.kube.apply_claim_device_status(
                    namespace, name, self.claim_device_status(devices, now)
                )
            except ApiError as exc:  # e.g. RBAC without resourceclaims/driver: Events still tell
                log.warning("could not write the claim's device status", claim=f"{namespace}/{name}",
                            status=exc.status, message=exc.message[:300])  # fmt: skip

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Health watching is the node's safety net: a failed Event or claim lookup must not end it
        (nor the agent with it). Taints are set before anyone is told, so they stand; a lost
        Event is not sent again."""
        try:
            await work
        except Exception:
            log.exception("health step failed; watching on")

    # --- the NVML side (its own thread) ------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop, queue: XidQueue, stop: threading.Event) -> None:
        uuids = list(self._index)
        while not stop.is_set():
            try:
                watch = nvml.XidWatch(uuids)
            except nvml.Error as exc:
                log.warning("cannot watch NVML XID events; retrying", error=str(exc))
                stop.wait(5)
                continue
            try:
                while not stop.is_set():
                    got = watch.wait(self.wait_ms)
                    if got is not None:
                        try:
                            loop.call_soon_threadsafe(queue.put_nowait, (*got, now_iso()))
                        except RuntimeError:  # the loop is closed: the agent is stopping
                            return
                    if any(self.health.get(u, dh.HEALTHY).condition is not dh.Condition.LOST
                           for u in watch.unregistered):  # fmt: skip
                        break  # a card lost at registration answers again: register it too
            except nvml.Error as exc:
                log.warning("NVML event wait failed; watching again", error=str(exc))
                stop.wait(1)
            finally:
                watch.close()

    # --- decisions and what they change ------------------------------------------------------------

    async def _on_xid(self, uuid: str, xid: int, at: str) -> None:
        cls = dh.classify(xid)
        index = self._index.get(uuid, -1)
        metrics.GPU_XIDS.labels(self.node, uuid, str(xid), cls.value).inc()
        log_fn = log.warning if cls in (dh.XidClass.FATAL, dh.XidClass.PENDING) else log.info
        log_fn("XID event", gpu=index, uuid=uuid, xid=xid, xid_class=cls.value, what=dh.xid_text(xid))
        if cls is dh.XidClass.UNCLASSIFIED:
            log.warning("unclassified XID: counted, the card stays in service", gpu=index, xid=xid)
        new = dict(self.health)
        new[uuid] = dh.after_xid(self.health.get(uuid, dh.HEALTHY), xid, at)
        await self._apply(new)
        await self._probe([uuid])  # what the XID did to the card, at once

    async def _probe(self, uuids: list[str]) -> None:
        def read() -> dict[str, nvml.CardProbe]:
            with nvml.session():
                return {u: nvml.probe(u) for u in uuids}

        try:
            probes = await asyncio.to_thread(read)
        except nvml.Error as exc:
            log.warning("NVML health probe failed; trying again", error=str(exc))
            return
        now = now_iso()
        new = dict(self.health)
        for uuid, p in probes.items():
            probe = dh.Probe(lost=p.lost, pending=p.pending, remap_failed=p.remap_failed)
            new[uuid] = dh.after_probe(self.health.get(uuid, dh.HEALTHY), probe, now)
        await self._apply(new)

    async def _apply(self, new: dict[str, dh.CardHealth]) -> None:
        old, self.health = self.health, new
        taints = {u: [t] for u, h in new.items() if (t := dh.taint(h)) is not None}
        self.set_taints(taints)  # republished before anyone is told
        for uuid, h in new.items():
            before = old.get(uuid, dh.HEALTHY)
            index = self._index.get(uuid, -1)
            metrics.GPU_HEALTHY.labels(self.node, uuid, str(index)).set(1 if h.healthy else 0)
            if h == before or (h.condition is before.condition and h.xid == before.xid):
                continue
            card = f"GPU {index} ({uuid})"
            await self._claim_status(uuid)
            if h.healthy:
                log.info("card healthy again; devices untainted", gpu=index, uuid=uuid)
                await self.node_event("Normal", REASON_HEALTHY, f"{card} is healthy again; devices untainted")
                continue
            message = f"{card}: {dh.describe(h)}"
            log.error("card unhealthy; devices tainted", gpu=index, uuid=uuid, condition=h.condition.value,
                      xid=h.xid, taint=dh.taint(h))  # fmt: skip
            await self.node_event("Warning", REASON_UNHEALTHY, message)
            if self.kube is not None:
                pending = h.condition is dh.Condition.PENDING_REMAP
                reason = REASON_SLICE_DEGRADED if pending else REASON_SLICE_FAILED
                for key in await self.slices_on_card(uuid):
                    text = f"on node {self.node}, {message}"
                    await slice_event(self.kube, self.node, key, "Warning", reason, text)
