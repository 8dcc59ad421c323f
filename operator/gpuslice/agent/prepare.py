"""NodePrepareResources / NodeUnprepareResources: claim -> files on the node -> CDI device ids.

`resolve_claim` is the pure decision (which of the claim's allocated devices are this node's, and
what each one is); `Preparer` does the I/O around it and keeps the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuslice import constants as c
from gpuslice import logs, metrics
from gpuslice.agent import cdi, claimcheck, mig
from gpuslice.agent.checkpoint import Checkpoint, CheckpointStore, ClaimRecord, PreparedDevice
from gpuslice.agent.gpus import GpuInfo
from gpuslice.agent.limits import write_limits
from gpuslice.api.resourceclaim import allocation_results
from gpuslice.api.resourceslice import PublishedSlice, find_device, parse_resource_slices
from gpuslice.files import atomic_write
from gpuslice.kubehttp import ApiError
from gpuslice.shim.region import create_usage_region, create_utilization_file, utilization_file_for

log = logs.get(__name__)

FetchClaim = Callable[[str, str], Awaitable[dict[str, Any]]]
ListSlices = Callable[[], Awaitable[list[dict[str, Any]]]]


class PrepareError(Exception):
    """Preparing one claim failed; the message goes back to kubelet and into the pod's events."""


def resolve_claim(
    claim: dict[str, Any], *, uid: str, node: str, slices: Sequence[dict[str, Any]]
) -> list[PreparedDevice]:
    """This node's gpuslice devices of an allocated claim, with what the container needs to know."""
    meta = claim.get("metadata", {})
    where = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    if meta.get("uid") != uid:
        raise PrepareError(
            f"{where} has uid {meta.get('uid')}, kubelet asked for {uid}: the claim was replaced"
        )
    ours = [r for r in allocation_results(claim) if r.pool == node]
    if not ours:
        raise PrepareError(f"{where} has no device of driver {c.DRIVER_NAME} allocated on node {node}")
    published = parse_resource_slices(slices)
    # Several devices are a multi-GPU product: only whole cards, each on its own card (nothing else
    # shares them, so there is no slice to keep apart); a claim of several slices stays refused.
    if len(ours) > 1 and not _whole_cards(published, node, [r.device for r in ours]):
        raise PrepareError(
            f"{where} has {len(ours)} gpuslice devices on this node; "
            "a gpuslice claim holds exactly one slice "
            f"(one request named {c.CLAIM_REQUEST_NAME!r}, count 1), or whole cards of a multi-GPU "
            "product (spec.gpus). Create a GpuSlice per slice."
        )
    prepared: list[PreparedDevice] = []
    for result in ours:
        device = find_device(published, node, result.device)
        if device is None:
            raise PrepareError(
                f"{where}: device {result.device} is not in any ResourceSlice of pool {node}; "
                "the agent will retry once its slices are published"
            )
        hardware = device.mig_profile is not None and device.mig_start is not None
        # a MIG instance is the whole of its SMs: no compute share is published for it
        share = 100 if hardware else device.compute_share
        if device.uuid is None or device.memory_bytes is None or share is None:
            raise PrepareError(
                f"{where}: device {result.device} of pool {node} lacks uuid, memory capacity or "
                "computeShare; it was not published by this agent version"
            )
        package = device.package
        if hardware and package is None:
            package = claimcheck.package_of_request(claim, result.request)
        refused = claimcheck.refusal(claim, result.request, result.device, package, count=len(ours))
        if refused:
            raise PrepareError(f"{where}: {refused}")
        prepared.append(
            PreparedDevice(
                request=result.request,
                pool=node,
                device=result.device,
                gpu_uuid=device.uuid,
                memory_bytes=device.memory_bytes,
                compute_share=share,
                compute_burst=device.compute_burst,
                # The claim's own CDI device (the shim's files) once, with the first card; a MIG
                # claim's spec carries its instance's device nodes, never the whole card's.
                cdi_device_ids=[
                    *([cdi.cdi_device_id(uid)] if not prepared else []),
                    *([] if hardware else [cdi.nvidia_device_id(device.uuid)]),
                ],
                mig_profile=device.mig_profile if hardware else None,
                mig_start=device.mig_start if hardware else None,
                mig_static=True if hardware and device.mig_static else None,
            )
        )
    return prepared


def _whole_cards(published: Sequence[PublishedSlice], node: str, names: Sequence[str]) -> bool:
    """Whether every named device takes all of its card (all of its counter set's memory and
    compute) and no two are on one card."""
    sets = {name: counters for s in published if s.pool == node for name, counters in s.counter_sets.items()}
    cards = set()
    for name in names:
        device = find_device(published, node, name)
        if device is None or device.counter_set is None or device.counter_set in cards:
            return False
        total = sets.get(device.counter_set) or {}
        if not total or any(device.consumes.get(k) != v for k, v in total.items()):
            return False
        cards.add(device.counter_set)
    return True


@dataclass(frozen=True)
class NodePaths:
    """Where the agent keeps per-claim files on the host."""

    state_dir: Path  # checkpoint and per-claim files
    run_dir: Path  # per-slice usage regions
    cdi_dir: Path  # CDI specs the container runtime reads
    shim_library: Path  # libgpuslice.so on the host

    def claim_dir(self, uid: str) -> Path:
        return self.state_dir / "claims" / uid

    def usage_dir(self, uid: str) -> Path:
        return self.run_dir / "slices" / uid

    def cdi_spec(self, uid: str) -> Path:
        return self.cdi_dir / cdi.spec_file_name(uid)


class Preparer:
    def __init__(
        self,
        node: str,
        paths: NodePaths,
        fetch_claim: FetchClaim,
        list_slices: ListSlices,
        gpus: Sequence[GpuInfo] = (),
    ) -> None:
        self.node = node
        self.paths = paths
        #: The node's cards, for the per-GPU memory gauges.
        self.gpus = list(gpus)
        self._fetch_claim = fetch_claim
        self._list_slices = list_slices
        self._store = CheckpointStore(paths.state_dir / "checkpoint.json")
        self._checkpoint: Checkpoint = self._store.load()
        # The checkpoint and the files, one claim at a time: the checkpoint is one file. The reads
        # of the API server stay outside: kubelet prepares the claims of pods that start together in
        # concurrent calls, and each read is a round trip that the others need not wait for.
        self._lock = asyncio.Lock()
        self._count_prepared()

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def _save(self) -> None:
        self._store.save(self._checkpoint)
        self._count_prepared()

    def _count_prepared(self) -> None:
        prepared = [cl for cl in self._checkpoint.claims.values() if cl.state == "Prepared"]
        metrics.PREPARED_CLAIMS.labels(node=self.node).set(len(prepared))
        # Memory of each card handed out to prepared slices (occupancy, not use: that is the shim's).
        for gpu in self.gpus:
            handed_out = sum(d.memory_bytes for cl in prepared for d in cl.devices if d.gpu_uuid == gpu.uuid)
            labels = (self.node, gpu.uuid, gpu.product_name)
            metrics.GPU_MEMORY_ALLOCATED.labels(*labels).set(handed_out)
            metrics.GPU_MEMORY_TOTAL.labels(*labels).set(gpu.memory_bytes)

    async def _resolve(
        self, namespace: str, name: str, uid: str, claim: dict[str, Any] | None
    ) -> list[PreparedDevice]:
        if claim is None:
            claim, slices = await self._read_claim_and_slices(namespace, name)
        else:
            slices = await self._list_slices()
        return resolve_claim(claim, uid=uid, node=self.node, slices=slices)

    async def prepare(
        self,
        namespace: str,
        name: str,
        uid: str,
        *,
        claim: dict[str, Any] | None = None,
        ahead: bool = False,
    ) -> list[PreparedDevice]:
        """Prepare the claim (`claim`: the object when the caller has just read it), or answer from
        the checkpoint when it is prepared. `ahead`: asked by the agent itself for a pod bound to the
        node, not by kubelet (`agent.ahead`)."""
        record = self._checkpoint.claims.get(uid)
        if record is not None and record.state == "Prepared":
            return self._answer(record, ahead)
        devices = await self._resolve(namespace, name, uid, claim) if record is None else None
        async with self._lock:
            record = self._checkpoint.claims.get(uid)
            if record is not None and record.state == "Prepared":
                return self._answer(record, ahead)  # a concurrent call for the same claim prepared it
            if record is None:
                if devices is None:  # the recorded claim was unprepared while this call waited
                    devices = await self._resolve(namespace, name, uid, None)
                record = ClaimRecord(
                    uid=uid,
                    namespace=namespace,
                    name=name,
                    state="PrepareStarted",
                    devices=devices,
                    ahead=ahead,
                )
                self._checkpoint.claims[uid] = record
                self._save()
            elif not ahead:
                record.ahead = False
            # A record left in PrepareStarted by a killed agent is finished from what it recorded,
            # without asking the API again: the files below are written idempotently.
            self._write_files(record)
            record.state = "Prepared"
            self._save()
            log.info(
                "claim prepared",
                claim=f"{namespace}/{name}",
                ahead_of_kubelet=record.ahead,
                uid=uid,
                devices=[d.device for d in record.devices],
            )
            return record.devices

    @staticmethod
    def _answer(record: ClaimRecord, ahead: bool) -> list[PreparedDevice]:
        if not ahead and record.ahead:
            # kubelet has taken the claim: from now on only its NodeUnprepareResources removes it.
            # Not saved here (kubelet is waiting); the next save records it, and a restarted agent
            # that still reads `ahead` unprepares the claim only when no pod of the node uses it,
            # which is when kubelet unprepares it too.
            record.ahead = False
            log.info("claim prepared ahead taken by kubelet", claim=f"{record.namespace}/{record.name}")
        return record.devices

    async def unprepare_unclaimed(self, uid: str) -> None:
        """Unprepare a claim prepared ahead that kubelet never asked for; nothing when kubelet has
        asked for it meanwhile or it is gone."""
        async with self._lock:
            record = self._checkpoint.claims.get(uid)
            if record is None or not record.ahead:
                return
            self._remove(record.uid)
            log.info(
                "claim prepared ahead unprepared: no pod of the node uses it",
                claim=f"{record.namespace}/{record.name}",
                uid=uid,
            )

    async def _read_claim_and_slices(
        self, namespace: str, name: str
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The claim and this node's ResourceSlices, asked for at the same time: kubelet waits for
        prepare before it makes the pod's sandbox, so two round trips in a row would delay every
        slice pod's start by one. The claim's error wins when both fail."""
        claim, slices = await asyncio.gather(
            self._fetch_claim(namespace, name), self._list_slices(), return_exceptions=True
        )
        for outcome in (claim, slices):
            if isinstance(outcome, BaseException):
                raise outcome
        assert not isinstance(claim, BaseException) and not isinstance(slices, BaseException)
        return claim, slices

    def _write_files(self, record: ClaimRecord) -> None:
        device = record.devices[0]
        if device.mig_profile is not None:
            self._write_mig(record, device)
            return
        claim_dir = self.paths.claim_dir(record.uid)
        claim_dir.mkdir(parents=True, exist_ok=True)
        preload = claim_dir / "ld.so.preload"
        atomic_write(preload, f"{c.CONTAINER_SHIM_PATH}\n".encode(), 0o444)
        limits = claim_dir / "slice.conf"
        whole = len(record.devices) > 1  # whole cards of a multi-GPU product: nothing to hold back
        write_limits(
            limits,
            memory_bytes=None if whole else device.memory_bytes,
            compute_share=100 if whole else device.compute_share,
            gpu_uuid=device.gpu_uuid,
        )
        # must exist before a container bind-mounts it; the usage reporter updates it in place
        create_utilization_file(utilization_file_for(limits))
        usage = self.paths.usage_dir(record.uid)
        # an existing usage region is kept: containers of the claim may already be using it
        create_usage_region(usage)
        spec = cdi.build_spec(
            record.uid,
            preload_file=preload,
            shim_library=self.paths.shim_library,
            limits_file=limits,
            usage_dir=usage,
        )
        self.paths.cdi_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.paths.cdi_spec(record.uid), json.dumps(spec, indent=1).encode())

    def _write_mig(self, record: ClaimRecord, device: PreparedDevice) -> None:
        """Make the claim's MIG instance (or find the one a killed agent made) and a CDI spec that
        names only it; the UUID is checkpointed before the spec is written."""
        try:
            instance, gpu_minor = mig.create(device)
            device.mig_uuid = instance.uuid
            self._save()
            spec = mig.cdi_spec(record.uid, instance, gpu_minor)
        except mig.MigPrepareError as exc:
            raise PrepareError(str(exc)) from exc
        self.paths.cdi_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.paths.cdi_spec(record.uid), json.dumps(spec, indent=1).encode())

    async def unprepare(self, uid: str) -> None:
        async with self._lock:
            record = self._remove(uid)
            if record is not None:
                log.info("claim unprepared", claim=f"{record.namespace}/{record.name}", uid=uid)

    def _remove(self, uid: str) -> ClaimRecord | None:
        """The claim's files and record gone (under the lock); the record it had."""
        record = self._checkpoint.claims.get(uid)
        for d in record.devices if record is not None else ():
            if d.mig_profile is not None:
                try:
                    mig.destroy(d)  # before the record goes: a failure is retried by kubelet
                except mig.MigPrepareError as exc:
                    raise PrepareError(str(exc)) from exc
        self.paths.cdi_spec(uid).unlink(missing_ok=True)
        shutil.rmtree(self.paths.claim_dir(uid), ignore_errors=True)
        shutil.rmtree(self.paths.usage_dir(uid), ignore_errors=True)
        if record is not None:
            del self._checkpoint.claims[uid]
            self._save()
        return record


async def prepare_many(
    preparer: Preparer, claims: Sequence[tuple[str, str, str]]
) -> dict[str, list[PreparedDevice] | str]:
    """Prepare each (namespace, name, uid); a failure of one claim is its error string, not an exception."""
    out: dict[str, list[PreparedDevice] | str] = {}
    for namespace, name, uid in claims:
        try:
            out[uid] = await preparer.prepare(namespace, name, uid)
        except PrepareError as exc:
            out[uid] = str(exc)
        except (OSError, ValueError) as exc:  # files could not be written; retried on the next call
            out[uid] = f"writing the slice's files for {namespace}/{name}: {exc}"
        except ApiError as exc:
            what = f"ResourceClaim {namespace}/{name} or this node's ResourceSlices"
            out[uid] = f"reading {what}: {exc.status} {exc.reason}"
        else:
            continue
        metrics.PREPARE_ERRORS.labels(node=preparer.node).inc()
        log.warning("claim not prepared", claim=f"{namespace}/{name}", uid=uid, error=out[uid])
    return out
